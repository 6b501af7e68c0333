"""The data path's stats: one mapping of every counter, latency, guard and tier occupancy.

`DataPathStats.stats()` is what `TierOrchestrator.stats()` returns, and what the metrics
exporter and the adapters read: keys are only ever added, never renamed. It reads each tier's
core stats once per call and may run on a metrics scrape's thread while the engine thread
works (the counts of promotions in flight take a snapshot, see `loads.InFlight`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtier_rs.orchestrator.cost import CostModel
from kvtier_rs.orchestrator.counters import DataPathCounters
from kvtier_rs.orchestrator.disk_stager import DiskStager
from kvtier_rs.orchestrator.gate import LoadGate
from kvtier_rs.orchestrator.latency import LatencyRecorder
from kvtier_rs.orchestrator.loads import InFlight
from kvtier_rs.tiers.events import EventStream
from kvtier_rs.tiers.host import HostTier


def occupancy(index_stats: Any, block_bytes: int) -> dict[str, int]:
    """Capacity and occupancy of a tier in payload bytes. `usage_bytes` counts every block that
    holds a slot (ready, being written, being evicted), pinned or not: what the tier occupies.
    `pinned_bytes` is the part of it that cannot be evicted right now."""
    return {
        "block_bytes": int(block_bytes),
        "capacity_bytes": int(index_stats["capacity_blocks"]) * int(block_bytes),
        "usage_bytes": int(index_stats["resident_blocks"]) * int(block_bytes),
        "pinned_bytes": int(index_stats["pinned_blocks"]) * int(block_bytes),
    }


class DataPathStats:
    """Builds the stats mapping from the parts that hold the numbers.

    `counts` and `latency` (by name: cpu_load, disk_load, cpu_store) are the data path's own;
    `host` and `stager` (None without a disk tier) are read for each tier's index stats and the
    disk's write and read counters; `in_flight` for the promotions in flight; `gate` for the
    guards' state; `cost` (None: no cost model) and `events` (None: no stream) as configured.
    """

    def __init__(
        self,
        *,
        counts: DataPathCounters,
        latency: Mapping[str, LatencyRecorder],
        host: HostTier,
        stager: DiskStager | None,
        in_flight: InFlight,
        gate: LoadGate,
        cost: CostModel | None,
        events: EventStream | None,
    ) -> None:
        self.counts = counts
        self.latency = latency
        self.host = host
        self.stager = stager
        self.in_flight = in_flight
        self.gate = gate
        self.cost = cost
        self.events = events

    def recorders(self) -> dict[str, LatencyRecorder]:
        """Every latency recorder of the data path by name, the disk stager's included."""
        out = dict(self.latency)
        if self.stager is not None:
            out["disk_read"] = self.stager.counters.read_latency
            out["disk_write"] = self.stager.counters.write_latency
        return out

    def stats(self, *, histograms: bool = False) -> dict[str, Any]:
        """Counters of the whole data path (`TierOrchestrator.stats`). With `histograms`, each
        latency also comes as cumulative Prometheus buckets (for the metrics collector)."""
        c = self.counts
        tiers: dict[str, Any] = {
            "gpu": {"hits": c.gpu.hit_blocks, "lookup_blocks": c.gpu.lookup_blocks},
            "cpu": self._cpu(histograms),
        }
        if self.stager is not None:
            tiers["disk"] = self._disk(self.stager, histograms)
        return {
            "lookups": c.lookups,
            "misses": c.miss_blocks,
            "load_failed": c.load_failed_blocks,
            "load_released": c.load_released_blocks,
            "load_unreserved": c.load_unreserved_blocks,
            # Planned disk blocks given up after disk_read_timeout_s (recomputed; in load_failed).
            "load_timed_out": c.disk_read_timeout_blocks,
            "bytes": {"d2h": c.d2h_bytes, "h2d": c.h2d_bytes},
            "tiers": tiers,
            "guards": self.gate.state(),
            "cost_model": self._cost_model(),
            # Latency samples refused as NaN, inf or negative (LatencyRecorder), per recorder.
            "latency_samples_dropped": {name: rec.dropped for name, rec in self.recorders().items()},
            "events": None if self.events is None else self.events.stats(),
        }

    def _cpu(self, histograms: bool) -> dict[str, Any]:
        c = self.counts
        index = self.host.stats()
        out: dict[str, Any] = {
            "hits": c.cpu.hit_blocks,
            "promotions": c.cpu.promoted_blocks,
            "stored": c.cpu_stored_blocks,
            "store_failed": c.cpu_store_failed_blocks,
            "store_no_space": c.cpu_store_no_space_blocks,
            "store_index_failed": c.cpu_store_index_failed_blocks,
            "refused": dict(c.cpu.refused),
            "load_latency": self.latency["cpu_load"].percentiles(),
            "store_latency": self.latency["cpu_store"].percentiles(),
            "index": index,
            "lookup_blocks": c.cpu.lookup_blocks,
            "evictions": index["evictions"],
            "store_refused": {
                "admission": index["store_refused"],
                "no_space": c.cpu_store_no_space_blocks,
            },
            "promotions_in_flight": self.in_flight.promotions("cpu"),
            **occupancy(index, self.host.block_bytes),
        }
        if histograms:
            out["load_histogram"] = self.latency["cpu_load"].histogram()
            out["store_histogram"] = self.latency["cpu_store"].histogram()
        return out

    def _disk(self, stager: DiskStager, histograms: bool) -> dict[str, Any]:
        c = self.counts
        sc = stager.counters
        index = dict(stager.disk.stats())
        out: dict[str, Any] = {
            "hits": c.disk.hit_blocks,
            "promotions": c.disk.promoted_blocks,
            "refused": dict(c.disk.refused),
            "load_latency": self.latency["disk_load"].percentiles(),
            "read_latency": sc.read_latency.percentiles(),
            "write_latency": sc.write_latency.percentiles(),
            "writes": {
                "submitted": sc.writes_submitted,
                "completed": sc.writes_completed,
                "failed": sc.writes_failed,
                "refused": sc.writes_refused,
                "no_space": sc.writes_no_space,
                "dropped_backlog": sc.writes_dropped_backlog,
                "dropped_evicted": sc.writes_dropped_evicted,
                "dropped_index_failed": sc.writes_dropped_index_failed,
                "not_started": sc.writes_not_started,
            },
            "promotion_blocks_failed": sc.promotion_blocks_failed,
            "index": index,
            "lookup_blocks": c.disk.lookup_blocks,
            "evictions": index["evictions"],
            # The stager's `writes.refused` lumps admission, a full device and no slot free or
            # evictable; split here.
            "store_refused": {
                "admission": index["store_refused"],
                "no_space": int(index["refused_disk_full"]) + sc.writes_no_space,
                "backpressure": sc.writes_dropped_backlog,
                "unavailable": sc.writes_not_started,
            },
            "promotions_in_flight": self.in_flight.promotions("disk"),
            "write_backlog": stager.write_backlog,
            **occupancy(index, stager.disk.block_bytes),
        }
        if histograms:
            out["load_histogram"] = self.latency["disk_load"].histogram()
            out["store_histogram"] = sc.write_latency.histogram()
            out["read_histogram"] = sc.read_latency.histogram()
        return out

    def _cost_model(self) -> dict[str, Any] | None:
        if self.cost is None:
            return None
        return {
            "bandwidth": dict(self.cost.bandwidth),
            "observations_dropped": self.cost.observations_dropped,
            "observations_skipped": self.cost.observations_skipped,
            "probes": self.cost.probes,
        }
