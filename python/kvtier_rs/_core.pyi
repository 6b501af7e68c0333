"""Type stubs for the Rust extension `kvtier_rs._core` (rust/py/)."""

import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any, Literal, final

if sys.version_info >= (3, 12):
    from collections.abc import Buffer
else:
    from typing_extensions import Buffer

__all__ = [
    "DEFAULT_PRIORITY",
    "FAULT_INJECTION",
    "MAX_KEY_BYTES",
    "MAX_REPLICAS",
    "Admission",
    "BlockIndex",
    "ClosedError",
    "DirectoryLockedError",
    "DiskIoError",
    "DiskJobResult",
    "DiskTier",
    "DiskWriteTicket",
    "HostPool",
    "IndexFailedError",
    "InvalidArgumentError",
    "KvTierError",
    "NoSpaceError",
    "NotPinnedError",
    "NotReadyError",
    "ReplayProgress",
    "ReplayTrace",
    "StoreOutcome",
    "disk_status",
    "io_uring_probe",
    "parse_admission",
    "policy_names",
    "replay_sweep",
    "replay_tiers",
    "version",
    "_inject_spawn_failure",
]

# Typing aliases only (stubtest's allowlist names them): keys are engine digests or integers.
Key = int | bytes
State = Literal["writing", "ready", "evicting"]

MAX_KEY_BYTES: int
DEFAULT_PRIORITY: int
# The most replicas a tier replay splits a trace across (`replay_tiers(replicas=...)`).
MAX_REPLICAS: int
# Whether the `_inject_*` test hooks are compiled in: the development build (the
# `fault-injection` feature) only; a release wheel has none of them.
FAULT_INJECTION: bool

def version() -> str: ...
def policy_names() -> list[str]: ...
def parse_admission(spec: str) -> str: ...

@final
class Admission:
    """An admission rule ("always", "uses:K", "priority:T") with the uses it has counted, as the
    index's tiers count them (a count-min sketch for `expected_keys` keys, halved with age), for
    a tier that keeps no index in the core (the shared remote tier)."""

    def __new__(cls, rule: str, expected_keys: int = 65536) -> Admission: ...
    def offer(self, key: Key, priority: int = 35) -> bool:
        """Count this offer as a use and say whether the tier takes the block."""
    def record_use(self, key: Key) -> None: ...
    @property
    def rule(self) -> str: ...
    def clear(self) -> None: ...

class KvTierError(Exception): ...

class InvalidArgumentError(KvTierError):
    """`arg` (the argument's name) and `reason` (what is wrong) are set on every error that
    names one argument: all of the core's, and those built with kvtier_rs.checks.invalid_argument."""

    arg: str
    reason: str

class NoSpaceError(KvTierError): ...
class NotReadyError(KvTierError): ...
class NotPinnedError(KvTierError): ...
class IndexFailedError(KvTierError): ...  # internal error: the index now misses and refuses stores

