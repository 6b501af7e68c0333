"""Prometheus metrics for kvtier: a collector over the tiers' own counters, an in-process HTTP
exporter, and the documented list of series (`names.SERIES`).

    from kvtier_rs.metrics import serve
    server = serve(9400, orchestrator, labels={"engine": "dp0"})   # http://127.0.0.1:9400/metrics

Needs prometheus-client (`pip install kvtier[metrics]`); `names` alone does not.
"""

from __future__ import annotations

try:
    import prometheus_client  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "kvtier_rs.metrics needs prometheus-client: pip install 'kvtier[metrics]' (or prometheus-client>=0.20)"
    ) from e

from kvtier_rs.metrics.collector import KvTierCollector
from kvtier_rs.metrics.exporter import MetricsServer, exposition, make_registry, serve
from kvtier_rs.metrics.names import SERIES, Series

__all__ = ["SERIES", "KvTierCollector", "MetricsServer", "Series", "exposition", "make_registry", "serve"]
