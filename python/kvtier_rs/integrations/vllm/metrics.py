"""kvtier's Prometheus metrics, declared through vLLM's offloading metric definitions.

vLLM registers only the names a spec declares in ``build_metric_definitions`` and asserts on any
undeclared name or wrong label count, so the names, label sets and the emitting code live side by
side here. Counters are emitted as deltas since the previous ``get_stats`` call (vLLM adds them up).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from kvtier_rs.integrations.vllm.options import DISK_TIER_TYPE, REMOTE_TIER_TYPE
from kvtier_rs.orchestrator.disk_stager import StagerCounters

log = logging.getLogger("vllm." + __name__)

PREFIX = "vllm:kv_offload_kvtier_"

# Per-tier index counters (label "tier": "cpu" or "disk"), taken from BlockIndex.stats().
INDEX_COUNTERS = {
    "stores_completed": "Chunks written into the tier.",
    "stores_failed": "Chunk writes that failed and were dropped.",
    "store_refused": "Chunks turned away by the tier's admission rule.",
    "store_no_space": "Store batches refused because every slot was pinned or being written.",
    "evictions": "Chunks evicted from the tier to make room.",
}
INDEX_GAUGES = {
    "resident_blocks": "Chunks resident in the tier (ready, pinned or being written).",
    "capacity_blocks": "Chunk capacity of the tier.",
    "pinned_blocks": "Chunks pinned by in-flight reads.",
    "writing_blocks": "Chunks being written.",
    "failed": "1 once the tier's index disabled itself after an internal error (it then misses and refuses stores).",
    "switched_off": "1 once the tier is switched off for the rest of this process (the disk tier, when a cache "
    "reset could not clear it durably); it then serves and stores nothing.",
}
# Manager-level counters (no labels).
MANAGER_COUNTERS = {
    "loads_cpu": "Chunks loaded into GPU memory that the CPU tier held already.",
    "loads_disk": "Chunks loaded into GPU memory after a promotion from the disk tier.",
    "promotions": "Disk->CPU promotions started by a disk hit.",
    "promotion_failures": "Promotions that failed (checksum mismatch, short or failed read): "
    "counted as misses and recomputed.",
    "disk_skipped_by_cost": "Disk hits not loaded because recomputing was estimated cheaper (each chunk of a "
    "request once, however often vLLM asks).",
    "disk_refused_guard": "Disk hits recomputed because the SLO guard bypasses the disk tier (each chunk of a "
    "request once).",
    "disk_refused_backpressure": "Disk hits recomputed because disk_max_promotions_in_flight promotions were "
    "in flight (each chunk of a request once).",
    "cpu_refused_guard": "CPU hits answered as misses (recomputed) because the request SLO rule (slo_guard) "
    "bypasses the CPU tier (each lookup).",
    "loads_remote": "Chunks loaded into GPU memory after a promotion from the shared remote tier.",
    "remote_lookups_deferred": "Lookups answered RETRY while the remote tier's existence probe was in flight.",
    "remote_skipped_by_cost": "Remote hits not loaded because recomputing was estimated cheaper (each chunk "
    "of a request once).",
    "remote_refused_guard": "Remote hits recomputed because a guard bypasses the remote tier (each chunk of a "
    "request once).",
    "remote_refused_backpressure": "Remote hits recomputed because too many promotions were in flight (each "
    "chunk of a request once).",
}
#: The shared remote tier's own series (label tier="remote"; misses also by reason).
REMOTE_COUNTERS = {
    "remote_hits": ("hits", "Blocks read from the store and verified."),
    "remote_bytes_read": ("bytes_read", "Payload bytes read from the store and verified."),
    "remote_bytes_written": ("bytes_written", "Payload bytes written to the store."),
    "remote_writes": ("writes_ok", "Blocks written to the store."),
    "remote_writes_skipped_present": (
        "writes_skipped_present",
        "Blocks not written because the store held them already (another replica stored them).",
    ),
    "remote_writes_refused_admission": ("writes_refused_admission", "Blocks the remote admission rule turned away."),
    "remote_writes_refused_full": ("writes_refused_full", "Blocks the server refused for lack of memory."),
    "remote_writes_dropped": (
        "writes_dropped_backlog",
        "Blocks not written because remote_max_write_bytes were in flight.",
    ),
    "remote_writes_failed": ("writes_failed", "Blocks whose write failed (errors, timeouts)."),
    "remote_probes": ("probes", "Batched existence probes sent to the store."),
    "remote_deadline_exceeded": ("deadline_exceeded", "Store operations abandoned at remote_deadline_s."),
    "remote_breaker_trips": ("breaker_trips", "Times the circuit breaker opened."),
    "remote_probe_errors": ("probe_errors", "Existence probes that failed (timeout, node down, refused login)."),
    "remote_read_errors": ("read_errors", "Read jobs that failed (timeout, node down, refused login)."),
    "remote_write_errors": ("write_errors", "Write jobs that failed (timeout, node down, refused login)."),
}
#: Write-throughs to a lower tier dropped before they reached it, by reason (labels "tier",
#: "reason"): the stager's counter of each reason.
WRITE_DROPS = "write_through_dropped"
WRITE_DROP_REASONS = {
    "backlog": "writes_dropped_backlog",
    "evicted": "writes_dropped_evicted",
    "unsealed": "writes_dropped_unsealed",
    "index_failed": "writes_dropped_index_failed",
    "not_started": "writes_not_started",
}
WRITE_DROPS_DOC = (
    "Chunks offered to the tier for a write-through and never written, by reason: backlog (the tier's "
    "write backlog was full), evicted (the chunk left the CPU tier first), unsealed (not every worker had "
    "sealed its host row for the chunk), index_failed (the tier's index disabled itself), not_started (the "
    "tier was closed or refused the submission)."
)
REMOTE_MISS = "remote_misses"
REMOTE_MISS_DOC = (
    "Remote reads not served, by reason: absent, foreign, format, namespace, key, length, check (a value "
    "that did not verify), error (timeout, node down)."
)
REMOTE_GAUGES = {
    "remote_breaker_state": ("breaker_state", "The remote tier's circuit breaker: 0 closed, 1 open, 2 probing."),
    "remote_switched_off": ("switched_off", "1 once the remote tier is off for the rest of this process."),
}
REMOTE_HISTOGRAMS = {
    "read": "Seconds per remote read job (a batched GET and verification).",
    "write": "Seconds per remote write job (sealing and a batched SET NX).",
    "probe": "Seconds per batched existence probe.",
}
#: Every series of the remote tier's own (by name, less PREFIX).
REMOTE_SERIES = frozenset(
    {*REMOTE_COUNTERS, REMOTE_MISS, *REMOTE_GAUGES, *(f"remote_{op}_seconds" for op in REMOTE_HISTOGRAMS)}
)
REMOTE_BUCKETS = (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5)
# The SLO guard of a tier (label "tier"), from LoadGate.state(); only tiers with a guard report.
GUARD_GAUGES = {
    "guard_state": "The SLO guard's state of the tier: 0 serving, 1 bypassed (its hits are recomputed until "
    "a re-probe).",
    "guard_p99_seconds": "p99 wait on the tier's promotions over the guard's window; while bypassed, the p99 "
    "that tripped it.",
}
GUARD_COUNTERS = {"guard_trips": "Times the SLO guard tripped and bypassed the tier."}
#: A load-gate refusal reason -> the counter of ManagerCounters that counts it.
_REFUSAL_COUNTERS = {
    "cost": "{tier}_skipped_by_cost",
    "guard": "{tier}_refused_guard",
    "backpressure": "{tier}_refused_backpressure",
}
ALLOCATION_SIZE = PREFIX + "allocation_size"


@dataclass
class ManagerCounters:
    loads_cpu: int = 0
    loads_disk: int = 0
    promotions: int = 0
    promotion_failures: int = 0
    disk_skipped_by_cost: int = 0
    disk_refused_guard: int = 0
    disk_refused_backpressure: int = 0
    cpu_refused_guard: int = 0
    loads_remote: int = 0
    remote_lookups_deferred: int = 0
    remote_skipped_by_cost: int = 0
    remote_refused_guard: int = 0
    remote_refused_backpressure: int = 0
    store_no_space: int = 0

    def __post_init__(self) -> None:
        self._emitted: dict[str, int] = {}

    def count_refusal(self, reason: str, tier: str = "disk") -> None:
        """One hit of `tier` (disk or remote) recomputed for `reason` (a ``LoadGate`` refusal
        reason)."""
        name = _REFUSAL_COUNTERS[reason].format(tier=tier)
        setattr(self, name, getattr(self, name) + 1)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def take_deltas(self) -> dict[str, int]:
        """Increase of each exported counter since the previous call (non-zero ones only)."""
        out = {}
        for name in MANAGER_COUNTERS:
            v = getattr(self, name)
            if v != self._emitted.get(name, 0):
                out[name] = v - self._emitted.get(name, 0)
                self._emitted[name] = v
        return out


def metric_definitions() -> dict[str, Any]:
    from vllm.v1.kv_offload.base import (
        OffloadingCounterMetadata,
        OffloadingGaugeMetadata,
        OffloadingHistogramMetadata,
    )

    d: dict[str, Any] = {}
    for name, doc in INDEX_COUNTERS.items():
        d[PREFIX + name] = OffloadingCounterMetadata(documentation=doc, labelnames=("tier",))
    for name, doc in INDEX_GAUGES.items():
        d[PREFIX + name] = OffloadingGaugeMetadata(documentation=doc, labelnames=("tier",))
    for name, doc in MANAGER_COUNTERS.items():
        d[PREFIX + name] = OffloadingCounterMetadata(documentation=doc)
    for name, doc in GUARD_GAUGES.items():
        d[PREFIX + name] = OffloadingGaugeMetadata(documentation=doc, labelnames=("tier",))
    for name, doc in GUARD_COUNTERS.items():
        d[PREFIX + name] = OffloadingCounterMetadata(documentation=doc, labelnames=("tier",))
    for name, (_, doc) in REMOTE_COUNTERS.items():
        d[PREFIX + name] = OffloadingCounterMetadata(documentation=doc, labelnames=("tier",))
    d[PREFIX + WRITE_DROPS] = OffloadingCounterMetadata(documentation=WRITE_DROPS_DOC, labelnames=("tier", "reason"))
    d[PREFIX + REMOTE_MISS] = OffloadingCounterMetadata(documentation=REMOTE_MISS_DOC, labelnames=("tier", "reason"))
    for name, (_, doc) in REMOTE_GAUGES.items():
        d[PREFIX + name] = OffloadingGaugeMetadata(documentation=doc, labelnames=("tier",))
    for op, doc in REMOTE_HISTOGRAMS.items():
        d[PREFIX + f"remote_{op}_seconds"] = OffloadingHistogramMetadata(documentation=doc, buckets=REMOTE_BUCKETS)
    d[ALLOCATION_SIZE] = OffloadingHistogramMetadata(
        documentation="Chunks newly allocated in the CPU tier by each prepare_store call.",
        buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384),
    )
    return d


def exported_tiers(extra_config: Mapping[str, Any]) -> tuple[str, ...]:
    """kvtier's tiers whose per-tier series a kv_connector_extra_config reports (label "tier"):
    the CPU tier, the disk tier with a disk_root and the remote tier with a remote_url, under
    KvtierOffloadingSpec; the disk tier and the remote tier under a tiering spec with a
    KvtierDiskTier or KvtierRemoteTier entry (the CPU tier is vLLM's there)."""
    spec = extra_config.get("spec_name")
    if spec == "KvtierOffloadingSpec":
        disk = ("disk",) if extra_config.get("disk_root") is not None else ()
        remote = ("remote",) if extra_config.get("remote_url") is not None else ()
        return ("cpu", *disk, *remote)
    tiers = extra_config.get("secondary_tiers")
    if not isinstance(tiers, list):
        return ()
    types = {t.get("type") for t in tiers if isinstance(t, Mapping)}
    return tuple(name for name, t in (("disk", DISK_TIER_TYPE), ("remote", REMOTE_TIER_TYPE)) if t in types)


def emit_zeros(stats: Any, tiers: tuple[str, ...]) -> None:
    """Every counter at zero: vLLM creates a series the first time a value reaches it, so a
    first report with all of them makes dashboards and alerts see kvtier's series before the
    first hit, store or failure."""
    for name in INDEX_COUNTERS:
        for tier in tiers:
            stats.increase_counter(PREFIX + name, 0, labelvalues=(tier,))
    for name in MANAGER_COUNTERS:
        stats.increase_counter(PREFIX + name, 0)
    for labelvalues in write_drop_labels(tiers):
        stats.increase_counter(PREFIX + WRITE_DROPS, 0, labelvalues=labelvalues)


def emit_index_stats(stats: Any, tier: str, now: dict[str, int], before: dict[str, int]) -> None:
    """The tier's counters as deltas since `before` and its gauges as they are; a tier whose
    index disabled itself since `before` is also logged (once, at the change)."""
    if now.get("failed") and not before.get("failed"):
        log.error(
            "kvtier: the %s tier's index disabled itself after an internal error; it misses and refuses "
            "stores for the rest of this process (kv_offload_kvtier_failed{tier=%r} is 1)",
            tier,
            tier,
        )
    for name in INDEX_COUNTERS:
        delta = now.get(name, 0) - before.get(name, 0)
        if delta:
            stats.increase_counter(PREFIX + name, delta, labelvalues=(tier,))
    for name in INDEX_GAUGES:
        stats.set_gauge(PREFIX + name, now.get(name, 0), labelvalues=(tier,))


def write_drop_labels(tiers: tuple[str, ...]) -> list[tuple[str, str]]:
    """The (tier, reason) label values of WRITE_DROPS among `tiers`: the lower tiers' (the CPU
    tier is written by the workers, with no write-through), every reason."""
    return [(tier, reason) for tier in tiers if tier != "cpu" for reason in WRITE_DROP_REASONS]


def emit_write_drops(stats: Any, tier: str, counters: StagerCounters, before: dict[str, int]) -> None:
    """A lower tier's dropped write-throughs (its stager's counters) as deltas since `before`
    (updated), by reason."""
    for reason, field_name in WRITE_DROP_REASONS.items():
        now = int(getattr(counters, field_name))
        delta = now - before.get(field_name, 0)
        if delta:
            stats.increase_counter(PREFIX + WRITE_DROPS, delta, labelvalues=(tier, reason))
        before[field_name] = now


def emit_remote_stats(
    stats: Any, now: dict[str, int], before: dict[str, int], latencies: Mapping[str, list[float]]
) -> None:
    """The remote tier's counters as deltas since `before`, its gauges, and its latencies."""
    for name, (key, _) in REMOTE_COUNTERS.items():
        delta = now.get(key, 0) - before.get(key, 0)
        if delta or not before:
            stats.increase_counter(PREFIX + name, delta, labelvalues=("remote",))
    for key in now:
        if key.startswith("miss_"):
            delta = now[key] - before.get(key, 0)
            if delta or not before:
                stats.increase_counter(PREFIX + REMOTE_MISS, delta, labelvalues=("remote", key[5:]))
    for name, (key, _) in REMOTE_GAUGES.items():
        stats.set_gauge(PREFIX + name, now.get(key, 0), labelvalues=("remote",))
    for op, samples in latencies.items():
        for seconds in samples:
            stats.observe_histogram(PREFIX + f"remote_{op}_seconds", seconds)


def emit_manager_counters(stats: Any, counters: ManagerCounters) -> None:
    for name, delta in counters.take_deltas().items():
        stats.increase_counter(PREFIX + name, delta)


def emit_guards(stats: Any, guards: Mapping[str, Mapping[str, Any]], trips_before: dict[str, int]) -> None:
    """Each guarded tier's state (``LoadGate.state()``): gauges as they are, trips as the increase
    since `trips_before` (updated)."""
    for tier, st in guards.items():
        stats.set_gauge(PREFIX + "guard_state", int(st["state"] == "bypassed"), labelvalues=(tier,))
        stats.set_gauge(PREFIX + "guard_p99_seconds", float(st["p99_ms"]) / 1e3, labelvalues=(tier,))
        trips = int(st["trips"])
        delta = trips - trips_before.get(tier, 0)
        if delta or tier not in trips_before:
            stats.increase_counter(PREFIX + "guard_trips", delta, labelvalues=(tier,))
        trips_before[tier] = trips
