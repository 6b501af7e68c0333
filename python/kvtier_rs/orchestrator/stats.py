"""The data path's stats: every counter, latency, guard and tier occupancy, as typed snapshots.

`DataPathStats.snapshot()` is what `TierOrchestrator.snapshot()` returns: frozen dataclasses, so
that readers (the metrics collector, the examples) use attributes a type checker knows instead of
string keys that fail only at run time. `DataPathSnapshot.as_dict()` is the mapping
`TierOrchestrator.stats()` has always returned, which dashboards and scripts read: its keys are
the fields' names, in the fields' order, and are only ever added, never renamed.

A snapshot reads each tier's core stats once and may be taken on a metrics scrape's thread while
the engine thread works (the counts of promotions in flight take a copy, see `loads.InFlight`).
The core's own index stats (`index`) stay the mapping the core returns: its keys belong to the
Rust side, which adds to them without this module having to follow.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from kvtier_rs.orchestrator.cost import CostModel
from kvtier_rs.orchestrator.counters import DataPathCounters
from kvtier_rs.orchestrator.disk_stager import DiskStager
from kvtier_rs.orchestrator.gate import LoadGate
from kvtier_rs.orchestrator.latency import LatencyRecorder
from kvtier_rs.orchestrator.loads import InFlight
from kvtier_rs.tiers.events import EventStats, EventStream
from kvtier_rs.tiers.host import HostTier

#: Cumulative (upper bound, count) pairs ending with +Inf, total count and sum
#: (`LatencyRecorder.histogram`).
Histogram = tuple[list[tuple[float, int]], int, float]

# A field with this metadata is left out of `as_dict()` while it is None: the mapping has no key
# for what is not there (a histogram not asked for, a disk tier not configured), whereas a
# field without it maps None to None (`cost_model`, `events`).
_OPTIONAL_KEY = {"optional_key": True}


def _optional() -> Any:
    return field(default=None, metadata=_OPTIONAL_KEY)


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


def _plain(value: Any) -> Any:
    if isinstance(value, Snapshot):
        return value.as_dict()
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class Snapshot:
    """The base of the stats' frozen dataclasses; `as_dict()` gives a snapshot's part of
    `stats()`."""

    def as_dict(self) -> dict[str, Any]:
        """The mapping of the fields, in their order, nested snapshots and mappings copied."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.metadata.get("optional_key"):
                continue
            out[f.name] = _plain(value)
        return out


@dataclass(frozen=True)
class Percentiles(Snapshot):
    """Over a recorder's recent window, in seconds (0.0 when nothing was observed)."""

    p50: float
    p95: float
    p99: float

    @classmethod
    def of(cls, recorder: LatencyRecorder) -> Percentiles:
        p = recorder.percentiles()
        return cls(p50=p["p50"], p95=p["p95"], p99=p["p99"])


@dataclass(frozen=True)
class StoreRefusals(Snapshot):
    """Blocks the CPU tier did not store, by reason."""

    admission: int  # the tier's admission rule turned them away
    no_space: int  # every slot pinned or being written


@dataclass(frozen=True)
class DiskStoreRefusals(StoreRefusals):
    """Blocks the disk tier did not store, by reason. The stager's `writes.refused` lumps
    admission, a full device and no slot free or evictable; this splits it."""

    backpressure: int  # dropped: the write backlog was full
    unavailable: int  # never started: the disk refused the submission


@dataclass(frozen=True)
class DiskWrites(Snapshot):
    """The disk stager's write-throughs, in blocks."""

    submitted: int
    completed: int
    failed: int
    refused: int
    no_space: int
    dropped_backlog: int
    dropped_evicted: int
    dropped_index_failed: int
    not_started: int


@dataclass(frozen=True)
class GpuTierSnapshot(Snapshot):
    hits: int
    lookup_blocks: int


@dataclass(frozen=True)
class CpuTierSnapshot(Snapshot):
    hits: int
    promotions: int
    stored: int
    store_failed: int
    store_no_space: int
    store_index_failed: int
    refused: Mapping[str, int]  # hits recomputed instead of loaded, by the load gate's reason
    load_latency: Percentiles
    store_latency: Percentiles
    index: Mapping[str, int]  # the core index's own stats
    lookup_blocks: int
    evictions: int
    store_refused: StoreRefusals
    promotions_in_flight: int
    block_bytes: int
    capacity_bytes: int
    usage_bytes: int
    pinned_bytes: int
    load_histogram: Histogram | None = _optional()
    store_histogram: Histogram | None = _optional()


