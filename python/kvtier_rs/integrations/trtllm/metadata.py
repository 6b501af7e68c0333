"""What the scheduler (rank 0) sends every worker each iteration.

The metadata is MPI-broadcast by TensorRT-LLM, so it is small and picklable: frozen dataclasses
of tuples of ints and 16-byte keys, no tensors, no references to kvtier objects. A worker needs
nothing else from the scheduler to act on it: which keys to load into which device blocks, and
which device blocks to save under which keys, priorities and durations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier_rs._core import InvalidArgumentError
from kvtier_rs.checks import invalid_argument

KEY_BYTES = 16  # every block key, under either identity scheme (see identity.py)
DEFAULT_PRIORITY = 35


#: How the scheduler names a reservation in the orchestrator: (tag, request id, sequence).
ReservationId = tuple[str, int, int]


@dataclass(frozen=True)
class LoadSpec:
    """Load `keys` (consecutive blocks of one request) into device blocks `block_ids`: the
    blocks the scheduler reserved (CPU hits pinned, disk hits being read into reserved CPU
    slots) under `reservation` when it matched them. `asynchronous`: the request was answered
    `load_kv_async` and waits outside the batch: the worker binds nothing, and reports through
    `get_finished` once the reservation's reads are in CPU slots; the step the request comes
    back in carries its load again, synchronous."""

    request_id: int
    keys: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    reservation: ReservationId
    asynchronous: bool = False


@dataclass(frozen=True)
class SaveSpec:
    """Offload device blocks `block_ids` of one request under `keys`, per block with its
    retention priority (0..100) and duration in seconds (None: never falls back to 35)."""

    request_id: int
    keys: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    priorities: tuple[int, ...]
    durations_s: tuple[float | None, ...]


@dataclass(frozen=True)
class KvtierConnectorMetadata:
    step: int
    loads: tuple[LoadSpec, ...] = ()
    saves: tuple[SaveSpec, ...] = ()


def _bad(where: str, msg: str) -> InvalidArgumentError:
    return invalid_argument("metadata", f"{where}: {msg}", message=f"invalid connector metadata: {where}: {msg}")


def validate_metadata(meta: Any, num_blocks: int) -> KvtierConnectorMetadata:
    """Check a bound metadata object before any copy touches device memory."""
    if not isinstance(meta, KvtierConnectorMetadata):
        raise _bad("metadata", f"expected KvtierConnectorMetadata from KvtierScheduler, got {type(meta).__name__}")
    for kind, specs, cls in (("loads", meta.loads, LoadSpec), ("saves", meta.saves, SaveSpec)):
        for i, s in enumerate(specs):
            where = f"{kind}[{i}] (request {getattr(s, 'request_id', '?')})"
            if not isinstance(s, cls):
                raise _bad(where, f"expected {cls.__name__}, got {type(s).__name__}")
            if len(s.keys) != len(s.block_ids):
                raise _bad(where, f"{len(s.keys)} keys for {len(s.block_ids)} block ids")
            bad_keys = [k for k in s.keys if not (isinstance(k, bytes) and len(k) == KEY_BYTES)]
            if bad_keys:
                raise _bad(where, f"keys must be {KEY_BYTES}-byte strings, got {bad_keys[0]!r}")
            bad_ids = [
                b for b in s.block_ids if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < num_blocks
            ]
            if bad_ids:
                raise _bad(where, f"block ids {bad_ids[:5]} outside the KV pool (0..{num_blocks - 1})")
            if len(set(s.block_ids)) != len(s.block_ids):
                raise _bad(where, "a device block id appears twice")
            if isinstance(s, LoadSpec) and not (
                isinstance(s.reservation, tuple)
                and len(s.reservation) == 3
                and isinstance(s.reservation[0], str)
                and all(isinstance(v, int) and not isinstance(v, bool) for v in s.reservation[1:])
            ):
                raise _bad(where, f"reservation must be (str, int, int), got {s.reservation!r}")
            if isinstance(s, LoadSpec) and not isinstance(s.asynchronous, bool):
                raise _bad(where, f"asynchronous must be a bool, got {s.asynchronous!r}")
            if isinstance(s, SaveSpec):
                if not (len(s.priorities) == len(s.durations_s) == len(s.keys)):
                    raise _bad(where, "priorities and durations_s must have one entry per key")
                if any(isinstance(p, bool) or not isinstance(p, int) or not 0 <= p <= 100 for p in s.priorities):
                    raise _bad(where, f"priorities must be ints in 0..100, got {list(s.priorities)}")
    return meta


# ---- retention ------------------------------------------------------------------------------


#: The longest duration the index takes (its clock counts nanoseconds in a u64: ~584 years).
MAX_DURATION_S = 2**64 / 1e9


def _ms_to_s(value: Any) -> float | None:
    if value is None:
        return None
    if hasattr(value, "total_seconds"):  # datetime.timedelta (the nanobind/pybind conversion)
        seconds = float(value.total_seconds())
    else:
        seconds = float(value) / 1000.0
    # A duration longer than the index can count (timedelta.max, say) never expires: the same
    # as no duration, which is how the index is told so. TensorRT-LLM checks only a range's
    # priority, so a negative duration can reach here: it has lapsed already (0).
    if seconds != seconds:  # NaN: no usable duration
        return None
    return None if seconds >= MAX_DURATION_S else max(seconds, 0.0)


def block_retention(config: Any, prompt_len: int, tokens_per_block: int, block: int) -> tuple[int, float | None]:
    """(priority, duration_s) of one block under a ``KvCacheRetentionConfig``-shaped object:
    token ranges (end exclusive, None = to the end, earlier ranges win, a range covers every
    block it touches) for prompt blocks; the decode priority and duration for blocks that start
    after the prompt. None or an absent config: the default (35, never expires)."""
    if config is None:
        return DEFAULT_PRIORITY, None
    start, end = block * tokens_per_block, (block + 1) * tokens_per_block
    if start < prompt_len:
        for r in getattr(config, "token_range_retention_configs", None) or ():
            r_end = r.token_end if r.token_end is not None else float("inf")
            if r.token_start < end and start < r_end:
                return int(r.priority), _ms_to_s(getattr(r, "duration_ms", None))
        return DEFAULT_PRIORITY, None
    return int(getattr(config, "decode_retention_priority", DEFAULT_PRIORITY)), _ms_to_s(
        getattr(config, "decode_duration_ms", None)
    )
