"""A Prometheus collector over the tiers' own counters.

Nothing is counted twice: the core and the orchestrator already count everything, so the
collector holds no metric objects of its own. Each scrape takes the orchestrator's `snapshot()`
once (which reads each tier's core stats once), or reads each bare tier's `stats()` once, and
turns that into the series of `names.SERIES`, every label combination present, zero where a
tier has not moved data or is not configured.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvtier_rs._core import InvalidArgumentError
from kvtier_rs.checks import invalid_argument
from kvtier_rs.metrics.names import REMOTE_MISS_REASONS, SERIES, Series
from kvtier_rs.orchestrator.latency import BUCKETS
from kvtier_rs.orchestrator.orchestrator import TierOrchestrator, occupancy
from kvtier_rs.orchestrator.stats import CpuTierSnapshot, DataPathSnapshot, DiskTierSnapshot, RemoteTierSnapshot
from kvtier_rs.tiers.events import EventStream

Labels = tuple[str, ...]
Histogram = tuple[list[tuple[float, int]], int, float]

_EMPTY_HISTOGRAM: Histogram = ([(b, 0) for b in (*BUCKETS, float("inf"))], 0, 0.0)


# Prometheus's label-name grammar (its data model), written out: prometheus-client's own checks
# are private, and from 0.21 on accept any UTF-8 name unless legacy validation is switched on,
# while Prometheus servers before 3.0 and most tooling take only these names.
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
# `le` is the bucket bound of every histogram sample and `quantile` a summary's: a constant label
# of that name would be replaced by (or clash with) them. Names starting with "__" belong to
# Prometheus itself.
_RESERVED_LABELS = ("le", "quantile")


def _const_labels(labels: object) -> dict[str, str]:
    """Constant labels as a dict, every name a valid, unreserved Prometheus label name that no
    kvtier series uses, every value a string; else InvalidArgumentError naming `labels`."""
    if labels is None:
        return {}
    if not isinstance(labels, Mapping):
        raise invalid_argument("labels", f"expected a dict of label name -> value, got {labels!r}")
    for name, value in labels.items():
        if not isinstance(name, str) or not _LABEL_NAME.fullmatch(name):
            raise invalid_argument("labels", f"{name!r} is not a Prometheus label name ([a-zA-Z_][a-zA-Z0-9_]*)")
        if name.startswith("__") or name in _RESERVED_LABELS:
            raise invalid_argument("labels", f"{name!r} is a reserved Prometheus label name")
        if any(name in s.labelnames for s in SERIES):
            raise invalid_argument("labels", f"{name!r} is already a label of kvtier series")
        if not isinstance(value, str):
            # Caught here, not at the first scrape, where the exposition fails on it (HTTP 500).
            raise invalid_argument("labels", f"the value of {name!r} must be a str, got {value!r}")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            # A lone surrogate (say, from a badly decoded environment variable) would fail every
            # exposition, which is UTF-8.
            raise invalid_argument(
                "labels", f"the value of {name!r} is not encodable as UTF-8 ({e.reason} at {e.start})"
            ) from None
    return dict(labels)


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


class KvTierCollector(Collector):
    """Collects from a `TierOrchestrator`, or from bare tiers (`host`: a `HostTier`, `disk`: a
    `DiskTier`) when no orchestrator runs; `events` defaults to the orchestrator's stream.
    `labels` are constant labels added to every sample (e.g. ``{"engine": "dp0"}``) so that
    several processes' exporters can be told apart after Prometheus scrapes them all."""

    def __init__(
        self,
        orchestrator: TierOrchestrator | None = None,
        *,
        host: Any = None,
        disk: Any = None,
        events: EventStream | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        if orchestrator is None and host is None and disk is None:
            raise invalid_argument("orchestrator", "give an orchestrator, or a bare `host` and/or `disk` tier")
        if orchestrator is not None and (host is not None or disk is not None):
            raise InvalidArgumentError(
                "invalid argument `host`/`disk`: the orchestrator already reports its tiers; pass one or the other"
            )
        self.orchestrator = orchestrator
        self.host = host
        self.disk = disk
        self.events = events if events is not None else getattr(orchestrator, "events", None)
        self.const_labels = _const_labels(labels)

    # ---- one snapshot per scrape ---------------------------------------------------------
    def snapshot(self) -> dict[str, dict[Labels, Any]]:
        """{series name: {label values: value or histogram}} for whatever the tiers report;
        missing combinations are filled with zeros by `collect`."""
        v: dict[str, dict[Labels, Any]] = {s.name: {} for s in SERIES}
        if self.orchestrator is not None:
            self._from_orchestrator(v, self.orchestrator.snapshot(histograms=True))
        else:
            if self.host is not None:
                self._from_index(v, "cpu", self.host.stats(), self.host.block_bytes)
            if self.disk is not None:
                d = dict(self.disk.stats())
                self._from_index(v, "disk", d, self.disk.block_bytes)
                self._from_disk(v, d)
        if self.events is not None:
            st = self.events.stats()
            for kind, n in st["published"].items():
                v["kvtier_events"][(kind,)] = n
            v["kvtier_events_dropped"][()] = st["dropped"]
        return v

    @staticmethod
    def _from_index(v: dict[str, dict[Labels, Any]], tier: str, idx: Mapping[str, Any], block_bytes: int) -> None:
        occ = occupancy(idx, block_bytes)
        for key in ("capacity_bytes", "usage_bytes", "pinned_bytes"):
            v[f"kvtier_{key}"][(tier,)] = occ[key]
        v["kvtier_evictions"][(tier,)] = idx["evictions"]
        v["kvtier_index_failed"][(tier,)] = idx["failed"]
        v["kvtier_refusals"][(tier, "store", "admission")] = idx["store_refused"]
        v["kvtier_stored_blocks"][(tier,)] = idx["stores_completed"]

    @staticmethod
    def _from_disk(v: dict[str, dict[Labels, Any]], d: Mapping[str, Any]) -> None:
        v["kvtier_disk_checksum_failures"][()] = d["checksum_failures"]
        v["kvtier_disk_io_errors"][("read",)] = d["read_errors"]
        v["kvtier_disk_io_errors"][("short_read",)] = d["short_reads"]
        v["kvtier_disk_io_errors"][("write",)] = d["write_failures"]
        v["kvtier_disk_full"][()] = d["disk_full"]
        v["kvtier_refusals"][("disk", "store", "no_space")] = d["refused_disk_full"]
        v["kvtier_transferred_bytes"][("disk", "store")] = d["bytes_written"]
        v["kvtier_transferred_bytes"][("disk", "load")] = d["bytes_read"]

    @staticmethod
    def _from_remote(v: dict[str, dict[Labels, Any]], t: RemoteTierSnapshot) -> None:
        """The remote tier: the data path's side and the store's own counters."""
        st = {k: int(x) for k, x in t.store.items() if not isinstance(x, str)}  # all counts
        v["kvtier_hits"][("remote",)] = t.hits
        v["kvtier_lookup_blocks"][("remote",)] = t.lookup_blocks
        v["kvtier_promotions"][("remote",)] = t.promotions
        v["kvtier_promotions_in_flight"][("remote",)] = t.promotions_in_flight
        for reason, n in t.refused.items():
            v["kvtier_refusals"][("remote", "load", reason)] = n
        v["kvtier_refusals"][("remote", "store", "admission")] = st["writes_refused_admission"]
        v["kvtier_refusals"][("remote", "store", "no_space")] = st["writes_refused_full"]
        v["kvtier_refusals"][("remote", "store", "backpressure")] = (
            st["writes_dropped_backlog"] + t.writes.dropped_backlog
        )
        v["kvtier_refusals"][("remote", "store", "unavailable")] = st["writes_refused_breaker"] + t.writes.not_started
        v["kvtier_latency_seconds"][("remote", "load")] = t.load_histogram
        v["kvtier_latency_seconds"][("remote", "store")] = t.store_histogram
        v["kvtier_transferred_bytes"][("remote", "load")] = st["bytes_read"]
        v["kvtier_transferred_bytes"][("remote", "store")] = st["bytes_written"]
        for reason in REMOTE_MISS_REASONS:
            v["kvtier_remote_misses"][(reason,)] = st[f"miss_{reason}"]
        v["kvtier_remote_breaker_state"][()] = st["breaker_state"]

    def _from_orchestrator(self, v: dict[str, dict[Labels, Any]], s: DataPathSnapshot) -> None:
        v["kvtier_lookups"][()] = s.lookups
        v["kvtier_misses"][()] = s.misses
        v["kvtier_load_failures"][()] = s.load_failed
        v["kvtier_load_released"][()] = s.load_released
        v["kvtier_load_unreserved"][()] = s.load_unreserved
        v["kvtier_transferred_bytes"][("cpu", "store")] = s.bytes.d2h
        v["kvtier_transferred_bytes"][("cpu", "load")] = s.bytes.h2d
        gpu = s.tiers.gpu
        v["kvtier_hits"][("gpu",)] = gpu.hits
        v["kvtier_lookup_blocks"][("gpu",)] = gpu.lookup_blocks
        tiers: tuple[tuple[str, CpuTierSnapshot | DiskTierSnapshot | None], ...] = (
            ("cpu", s.tiers.cpu),
            ("disk", s.tiers.disk),
        )
        for tier, t in tiers:
            if t is None:
                continue
            self._from_index(v, tier, t.index, t.block_bytes)
            if isinstance(t, DiskTierSnapshot):
                self._from_disk(v, t.index)
                v["kvtier_disk_write_backlog_blocks"][()] = t.write_backlog
            v["kvtier_hits"][(tier,)] = t.hits
            v["kvtier_lookup_blocks"][(tier,)] = t.lookup_blocks
            v["kvtier_promotions"][(tier,)] = t.promotions
            v["kvtier_promotions_in_flight"][(tier,)] = t.promotions_in_flight
            for reason, n in t.refused.items():
                v["kvtier_refusals"][(tier, "load", reason)] = n
            for reason, n in t.store_refused.as_dict().items():
                v["kvtier_refusals"][(tier, "store", reason)] = n
            v["kvtier_latency_seconds"][(tier, "load")] = t.load_histogram
            v["kvtier_latency_seconds"][(tier, "store")] = t.store_histogram
        if s.tiers.remote is not None:
            self._from_remote(v, s.tiers.remote)
        for tier, g in s.guards.items():
            v["kvtier_guard_enabled"][(tier,)] = 1
            v["kvtier_guard_state"][(tier,)] = int(g.state == "bypassed")
            v["kvtier_guard_trips"][(tier,)] = g.trips
            v["kvtier_guard_p99_seconds"][(tier,)] = g.p99_ms / 1e3
            if g.threshold_ms is not None:  # None: no SLO guard of its own, only the request rule
                v["kvtier_guard_threshold_seconds"][(tier,)] = g.threshold_ms / 1e3

    # ---- exposition ------------------------------------------------------------------------
    def describe(self) -> Iterator[Metric]:
        # Lets registries detect name clashes at registration without scraping the tiers.
        for s in SERIES:
            yield self._family(s)

    def collect(self) -> Iterator[Metric]:
        values = self.snapshot()
        for s in SERIES:
            fam = self._family(s)
            got = values[s.name]
            unknown = set(got) - set(s.labelsets)
            if unknown:
                # A bug in the mapping above, never user input: fail loudly, in tests too.
                raise AssertionError(f"{s.name}: undocumented label values {sorted(unknown)}")
            for labelset in s.labelsets:
                labels = [*self.const_labels.values(), *labelset]
                value = got.get(labelset)
                if isinstance(fam, HistogramMetricFamily):  # s.type == "histogram"
                    buckets, _count, total = value if value is not None else _EMPTY_HISTOGRAM
                    fam.add_metric(labels, [(_le(b), n) for b, n in buckets], total)
                else:
                    fam.add_metric(labels, float(value or 0))
            yield fam

    def _family(self, s: Series) -> CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily:
        labelnames = [*self.const_labels, *s.labelnames]
        if s.type == "counter":
            return CounterMetricFamily(s.name, s.help, labels=labelnames)
        if s.type == "gauge":
            return GaugeMetricFamily(s.name, s.help, labels=labelnames)
        return HistogramMetricFamily(s.name, s.help, labels=labelnames)