@dataclass(frozen=True)
class DiskTierSnapshot(Snapshot):
    hits: int
    promotions: int
    refused: Mapping[str, int]  # hits recomputed instead of loaded, by the load gate's reason
    load_latency: Percentiles
    read_latency: Percentiles
    write_latency: Percentiles
    writes: DiskWrites
    promotion_blocks_failed: int
    index: Mapping[str, int | float | str]  # the disk tier's own stats
    lookup_blocks: int
    evictions: int
    store_refused: DiskStoreRefusals
    promotions_in_flight: int
    write_backlog: int
    block_bytes: int
    capacity_bytes: int
    usage_bytes: int
    pinned_bytes: int
    load_histogram: Histogram | None = _optional()
    store_histogram: Histogram | None = _optional()  # of the disk writes
    read_histogram: Histogram | None = _optional()


@dataclass(frozen=True)
class RemoteTierSnapshot(Snapshot):
    """The shared remote tier: the data path's side (hits, promotions, refusals, the stager's
    write-throughs and reads) and the tier's own counters (`store`: ``RemoteTier.stats()``,
    misses by reason, breaker state, bytes). It owns no capacity: the server evicts."""

    hits: int
    promotions: int
    refused: Mapping[str, int]  # hits recomputed instead of loaded, by the load gate's reason
    load_latency: Percentiles
    read_latency: Percentiles
    write_latency: Percentiles
    writes: DiskWrites
    promotion_blocks_failed: int
    store: Mapping[str, int | float | str]
    lookup_blocks: int
    promotions_in_flight: int
    write_backlog: int
    block_bytes: int
    load_histogram: Histogram | None = _optional()
    store_histogram: Histogram | None = _optional()  # of the write-throughs
    read_histogram: Histogram | None = _optional()


@dataclass(frozen=True)
class TiersSnapshot(Snapshot):
    gpu: GpuTierSnapshot
    cpu: CpuTierSnapshot
    disk: DiskTierSnapshot | None = _optional()  # None: no disk tier
    remote: RemoteTierSnapshot | None = _optional()  # None: no remote tier


@dataclass(frozen=True)
class BytesMoved(Snapshot):
    d2h: int  # device -> CPU tier
    h2d: int  # CPU tier -> device


@dataclass(frozen=True)
class GuardTrip(Snapshot):
    at: float  # monotonic clock
    at_unix: float
    p99_ms: float  # the p99 promotion wait that tripped the guard


@dataclass(frozen=True)
class GuardSnapshot(Snapshot):
    """A guarded tier's state (`LoadGate.state`). A tier that only the request-level rule covers
    has no SLO guard of its own: its guard-only fields are None and absent from the mapping."""

    tier: str
    state: Literal["active", "bypassed"]
    trips: int
    p99_ms: float
    threshold_ms: float | None = _optional()
    bypassed_for_s: float | None = _optional()
    recent_trips: tuple[GuardTrip, ...] | None = _optional()
    dropped_samples: int | None = _optional()
    samples: int | None = _optional()
    request_rule: Mapping[str, object] | None = _optional()  # the request-level rule's state

    @classmethod
    def of(cls, state: Mapping[str, Any]) -> GuardSnapshot:
        trips = state.get("recent_trips")
        rule = state.get("request_rule")
        return cls(
            tier=state["tier"],
            state=state["state"],
            trips=state["trips"],
            p99_ms=state["p99_ms"],
            threshold_ms=state.get("threshold_ms"),
            bypassed_for_s=state.get("bypassed_for_s"),
            recent_trips=None if trips is None else tuple(GuardTrip(**t) for t in trips),
            dropped_samples=state.get("dropped_samples"),
            samples=state.get("samples"),
            request_rule=None if rule is None else dict(rule),
        )

    def as_dict(self) -> dict[str, Any]:
        out = super().as_dict()
        if self.recent_trips is not None:
            out["recent_trips"] = [t.as_dict() for t in self.recent_trips]  # a list, as it always was
        return out


@dataclass(frozen=True)
class CostModelState(Snapshot):
    bandwidth: Mapping[str, float]  # bytes/s per hop, as estimated now
    observations_dropped: int
    observations_skipped: int
    probes: int


@dataclass(frozen=True)
class LatencyDropped(Snapshot):
    """Latency samples refused as NaN, inf or negative (`LatencyRecorder`), per recorder; the
    disk stager's are None without a disk tier."""

    cpu_load: int
    disk_load: int
    cpu_store: int
    disk_read: int | None = _optional()
    disk_write: int | None = _optional()
    remote_load: int | None = _optional()
    remote_read: int | None = _optional()
    remote_write: int | None = _optional()


