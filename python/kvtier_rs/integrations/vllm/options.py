"""kvtier's keys in vLLM's ``kv_connector_extra_config``: parsing and validation.

Pure Python (no vLLM import), so that a bad value is reported with its key name before vLLM
allocates anything, and so that it is testable without vLLM (``kvtier vllm-config`` checks a
whole config with it). Every error is an ``InvalidArgumentError`` (a ``KvTierError``) whose
message starts with ``kv_connector_extra_config[<key>]``, or, for an entry of the tiering
spec's ``secondary_tiers``, ``secondary_tiers[type=KvtierDiskTier][<key>]``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvtier_rs import defaults as D
from kvtier_rs._core import policy_names
from kvtier_rs.checks import show
from kvtier_rs.options import OptionReader, guard_rule
from kvtier_rs.orchestrator.guard import GuardRule

# vLLM's keys that KvtierOffloadingSpec honours: those vLLM itself reads from the same dict
# whichever spec runs (spec_name .. self_describing_kv_events; vLLM validates the chunk sizes,
# kvtier the booleans, which vLLM does not), and the CPU spec's cpu_bytes_to_use,
# eviction_policy and store_threshold, which kvtier reads with vLLM's meaning and validates here.
VLLM_KEYS = frozenset(
    {
        "spec_name",
        "spec_module_path",
        "block_size",
        "blocks_per_chunk",
        "canonical_layout",
        "offload_prompt_only",
        "self_describing_kv_events",
        "cpu_bytes_to_use",
        "eviction_policy",
        "store_threshold",
    }
)

# Those of them vLLM reads as booleans (with bool(value)).
_VLLM_BOOL_KEYS = ("offload_prompt_only", "self_describing_kv_events", "canonical_layout")

_TIERING = (
    "vLLM's TieringOffloadingSpec (spec_name 'TieringOffloadingSpec', or "
    "'KvtierTieringOffloadingSpec' on vLLM's CPU build)"
)
# Keys only other vLLM specs read: under KvtierOffloadingSpec nothing would, so they are refused
# (naming the spec that reads them) rather than accepted and ignored.
OTHER_SPEC_KEYS: dict[str, str] = {
    "max_tracker_size": "vLLM's CPUOffloadingSpec (the size of its store_threshold tracker; kvtier "
    "counts a chunk's offers in its own index, without that limit)",
    "secondary_tiers": _TIERING + "; kvtier's disk tier here is disk_root and disk_bytes_to_use",
    "backpressure": _TIERING,
    "sync_load_budget_bytes": _TIERING + " (vLLM 0.33)",
    "tier_poll_interval_s": _TIERING + " (vLLM 0.33)",
}

#: Default of ``disk_max_promotions_in_flight``: chunks, each one disk read. Far above what one
#: request's prompt usually promotes, so only a burst from many requests meets it.
DISK_PROMOTIONS_IN_FLIGHT = 1024

# kvtier's own keys, with a one-line description used in error messages and docs.
KVTIER_KEYS: dict[str, str] = {
    "cpu_admission": f'CPU tier admission: "always", "uses:K" or "priority:T" (default "{D.CPU_ADMISSION}")',
    "disk_root": "directory of the disk tier; setting it enables the disk tier",
    "disk_bytes_to_use": 'disk tier capacity, bytes or a size string such as "64GiB" (needs disk_root)',
    "disk_policy": "disk tier eviction policy (default lru)",
    "disk_admission": f'disk tier admission: "always", "uses:K" or "priority:T" (default "{D.DISK_ADMISSION}")',
    "disk_io_engine": 'disk I/O engine: "auto", "io_uring" or "pool" (positioned I/O on threads; '
    'default "auto": io_uring when the kernel allows it)',
    "disk_queue_depth": f"disk I/O requests in flight (default {D.DISK_QUEUE_DEPTH})",
    "disk_on_reset": 'what a cache reset does to the disk tier: "clear" (default: every block is '
    'forgotten, as after a weight update) or "keep" (the blocks stay valid, e.g. sleep without new weights)',
    "cost_model": 'load-or-recompute rule for disk hits: "always_load" or a dict with '
    "prefill_tokens_per_s and disk_read_bytes_per_s",
    "guard": '"checksum" (default): a disk block whose checksum does not match is a miss',
    "disk_slo_guard": "null (default: off) or a dict with p99_ms and optionally window_s (default 10), "
    "recover_s (default 30) and min_samples (default 20): when the p99 wait on disk promotions over "
    "window_s exceeds p99_ms, the disk tier is bypassed (its hits recomputed) for recover_s, then re-probed",
    "disk_max_promotions_in_flight": "disk->CPU chunk promotions in flight at most; a disk hit beyond "
    f"them is recomputed (default {DISK_PROMOTIONS_IN_FLIGHT})",
}

_GUARDS = ("checksum",)

#: The reader of this dict; ``naming`` maps the disk tier's own arguments to these keys.
READER = OptionReader("kv_connector_extra_config")
_opts = READER
_err = _opts.error
#: The disk tier's constructor arguments -> the keys they come from (for READER.naming).
DISK_TIER_KEYS = {
    "capacity_bytes": "disk_bytes_to_use",
    "policy": "disk_policy",
    "admission": "disk_admission",
    "engine": "disk_io_engine",
    "queue_depth": "disk_queue_depth",
}


@dataclass(frozen=True)
class CostModel:
    """The ``cost_model`` key: load a disk hit only when reading it is faster than recomputing
    its tokens. The rule itself is the orchestrator's ``CostModel`` (``build``), so every
    adapter decides the same way; this class only holds the configured rates.

    ``None`` rates mean "always load" (the default: on most hardware a sequential read of a
    KV block beats recomputing it, and the tests want disk hits to be taken).
    """

    prefill_tokens_per_s: float | None = None
    disk_read_bytes_per_s: float | None = None

    def build(self, tokens_per_chunk: int, chunk_bytes: int) -> Any:
        """The orchestrator's model for one chunk size, or None for "always load".

        Only the disk read is weighed against recomputing (the meaning of
        ``disk_read_bytes_per_s``): the CPU->GPU copy that follows is the same as for any CPU
        hit, so its hop gets no cost. The disk bandwidth then follows measured reads."""
        if self.prefill_tokens_per_s is None or self.disk_read_bytes_per_s is None:
            return None
        from kvtier_rs.orchestrator.cost import CostModel as Model

        return Model(
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            tokens_per_block=tokens_per_chunk,
            block_bytes=chunk_bytes,
            bandwidth={"disk": self.disk_read_bytes_per_s, "cpu": math.inf},
            latency_s={"disk": 0.0, "cpu": 0.0},
        )

    def load_beats_recompute(self, tokens: int, nbytes: int) -> bool:
        model = self.build(tokens, nbytes)
        return model is None or model.worth_loading("disk", 1)


def _cost_model(value: Any) -> CostModel:
    key = "cost_model"
    if value == "always_load":
        return CostModel()
    if not isinstance(value, Mapping):
        raise _err(
            key,
            f'expected "always_load" or a dict with prefill_tokens_per_s and disk_read_bytes_per_s, got {show(value)}',
        )
    fields = ("prefill_tokens_per_s", "disk_read_bytes_per_s")
    unknown = set(value) - set(fields)
    if unknown:
        raise _err(
            key,
            f"unknown field(s) {sorted(map(str, unknown))}; expected prefill_tokens_per_s and disk_read_bytes_per_s",
        )
    rates = {f: _opts.positive(key, value.get(f), field=f) for f in fields}
    return CostModel(**rates)


@dataclass(frozen=True)
class KvtierOptions:
    cpu_bytes: int
    cpu_policy: str = "lru"
    cpu_admission: str = D.CPU_ADMISSION
    disk_root: str | None = None
    disk_bytes: int | None = None
    disk_policy: str = "lru"
    disk_admission: str = D.DISK_ADMISSION
    disk_io_engine: str = D.DISK_IO_ENGINE
    disk_queue_depth: int = D.DISK_QUEUE_DEPTH
    disk_on_reset: str = "clear"
    cost_model: CostModel = CostModel()
    guard: str = "checksum"
    disk_slo_guard: GuardRule | None = None
    disk_max_promotions_in_flight: int = DISK_PROMOTIONS_IN_FLIGHT

    @property
    def disk_enabled(self) -> bool:
        return self.disk_root is not None


def check_vllm_bools(extra: Mapping[str, Any]) -> None:
    """vLLM reads its boolean keys with bool(value), validating nothing: "false" (a string from a
    config file or a command line) would turn offload_prompt_only or self-describing events
    *on*. Refused here, naming the key, before vLLM acts on the opposite of what was asked."""
    for k in _VLLM_BOOL_KEYS:
        if k in extra and not isinstance(extra[k], bool):
            raise _err(k, f"expected a bool (true or false), got {show(extra[k])}")


def cpu_bytes_to_use(extra: Mapping[str, Any]) -> int:
    """The required ``cpu_bytes_to_use``: bytes (an int) or a size string such as "32GiB"."""
    value = extra.get("cpu_bytes_to_use")
    if value in (None, "", 0):
        raise _err("cpu_bytes_to_use", "required: total bytes of the CPU tier, e.g. 4294967296 or '4GiB'")
    return _opts.size("cpu_bytes_to_use", value)


def parse_options(extra: Mapping[str, Any]) -> KvtierOptions:
    """Validate ``extra`` (the connector's extra config) and return kvtier's options."""
    known = VLLM_KEYS | set(KVTIER_KEYS)
    other = sorted((k for k in extra if k in OTHER_SPEC_KEYS), key=str)
    if other:
        raise _err(
            other[0],
            f"read only by {OTHER_SPEC_KEYS[other[0]]}; KvtierOffloadingSpec does not use it "
            "and would ignore it, so it is refused",
        )
    unknown = sorted((k for k in extra if k not in known and k != "cache_policy_module_path"), key=str)
    if unknown:
        raise _err(
            unknown[0],
            "unknown key. kvtier keys: "
            + ", ".join(sorted(KVTIER_KEYS))
            + "; vLLM keys: "
            + ", ".join(sorted(VLLM_KEYS)),
        )
    check_vllm_bools(extra)
    if "cache_policy_module_path" in extra:
        raise _err(
            "cache_policy_module_path",
            "kvtier runs its policies in its Rust core; "
            "choose one of " + ", ".join(policy_names()) + " with eviction_policy",
        )
    cpu_bytes = cpu_bytes_to_use(extra)
    policy = _opts.policy("eviction_policy", extra.get("eviction_policy", "lru"))
    # vLLM's "store a chunk on its N-th offer" (N >= 2; 0 and 1 store every chunk) is kvtier's
    # uses:N admission, whose N the core takes up to 255.
    st = _opts.int_in("store_threshold", extra.get("store_threshold", 0), 0, 255)
    if "cpu_admission" in extra and st >= 2:
        raise _err("cpu_admission", "set either cpu_admission or store_threshold, not both")
    admission = _opts.admission("cpu_admission", extra.get("cpu_admission", D.CPU_ADMISSION))
    if st >= 2:
        admission = _opts.admission("store_threshold", f"uses:{st}")

    disk_root = extra.get("disk_root")
    disk_keys = [
        k
        for k in (
            "disk_bytes_to_use",
            "disk_policy",
            "disk_admission",
            "disk_io_engine",
            "disk_queue_depth",
            "disk_on_reset",
            "cost_model",
            "disk_slo_guard",
            "disk_max_promotions_in_flight",
        )
        if k in extra
    ]
    if disk_root is None:
        if disk_keys:
            raise _err(disk_keys[0], "needs disk_root (the disk tier is off without it)")
        disk_bytes = None
    else:
        disk_root = _opts.directory("disk_root", disk_root)
        if "disk_bytes_to_use" not in extra:
            raise _err("disk_bytes_to_use", "required with disk_root: capacity of the disk tier")
        disk_bytes = _opts.size("disk_bytes_to_use", extra["disk_bytes_to_use"])
    engine = _opts.disk_io_engine("disk_io_engine", extra.get("disk_io_engine", D.DISK_IO_ENGINE))
    qd = _opts.queue_depth("disk_queue_depth", extra.get("disk_queue_depth", D.DISK_QUEUE_DEPTH))
    guard = extra.get("guard", "checksum")
    if guard not in _GUARDS:
        raise _err(
            "guard",
            f"{show(guard)} is not supported; kvtier always verifies disk checksums "
            '("checksum"): serving unverified KV is never an option',
        )
    return KvtierOptions(
        cpu_bytes=cpu_bytes,
        cpu_policy=policy,
        cpu_admission=admission,
        disk_root=disk_root,
        disk_bytes=disk_bytes,
        disk_policy=_opts.policy("disk_policy", extra.get("disk_policy", "lru")),
        disk_admission=_opts.admission("disk_admission", extra.get("disk_admission", D.DISK_ADMISSION)),
        disk_io_engine=engine,
        disk_queue_depth=qd,
        disk_on_reset=_opts.choice("disk_on_reset", extra.get("disk_on_reset", "clear"), ("clear", "keep")),
        cost_model=_cost_model(extra.get("cost_model", "always_load")),
        guard=guard,
        disk_slo_guard=guard_rule(_opts, "disk_slo_guard", extra.get("disk_slo_guard")),
        disk_max_promotions_in_flight=_opts.int_in(
            "disk_max_promotions_in_flight",
            extra.get("disk_max_promotions_in_flight", DISK_PROMOTIONS_IN_FLIGHT),
            1,
            1 << 20,
        ),
    )


# ---- KvtierDiskTier, an entry of secondary_tiers under vLLM's tiering spec ---------------------

#: The type name of kvtier's disk tier in ``secondary_tiers``.
DISK_TIER_TYPE = "KvtierDiskTier"
#: The keys of a secondary_tiers entry that vLLM's SecondaryTierFactory takes out; it passes the
#: rest to the tier's constructor as keywords.
VLLM_TIER_KEYS = ("type", "module_path", "backpressure")
#: The reader of a KvtierDiskTier entry.
DISK_TIER_READER = OptionReader(f"secondary_tiers[type={DISK_TIER_TYPE}]")
#: vLLM's ``Locality`` values (vllm.v1.kv_offload.base), to check a config without importing vLLM.
LOCALITIES = ("LOCAL", "REMOTE")


@dataclass(frozen=True)
class DiskTierOptions:
    root_dir: str
    capacity_bytes: int
    policy: str = "lru"
    admission: str = D.DISK_ADMISSION
    io_engine: str = D.DISK_IO_ENGINE
    queue_depth: int = D.DISK_QUEUE_DEPTH
    locality: str = "LOCAL"


def parse_disk_tier(entry: Mapping[str, Any], *, localities: tuple[str, ...] = LOCALITIES) -> DiskTierOptions:
    """Validate the keys of a KvtierDiskTier entry as the tier receives them (the entry less
    ``VLLM_TIER_KEYS``); every error names its key. What only the open tier can check (a
    capacity that holds no block, a directory it cannot open) is left to it."""
    r = DISK_TIER_READER
    known = sorted(f.name for f in fields(DiskTierOptions))
    unknown = sorted((k for k in entry if k not in known), key=str)
    if unknown:
        theirs = ", ".join(VLLM_TIER_KEYS)
        raise r.error(unknown[0], f"unknown key; {DISK_TIER_TYPE} keys: {', '.join(known)} (and vLLM's {theirs})")
    if entry.get("root_dir") is None:
        raise r.error("root_dir", "required: the disk tier's directory, got None")
    root_dir = r.directory("root_dir", entry["root_dir"])
    if entry.get("capacity_bytes") is None:
        raise r.error("capacity_bytes", "required: the disk tier's size, e.g. '64GiB'")
    locality = entry.get("locality")
    return DiskTierOptions(
        root_dir=root_dir,
        capacity_bytes=r.size("capacity_bytes", entry["capacity_bytes"]),
        policy=r.policy("policy", entry.get("policy", "lru")),
        admission=r.admission("admission", entry.get("admission", D.DISK_ADMISSION)),
        io_engine=r.disk_io_engine("io_engine", entry.get("io_engine", D.DISK_IO_ENGINE)),
        queue_depth=r.queue_depth("queue_depth", entry.get("queue_depth", D.DISK_QUEUE_DEPTH)),
        locality="LOCAL" if locality is None else r.choice("locality", locality, localities),
    )
