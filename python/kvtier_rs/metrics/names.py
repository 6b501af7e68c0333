"""The documented metric series: the one list the collector exports, the table in docs/operations.md shows
(`python -m kvtier_rs.metrics` prints it) and the tests check against.

Each series lists every label combination it exposes. The collector emits all of them from the
first scrape, at zero until the tiers move data, so no dashboard or alert meets a missing series.

Tiers: ``gpu`` (the engine's device blocks, seen only through lookups), ``cpu`` (host DRAM, the
primary tier), ``disk`` (NVMe/file, staged through CPU), ``remote`` (the shared Valkey/Redis
store, staged through CPU; it owns no capacity: the server evicts). Directions: ``load`` moves
blocks toward the GPU, ``store`` away from it. A series for a tier that is not configured stays
at 0.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

#: The tiers with an index and a capacity of their own.
TIERS = ("cpu", "disk")
#: The tiers blocks are promoted from (and stored to).
PROMOTION_TIERS = ("cpu", "disk", "remote")
LOOKUP_TIERS = ("gpu", "cpu", "disk", "remote")
DIRECTIONS = ("load", "store")
LOAD_REFUSALS = ("cost", "backpressure", "guard")
STORE_REFUSALS = {
    "cpu": ("admission", "no_space"),
    "disk": ("admission", "no_space", "backpressure", "unavailable"),
    "remote": ("admission", "no_space", "backpressure", "unavailable"),
}
#: Why a block read from the remote store was a miss (``tiers.remote.values.Miss``).
REMOTE_MISS_REASONS = ("absent", "foreign", "format", "namespace", "key", "length", "check", "error")
EVENT_KINDS = ("stored", "removed", "promoted", "bypassed", "restored")
IO_ERROR_KINDS = ("read", "short_read", "write")


@dataclass(frozen=True)
class Series:
    name: str  # the metric family name; counters' samples end in _total, histograms' in _bucket/_sum/_count
    type: str  # "counter" | "gauge" | "histogram"
    help: str
    labelnames: tuple[str, ...] = ()
    labelsets: tuple[tuple[str, ...], ...] = ((),)  # every combination exposed, in labelnames order

    @property
    def sample_names(self) -> tuple[str, ...]:
        if self.type == "counter":
            return (f"{self.name}_total",)
        if self.type == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        return (self.name,)

    @property
    def exposed_name(self) -> str:
        return self.sample_names[0] if self.type == "counter" else self.name


def _by(*dims: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    return tuple(itertools.product(*dims))


_REFUSAL_SETS = tuple((t, "load", r) for t in PROMOTION_TIERS for r in LOAD_REFUSALS) + tuple(
    (t, "store", r) for t in PROMOTION_TIERS for r in STORE_REFUSALS[t]
)

SERIES: tuple[Series, ...] = (
    # ---- hit quality -------------------------------------------------------------------------
    Series("kvtier_lookups", "counter", "Requests planned (one lookup across all tiers per request)."),
    Series(
        "kvtier_lookup_blocks",
        "counter",
        "Blocks asked of each tier: the whole chain of the GPU, what the GPU missed of the CPU, "
        "what the CPU missed of the disk, what the disk missed of the remote store.",
        ("tier",),
        _by(LOOKUP_TIERS),
    ),
    Series(
        "kvtier_hits",
        "counter",
        "Blocks found in each tier by request lookups (leading-prefix hits).",
        ("tier",),
        _by(LOOKUP_TIERS),
    ),
    Series(
        "kvtier_promotions",
        "counter",
        "Blocks loaded to the device from each tier (disk and remote promotions are staged through CPU).",
        ("tier",),
        _by(PROMOTION_TIERS),
    ),
    Series("kvtier_misses", "counter", "Blocks held by no tier: the engine recomputes them."),
    Series(
        "kvtier_load_failures",
        "counter",
        "Planned hits that could not be loaded (evicted, corrupt, copy error): recomputed.",
    ),
    Series(
        "kvtier_load_released",
        "counter",
        "Reserved hits given back unloaded: the request was asked again or ended before it was scheduled.",
    ),
    Series(
        "kvtier_load_unreserved",
        "counter",
        "Disk or remote hits not loaded because no CPU slot was free to stage them through: recomputed.",
    ),
    Series(
        "kvtier_refusals",
        "counter",
        "Blocks turned away. Load: hits not loaded (cost model, back-pressure, SLO guard). "
        "Store: blocks not admitted (admission rule, no space, write back-pressure, disk tier closed "
        "or refusing I/O).",
        ("tier", "direction", "reason"),
        _REFUSAL_SETS,
    ),
    # ---- movement -----------------------------------------------------------------------------
    Series(
        "kvtier_stored_blocks",
        "counter",
        "Blocks that became readable in each tier (CPU: offload copies and blocks staged up from disk; "
        "disk: write-throughs).",
        ("tier",),
        _by(TIERS),
    ),
    Series("kvtier_evictions", "counter", "Blocks evicted from each tier to make room.", ("tier",), _by(TIERS)),
    Series(
        "kvtier_index_failed",
        "gauge",
        "1 once the tier's index disabled itself after an internal error (it then misses and refuses stores).",
        ("tier",),
        _by(TIERS),
    ),
    Series(
        "kvtier_transferred_bytes",
        "counter",
        "Bytes moved over each tier's link: cpu = device<->host copies, disk = host<->disk I/O "
        "(disk writes include the 4 KiB slot header), remote = block payloads to and from the store.",
        ("tier", "direction"),
        _by(PROMOTION_TIERS, DIRECTIONS),
    ),
    Series(
        "kvtier_latency_seconds",
        "histogram",
        "Seconds per operation. Load: what the engine waited for a request's promotion from the tier, "
        "from when its destinations were given (disk: the part of the read, verify and copy after "
        "that; a read started at reservation only shortens it). Store: one device->CPU copy or one "
        "CPU->disk (or CPU->remote) write job.",
        ("tier", "direction"),
        _by(PROMOTION_TIERS, DIRECTIONS),
    ),
    Series(
        "kvtier_promotions_in_flight",
        "gauge",
        "Promotions from the tier in flight: requests' loads, and disk reads no request waits for any "
        "more until they land (back-pressure acts on this).",
        ("tier",),
        _by(PROMOTION_TIERS),
    ),
    Series("kvtier_disk_write_backlog_blocks", "gauge", "Blocks with a CPU->disk write-through in flight."),
    # ---- capacity -----------------------------------------------------------------------------
    Series("kvtier_capacity_bytes", "gauge", "Payload bytes the tier can hold.", ("tier",), _by(TIERS)),
    Series(
        "kvtier_usage_bytes",
        "gauge",
        "Payload bytes occupied: every block holding a slot (ready, being written or evicted), pinned or not.",
        ("tier",),
        _by(TIERS),
    ),
    Series(
        "kvtier_pinned_bytes",
        "gauge",
        "Payload bytes of blocks pinned (being read) that cannot be evicted now; part of usage.",
        ("tier",),
        _by(TIERS),
    ),
    # ---- disk integrity -------------------------------------------------------------------------
    Series(
        "kvtier_disk_checksum_failures",
        "counter",
        "Disk reads whose header or payload checksum (or key) did not verify: served as misses.",
    ),
    Series(
        "kvtier_disk_io_errors",
        "counter",
        "Disk I/O failures by kind: read errors, short reads, failed writes (incl. ENOSPC).",
        ("kind",),
        _by(IO_ERROR_KINDS),
    ),
    Series("kvtier_disk_full", "gauge", "1 while the disk tier refuses writes after ENOSPC, else 0."),
    # ---- remote store ---------------------------------------------------------------------------
    Series(
        "kvtier_remote_misses",
        "counter",
        "Blocks read from the remote store that were misses, by reason: absent (evicted or flushed), a "
        "value not kvtier's (foreign), an unknown format, another namespace, another key, a wrong length, "
        "a failed check (XXH3, or the keyed MAC), or an error (deadline, node down).",
        ("reason",),
        _by(REMOTE_MISS_REASONS),
    ),
    Series(
        "kvtier_remote_breaker_state",
        "gauge",
        "The remote tier's circuit breaker: 0 closed, 1 open (the store is not called), 2 probing.",
    ),
    # ---- SLO guard ------------------------------------------------------------------------------
    Series("kvtier_guard_enabled", "gauge", "1 when an SLO guard watches the tier.", ("tier",), _by(PROMOTION_TIERS)),
    Series(
        "kvtier_guard_state",
        "gauge",
        "The SLO guard's state of the tier: 0 serving, 1 bypassed (its p99 went over the budget; its hits "
        "are recomputed until a re-probe).",
        ("tier",),
        _by(PROMOTION_TIERS),
    ),
    Series("kvtier_guard_trips", "counter", "Times the SLO guard tripped.", ("tier",), _by(PROMOTION_TIERS)),
    Series(
        "kvtier_guard_p99_seconds",
        "gauge",
        "p99 promotion latency over the guard's window; while bypassed, the p99 that tripped it.",
        ("tier",),
        _by(PROMOTION_TIERS),
    ),
    Series(
        "kvtier_guard_threshold_seconds",
        "gauge",
        "The guard's p99 threshold (0 without a guard).",
        ("tier",),
        _by(PROMOTION_TIERS),
    ),
    # ---- event stream ---------------------------------------------------------------------------
    Series("kvtier_events", "counter", "Block and tier events published, by kind.", ("kind",), _by(EVENT_KINDS)),
    Series(
        "kvtier_events_dropped",
        "counter",
        "Block events dropped undelivered because the bounded event ring was full.",
    ),
)

BY_NAME = {s.name: s for s in SERIES}


def all_sample_names() -> set[str]:
    return {n for s in SERIES for n in s.sample_names}


def markdown_table() -> str:
    rows = ["| series | type | labels | meaning |", "|---|---|---|---|"]
    for s in SERIES:
        labels = ", ".join(s.labelnames) or "-"
        rows.append(f"| `{s.exposed_name}` | {s.type} | {labels} | {s.help} |")
    return "\n".join(rows)
