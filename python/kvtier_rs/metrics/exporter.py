"""The in-process HTTP exporter.

Multiprocess story (engines that run the scheduler and the workers in different processes):
the series come from the tiers' own counters, which live in the process that owns the
`TierOrchestrator` (in vLLM and TensorRT-LLM, the scheduler process); workers only copy bytes
and hold no tier state. So each process that owns tiers serves its own port with
`serve(port, labels={...})`, and Prometheus scrapes each one as a target; queries aggregate
with `sum by (...)`. A distinguishing constant label (data-parallel rank, engine id) keeps the
processes apart when they share a job.

prometheus-client's multiprocess mode (`PROMETHEUS_MULTIPROC_DIR`) is not used, on purpose:
it aggregates only the library's own metric objects through mmap files and does not run custom
collectors, so it would need every counter mirrored into those objects on every change. The
exporter serves its own registry, so an engine that sets `PROMETHEUS_MULTIPROC_DIR` for its own
metrics does not affect it (tested).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest, start_http_server

from kvtier_rs.checks import invalid_argument
from kvtier_rs.metrics.collector import KvTierCollector
from kvtier_rs.tiers.events import EventStream


@dataclass
class MetricsServer:
    """A running exporter; `close()` stops it (also usable as a context manager)."""

    port: int
    addr: str
    registry: CollectorRegistry
    collector: KvTierCollector
    _server: Any
    _thread: threading.Thread

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr  # an IPv6 literal
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def make_registry(
    orchestrator: Any = None,
    *,
    host: Any = None,
    disk: Any = None,
    events: EventStream | None = None,
    labels: Mapping[str, str] | None = None,
) -> tuple[CollectorRegistry, KvTierCollector]:
    """A fresh registry holding only the kvtier collector (no process/platform collectors, so
    two exporters in one host never clash). Register the collector in an engine's own registry
    instead with `registry.register(KvTierCollector(...))`."""
    registry = CollectorRegistry(auto_describe=True)
    collector = KvTierCollector(orchestrator, host=host, disk=disk, events=events, labels=labels)
    registry.register(collector)
    return registry, collector


def serve(
    port: int,
    orchestrator: Any = None,
    *,
    host: Any = None,
    disk: Any = None,
    events: EventStream | None = None,
    labels: Mapping[str, str] | None = None,
    addr: str = "127.0.0.1",
) -> MetricsServer:
    """Serve the kvtier series at http://addr:port/metrics from a daemon thread. `port=0`
    picks a free port (read it back from `.port`). Binds to 127.0.0.1 unless told otherwise:
    expose it deliberately (e.g. addr="0.0.0.0" behind the cluster's network policy)."""
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise invalid_argument("port", f"must be an int in 0..65535, got {port!r}")
    registry, collector = make_registry(orchestrator, host=host, disk=disk, events=events, labels=labels)
    try:
        server, thread = start_http_server(port, addr=addr, registry=registry)
    except OSError as e:  # port in use, no such address or host, not allowed to bind
        raise OSError(e.errno, f"metrics exporter cannot listen on {addr}:{port}: {e.strerror or e}") from e
    return MetricsServer(server.server_port, addr, registry, collector, server, thread)


def exposition(registry: CollectorRegistry) -> bytes:
    """The text exposition of a registry (for engines that serve metrics themselves)."""
    return generate_latest(registry)