@dataclass(frozen=True)
class EventsSnapshot(Snapshot):
    published: Mapping[str, int]  # events published, by kind
    dropped: int  # oldest events dropped from a full ring
    queued: int
    capacity: int
    last_seq: int

    @classmethod
    def of(cls, st: EventStats) -> EventsSnapshot:
        return cls(
            published=dict(st["published"]),
            dropped=st["dropped"],
            queued=st["queued"],
            capacity=st["capacity"],
            last_seq=st["last_seq"],
        )


@dataclass(frozen=True)
class DataPathSnapshot(Snapshot):
    """The whole data path at one moment (`TierOrchestrator.snapshot`). Blocks unless the name
    says bytes."""

    lookups: int
    misses: int
    load_failed: int
    load_released: int
    load_unreserved: int
    # Planned disk (and remote) blocks given up after disk_read_timeout_s (recomputed; in
    # load_failed).
    load_timed_out: int
    bytes: BytesMoved
    tiers: TiersSnapshot
    guards: Mapping[str, GuardSnapshot]  # by tier; only guarded tiers
    cost_model: CostModelState | None  # None: no cost model
    latency_samples_dropped: LatencyDropped
    events: EventsSnapshot | None  # None: no event stream


class DataPathStats:
    """Builds the stats snapshot from the parts that hold the numbers.

    `counts` and `latency` (by name: cpu_load, disk_load, cpu_store, remote_load) are the data
    path's own; `host` and `stagers` (by tier: the disk's and the remote's, those configured)
    are read for each tier's index stats and the staged tiers' write and read counters;
    `in_flight` for the promotions in flight; `gate` for the guards' state; `cost` (None: no
    cost model) and `events` (None: no stream) as configured.
    """

    def __init__(
        self,
        *,
        counts: DataPathCounters,
        latency: Mapping[str, LatencyRecorder],
        host: HostTier,
        stagers: Mapping[str, DiskStager],
        in_flight: InFlight,
        gate: LoadGate,
        cost: CostModel | None,
        events: EventStream | None,
    ) -> None:
        self.counts = counts
        self.latency = latency
        self.host = host
        self.stagers = dict(stagers)
        self.stager = self.stagers.get("disk")
        self.in_flight = in_flight
        self.gate = gate
        self.cost = cost
        self.events = events

    def recorders(self) -> dict[str, LatencyRecorder]:
        """Every latency recorder of the data path by name, the staged tiers' included (the
        remote tier's load recorder only with a remote tier)."""
        out = dict(self.latency)
        if "remote" not in self.stagers:
            out.pop("remote_load", None)
        for tier, stager in self.stagers.items():
            out[f"{tier}_read"] = stager.counters.read_latency
            out[f"{tier}_write"] = stager.counters.write_latency
        return out

    def snapshot(self, *, histograms: bool = False) -> DataPathSnapshot:
        """Counters of the whole data path (`TierOrchestrator.snapshot`). With `histograms`, each
        latency also comes as cumulative Prometheus buckets (for the metrics collector)."""
        c = self.counts
        dropped = {name: rec.dropped for name, rec in self.recorders().items()}
        return DataPathSnapshot(
            lookups=c.lookups,
            misses=c.miss_blocks,
            load_failed=c.load_failed_blocks,
            load_released=c.load_released_blocks,
            load_unreserved=c.load_unreserved_blocks,
            load_timed_out=c.disk_read_timeout_blocks,
            bytes=BytesMoved(d2h=c.d2h_bytes, h2d=c.h2d_bytes),
            tiers=TiersSnapshot(
                gpu=GpuTierSnapshot(hits=c.gpu.hit_blocks, lookup_blocks=c.gpu.lookup_blocks),
                cpu=self._cpu(histograms),
                disk=None if self.stager is None else self._disk(self.stager, histograms),
                remote=self._remote(self.stagers["remote"], histograms) if "remote" in self.stagers else None,
            ),
            guards={tier: GuardSnapshot.of(st) for tier, st in self.gate.state().items()},
            cost_model=self._cost_model(),
            latency_samples_dropped=LatencyDropped(
                cpu_load=dropped["cpu_load"],
                disk_load=dropped["disk_load"],
                cpu_store=dropped["cpu_store"],
                disk_read=dropped.get("disk_read"),
                disk_write=dropped.get("disk_write"),
                remote_load=dropped.get("remote_load"),
                remote_read=dropped.get("remote_read"),
                remote_write=dropped.get("remote_write"),
            ),
            events=None if self.events is None else EventsSnapshot.of(self.events.stats()),
        )

    def _cpu(self, histograms: bool) -> CpuTierSnapshot:
        c = self.counts
        index = self.host.stats()
        occ = occupancy(index, self.host.block_bytes)
        return CpuTierSnapshot(
            hits=c.cpu.hit_blocks,
            promotions=c.cpu.promoted_blocks,
            stored=c.cpu_stored_blocks,
            store_failed=c.cpu_store_failed_blocks,
            store_no_space=c.cpu_store_no_space_blocks,
            store_index_failed=c.cpu_store_index_failed_blocks,
            refused=dict(c.cpu.refused),
            load_latency=Percentiles.of(self.latency["cpu_load"]),
            store_latency=Percentiles.of(self.latency["cpu_store"]),
            index=index,
            lookup_blocks=c.cpu.lookup_blocks,
            evictions=index["evictions"],
            store_refused=StoreRefusals(admission=index["store_refused"], no_space=c.cpu_store_no_space_blocks),
            promotions_in_flight=self.in_flight.promotions("cpu"),
            block_bytes=occ["block_bytes"],
            capacity_bytes=occ["capacity_bytes"],
            usage_bytes=occ["usage_bytes"],
            pinned_bytes=occ["pinned_bytes"],
            load_histogram=self.latency["cpu_load"].histogram() if histograms else None,
            store_histogram=self.latency["cpu_store"].histogram() if histograms else None,
        )

    def _staged(self, tier: str, stager: DiskStager, histograms: bool) -> dict[str, Any]:
        """The fields a staged tier's snapshot (disk or remote) has in common: the data path's
        side of it and its stager's write-throughs and reads."""
        t = self.counts.tier(tier)
        sc = stager.counters
        return {
            "hits": t.hit_blocks,
            "promotions": t.promoted_blocks,
            "refused": dict(t.refused),
            "load_latency": Percentiles.of(self.latency[f"{tier}_load"]),
            "read_latency": Percentiles.of(sc.read_latency),
            "write_latency": Percentiles.of(sc.write_latency),
            "writes": DiskWrites(
                submitted=sc.writes_submitted,
                completed=sc.writes_completed,
                failed=sc.writes_failed,
                refused=sc.writes_refused,
                no_space=sc.writes_no_space,
                dropped_backlog=sc.writes_dropped_backlog,
                dropped_evicted=sc.writes_dropped_evicted,
                dropped_index_failed=sc.writes_dropped_index_failed,
                not_started=sc.writes_not_started,
            ),
            "promotion_blocks_failed": sc.promotion_blocks_failed,
            "lookup_blocks": t.lookup_blocks,
            "promotions_in_flight": self.in_flight.promotions(tier),
            "write_backlog": stager.write_backlog,
            "load_histogram": self.latency[f"{tier}_load"].histogram() if histograms else None,
            "store_histogram": sc.write_latency.histogram() if histograms else None,
            "read_histogram": sc.read_latency.histogram() if histograms else None,
        }

    def _disk(self, stager: DiskStager, histograms: bool) -> DiskTierSnapshot:
        sc = stager.counters
        index = dict(stager.disk.stats())
        occ = occupancy(index, stager.disk.block_bytes)
        return DiskTierSnapshot(
            **self._staged("disk", stager, histograms),
            index=index,
            evictions=int(index["evictions"]),
            store_refused=DiskStoreRefusals(
                admission=int(index["store_refused"]),
                no_space=int(index["refused_disk_full"]) + sc.writes_no_space,
                backpressure=sc.writes_dropped_backlog,
                unavailable=sc.writes_not_started,
            ),
            block_bytes=occ["block_bytes"],
            capacity_bytes=occ["capacity_bytes"],
            usage_bytes=occ["usage_bytes"],
            pinned_bytes=occ["pinned_bytes"],
        )

    def _remote(self, stager: DiskStager, histograms: bool) -> RemoteTierSnapshot:
        return RemoteTierSnapshot(
            **self._staged("remote", stager, histograms),
            store=dict(stager.disk.stats()),
            block_bytes=stager.disk.block_bytes,
        )

    def _cost_model(self) -> CostModelState | None:
        if self.cost is None:
            return None
        return CostModelState(
            bandwidth=dict(self.cost.bandwidth),
            observations_dropped=self.cost.observations_dropped,
            observations_skipped=self.cost.observations_skipped,
            probes=self.cost.probes,
        )