@final
class HostPool:
    """Page-aligned host memory in fixed-size slots; supports the buffer protocol (writable)."""

    def __new__(cls, total_bytes: int, slot_bytes: int) -> HostPool: ...
    @staticmethod
    def stride_for(slot_bytes: int) -> int:
        """Bytes one slot of `slot_bytes` takes in a pool (rounded up to whole 4 KiB pages)."""
    @staticmethod
    def wrap(buffer: Buffer, slot_bytes: int) -> HostPool:
        """A pool over `buffer`'s memory (writable, C-contiguous, page-aligned), in place."""
    @property
    def wrapped(self) -> bool: ...
    @property
    def ptr(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def slot_bytes(self) -> int: ...
    @property
    def num_slots(self) -> int: ...
    def slot_offset(self, slot: int) -> int: ...
    def copy_spans(self, buffer: Buffer, spans: Buffer, *, into_pool: bool) -> int:
        """Copy (pool_offset, buffer_offset, nbytes) int64 rows between the pool and `buffer`
        (C-contiguous), GIL released, every span bounds-checked first; returns bytes copied."""
    def __len__(self) -> int: ...
    # The buffer protocol (PEP 688); at run time on 3.11 it exists only at the C level.
    def __buffer__(self, flags: int, /) -> memoryview: ...

@final
class StoreOutcome:
    keys: list[Key]
    slots: list[int]
    skipped: list[Key]
    refused: list[Key]
    evicted: list[Key]
    evicted_slots: list[int]

@final
class BlockIndex:
    def __new__(
        cls,
        capacity: int | None = None,
        *,
        policy: str = "lru",
        admission: str = "always",
        tier: Literal["gpu", "cpu", "disk"] = "cpu",
        pool: HostPool | None = None,
        manual_clock: bool = False,
        block_bytes: int = 0,
    ) -> BlockIndex: ...
    @property
    def capacity(self) -> int: ...
    @property
    def policy(self) -> str: ...
    @property
    def admission(self) -> str: ...
    @property
    def tier(self) -> str: ...
    @property
    def failure(self) -> str | None:
        """Why the index disabled itself (an internal error), or None while it is healthy."""
    def __len__(self) -> int: ...
    def lookup_prefix(self, keys: Sequence[Key] | Iterable[Key], /) -> int: ...
    def contains(self, keys: Iterable[Key]) -> list[bool]: ...
    def prepare_store(
        self, keys: Iterable[Key], *, priority: int = 35, duration_s: float | None = None, admitted: bool = False
    ) -> StoreOutcome:
        """`admitted`: staged up from a lower tier that admitted the blocks (not asked again)."""
    def complete_store(self, keys: Iterable[Key], success: bool = True) -> int: ...
    def pin_for_load(self, keys: Iterable[Key]) -> list[int]: ...
    def unpin(self, keys: Iterable[Key]) -> None: ...
    def touch(self, keys: Iterable[Key]) -> None: ...
    def refresh(self, keys: Iterable[Key]) -> None:
        """Rank each resident key as the most recent of its list or level, tail-first, without
        counting a use (ARC keeps a T1 key in T1): prefix order for blocks only stored."""
    def renew(self, keys: Iterable[Key], *, priority: int = 35, duration_s: float | None = None) -> int:
        """Set the retention priority and duration of the present keys (ready or being written;
        absent ones are ignored) as if just stored with them; returns how many were renewed.
        Only the priority policy's order reads them; a renewal is not a use."""
    def record_use(self, keys: Iterable[Key]) -> None: ...
    def remove(self, keys: Iterable[Key]) -> list[Key]: ...
    def clear(self) -> int: ...
    def _inject_fault(self, kind: Literal["store_panic"]) -> None: ...
    def set_lookup_results(self, ready: object, writing: object, absent: object) -> None: ...
    def lookup_result(self, key: Key, context: object = None, /) -> object: ...
    def lookup_one(self, key: Key, /) -> bool: ...
    def prepare_store_one(self, key: Key, *, priority: int = 35, duration_s: float | None = None) -> int | None: ...
    def complete_store_one(self, key: Key, success: bool = True) -> bool: ...
    def pin_one(self, key: Key) -> int: ...
    def unpin_one(self, key: Key) -> None: ...
    def touch_one(self, key: Key) -> None: ...
    def renew_one(self, key: Key, *, priority: int = 35, duration_s: float | None = None) -> bool: ...
    def remove_one(self, key: Key) -> bool: ...
    def state(self, key: Key) -> tuple[State, int, int] | None: ...
    def entries(self) -> list[tuple[Key, State, int, int]]: ...
    def stats(self) -> dict[str, int]: ...
    def advance_clock(self, seconds: float) -> None: ...

# ---- disk tier (rust/py/disk.rs) ----

class DiskIoError(KvTierError): ...  # a filesystem operation failed (path + OS reason)
class DirectoryLockedError(KvTierError): ...  # the directory is open in this or another process
class ClosedError(KvTierError): ...  # the tier was used after close()

def disk_status(path: str | os.PathLike[str], *, verify: bool = False) -> dict[str, Any]:
    """Read-only scan of a disk tier directory (no lock taken, nothing written): path,
    block_bytes, slot_stride, num_files, slots_per_file, capacity_blocks, dir_id, blocks, bytes,
    free_slots, damaged_slots, stale_copies, missing_slots, min_generation, max_generation, last_generation,
    verified_payloads. DiskIoError when it is not a disk tier directory or a slab is missing."""

def io_uring_probe() -> str | None:
    """None when io_uring works in this process, else the reason."""

def _inject_spawn_failure(after: int | None) -> None:
    """Test hook: the disk tier threads started from this thread after the next `after` are
    refused (EAGAIN), as under a pids limit; None disarms it."""

@final
class DiskJobResult:
    job_id: int
    kind: str  # "read" | "write"
    success: bool
    ok_keys: list[Key]
    failed_keys: list[Key]
    bytes: int
    seconds: float

@final
class DiskWriteTicket:
    job_id: int
    keys: list[Key]
    skipped: list[Key]
    refused: list[Key]
    evicted: list[Key]

@final
class DiskTier:
    def __new__(
        cls,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        block_bytes: int,
        *,
        num_files: int = 0,
        policy: str = "lru",
        admission: str = "always",
        engine: str = "auto",  # "auto" | "io_uring" | "pool"
        queue_depth: int = 16,
        direct: str = "auto",  # "auto" | "on" | "off"
        verify_on_open: bool = False,
        full_retry_s: float = 10.0,
    ) -> DiskTier: ...
    @property
    def path(self) -> str: ...
    @property
    def engine(self) -> str: ...
    @property
    def queue_depth(self) -> int: ...
    @property
    def io_mode(self) -> str: ...  # "direct" | "buffered"
    @property
    def preallocated(self) -> bool: ...
    @property
    def notes(self) -> list[str]: ...
    @property
    def engine_probe(self) -> dict[str, Any] | None: ...
    @property
    def block_bytes(self) -> int: ...
    @property
    def slot_stride(self) -> int: ...
    @property
    def capacity_blocks(self) -> int: ...
    @property
    def num_files(self) -> int: ...
    @property
    def policy(self) -> str: ...
    @property
    def admission(self) -> str: ...
    @property
    def closed(self) -> bool: ...
    @property
    def disk_full(self) -> bool: ...
    @property
    def running_jobs(self) -> int: ...
    def __len__(self) -> int: ...
    def __enter__(self) -> DiskTier: ...
    def __exit__(self, _t: object, _v: object, _tb: object) -> bool: ...
    def submit_write(
        self,
        keys: Sequence[Key],
        pool: HostPool,
        slots: Sequence[int],
        *,
        priority: int = 35,
        duration_s: float | None = None,
    ) -> DiskWriteTicket: ...
    def submit_read(self, keys: Sequence[Key], pool: HostPool, slots: Sequence[int]) -> int: ...
    def poll(self) -> list[DiskJobResult]: ...
    def try_take(self, job_id: int) -> DiskJobResult | None: ...
    def wait(self, job_id: int, timeout: float | None = None) -> DiskJobResult | None: ...
    def wait_idle(self, timeout: float | None = None) -> bool: ...
    def lookup_prefix(self, keys: Sequence[Key]) -> int: ...
    def contains(self, keys: Sequence[Key]) -> list[bool]: ...
    def touch(self, keys: Sequence[Key]) -> None: ...
    def renew(self, keys: Sequence[Key], *, priority: int = 35, duration_s: float | None = None) -> int:
        """`BlockIndex.renew` on the tier's index. Not written to disk: a reopened tier ranks a block
        by the priority and duration it was written with."""
    def record_use(self, keys: Sequence[Key]) -> None: ...
    def remove(self, keys: Sequence[Key]) -> list[Key]: ...
    def clear(self) -> int:
        """Forget every block, now and after a restart; refused while jobs run."""
    def stats(self) -> dict[str, int | float | str]: ...
    def close(self) -> None: ...
    def _inject_fault(self, kind: str | None, count: int = 1) -> None: ...

# ---- trace replay for the planner (rust/py/replay.rs) ----

@final
class ReplayTrace:
    """A request trace with keys remapped to dense ids, shared read-only by replays."""

    def __new__(
        cls,
        offsets: Sequence[int],
        keys: Sequence[int],
        input_tokens: Sequence[int],
        timestamps_s: Sequence[float],
        block_size: int,
    ) -> ReplayTrace: ...
    @property
    def block_size(self) -> int: ...
    @property
    def n_requests(self) -> int: ...
    @property
    def n_refs(self) -> int: ...
    @property
    def n_keys(self) -> int: ...
    @property
    def total_tokens(self) -> int: ...
    @property
    def prefix_chained(self) -> bool:
        """Every block id always follows the same id: only then is `opt` a bound (a sweep with
        `opt` refuses any other trace)."""
    def analyze(self, top: int = 10) -> dict[str, Any]: ...

@final
class ReplayProgress:
    """Requests served so far by a running sweep; poll `done` from another thread."""

    def __init__(self) -> None: ...
    @property
    def done(self) -> int: ...

def replay_sweep(
    trace: ReplayTrace,
    jobs: Sequence[tuple[str, int, str]],
    *,
    warmup: float = 0.5,
    mode: str = "tree",
    threads: int = 0,
    progress: ReplayProgress | None = None,
) -> list[dict[str, Any]]:
    """Replay (policy, capacity_blocks, admission) jobs; policies fifo, lru, arc, priority,
    s3fifo, lhd, opt, ceiling. Each dict: policy, capacity_blocks (None for ceiling), admission,
    hit_tokens, total_tokens, hit_blocks, total_blocks, measured_requests, all_hit_blocks
    (hit blocks over the whole replay, warm-up included: what opt bounds), insertions,
    evictions, peak_resident, underfilled (never full during the replay), filled_at_request
    (the request that first filled the cache, or None), hit_histogram ((hit blocks, measured
    requests, their hit tokens) for each count > 0)."""

def replay_tiers(
    trace: ReplayTrace,
    tiers: Sequence[tuple[str, int, str, str]],
    *,
    warmup: float = 0.5,
    mode: str = "tree",
    replicas: Sequence[int] | None = None,
    shared: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Inclusive write-through tiers (name, capacity_blocks, policy, admission), fastest first.
    `replicas`: the replica serving each request (None: one replica); the tiers named in
    `shared` (None: none) are one cache for all replicas, the others one per replica (their
    counts summed).
    The dict: tiers (per tier: served_tokens, served_blocks, insertions, evictions, underfilled,
    filled_at_request, ...), miss_tokens, miss_blocks, total_tokens, total_blocks,
    measured_requests, served_histogram ((blocks per tier, measured requests, tokens per tier))."""
