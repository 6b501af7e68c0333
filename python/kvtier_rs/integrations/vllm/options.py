"""kvtier's keys in vLLM's ``kv_connector_extra_config``: parsing and validation.

Pure Python (no vLLM import), so that a bad value is reported with its key name before vLLM
allocates anything, and so that it is testable without vLLM (``kvtier vllm-config`` checks a
whole config with it). Every error is an ``InvalidArgumentError`` (a ``KvTierError``) whose
message starts with ``kv_connector_extra_config[<key>]``, or, for an entry of the tiering
spec's ``secondary_tiers``, ``secondary_tiers[type=KvtierDiskTier][<key>]`` (or
``type=KvtierRemoteTier``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier_rs import defaults as D
from kvtier_rs import settings as S
from kvtier_rs._core import policy_names
from kvtier_rs.checks import show
from kvtier_rs.options import OptionReader
from kvtier_rs.orchestrator.guard import GuardRule
from kvtier_rs.orchestrator.request_guard import RequestGuard, RequestRule
from kvtier_rs.tiers.build import DISK_TIER_ARGS, as_written

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

#: kvtier's own keys here, with their one-line meaning, from the one configuration tree.
KVTIER_KEYS: dict[str, str] = {
    name: S.BY_KEY[key].meaning for name, key in S.names_for(S.VLLM).items() if name not in VLLM_KEYS
}

#: The reader of this dict; ``naming`` maps the disk tier's own arguments to these keys.
READER = OptionReader("kv_connector_extra_config")
_opts = READER
_err = _opts.error


def request_guard(options: KvtierOptions, log: Any = None) -> RequestGuard | None:
    """The request-level rule of ``slo_guard`` over this engine's tiers (CPU, then disk, then
    remote), or None when it is off."""
    if options.slo_guard is None:
        return None
    return RequestGuard(options.slo_guard, options.tiers, log=log)


def disk_tier_names(written: Mapping[str, str]) -> tuple[dict[str, str], str]:
    """For ``OptionReader.naming``: the disk tier's constructor arguments -> the names the user
    wrote for their options (``written``: option key -> name), and the name of disk_root."""
    return as_written(DISK_TIER_ARGS, written), written.get("disk_root", "disk_root")


@dataclass(frozen=True)
class CostModel:
    """The ``cost_model`` key: load a disk hit only when reading it is faster than recomputing
    its tokens. The rule itself is the orchestrator's ``CostModel`` (``build``), so every
    adapter decides the same way; this class only holds the configured rates.

    No ``prefill_tokens_per_s`` means "always load" (the default: on most hardware a sequential
    read of a KV block beats recomputing it, and the tests want disk hits to be taken).
    """

    prefill_tokens_per_s: float | None = None
    disk_read_bytes_per_s: float | None = None

    @classmethod
    def of(cls, rates: S.CostRates | None) -> CostModel:
        if rates is None:
            return cls()
        return cls(rates.prefill_tokens_per_s, rates.disk_read_bytes_per_s)

    def build(self, tokens_per_chunk: int, chunk_bytes: int) -> Any:
        """The orchestrator's model for one chunk size, or None for "always load".

        Only the disk read is weighed against recomputing (the meaning of
        ``disk_read_bytes_per_s``): the CPU->GPU copy that follows is the same as for any CPU
        hit, so its hop gets no cost. The disk bandwidth then follows measured reads."""
        if self.prefill_tokens_per_s is None:
            return None
        from kvtier_rs.orchestrator.cost import CostModel as Model

        # Every hop the model requires; an unset read rate starts from the model's estimate.
        bandwidth = {"cpu": math.inf, "disk": Model.DEFAULT_DISK_BYTES_PER_S}
        if self.disk_read_bytes_per_s is not None:
            bandwidth["disk"] = self.disk_read_bytes_per_s
        return Model(
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            tokens_per_block=tokens_per_chunk,
            block_bytes=chunk_bytes,
            bandwidth=bandwidth,
            latency_s={"disk": 0.0, "cpu": 0.0},
        )

    def load_beats_recompute(self, tokens: int, nbytes: int) -> bool:
        model = self.build(tokens, nbytes)
        return model is None or model.worth_loading("disk", 1)


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
    disk_max_write_backlog: int = D.DISK_MAX_WRITE_BACKLOG
    disk_on_reset: str = "clear"
    cost_model: CostModel = CostModel()
    guard: str = "checksum"
    disk_slo_guard: GuardRule | None = None
    slo_guard: RequestRule | None = None
    disk_max_promotions_in_flight: int = S.BY_KEY["disk_max_promotions_in_flight"].default_for(S.VLLM)
    #: The shared remote tier, or None.
    remote: S.RemoteTierSettings | None = None
    #: Each option given -> the name the user wrote for it (``disk_tier_names``).
    written: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def disk_enabled(self) -> bool:
        return self.disk_root is not None

    @property
    def lower_tiers(self) -> tuple[str, ...]:
        """The tiers behind the CPU tier, in the order a miss consults them."""
        return (("disk",) if self.disk_enabled else ()) + (("remote",) if self.remote is not None else ())

    @property
    def tiers(self) -> tuple[str, ...]:
        return ("cpu", *self.lower_tiers)


def check_vllm_bools(extra: Mapping[str, Any]) -> None:
    """vLLM reads its boolean keys with bool(value), validating nothing: "false" (a string from a
    config file or a command line) would turn offload_prompt_only or self-describing events
    *on*. Refused here, naming the key, before vLLM acts on the opposite of what was asked."""
    for k in _VLLM_BOOL_KEYS:
        if k in extra and not isinstance(extra[k], bool):
            raise _err(k, f"expected a bool (true or false), got {show(extra[k])}")


def cpu_bytes_to_use(extra: Mapping[str, Any]) -> int:
    """The required CPU tier size, ``cpu_bytes`` or vLLM's own name for it, ``cpu_bytes_to_use``:
    bytes (an int) or a size string such as "32GiB"."""
    if "cpu_bytes" in extra and "cpu_bytes_to_use" in extra:
        raise _err("cpu_bytes", "set either cpu_bytes_to_use or cpu_bytes, not both (they are the same option)")
    key = "cpu_bytes" if "cpu_bytes" in extra else "cpu_bytes_to_use"
    value = extra.get(key)
    if value in (None, "", 0):
        raise _err(key, "required: total bytes of the CPU tier, e.g. 4294967296 or '4GiB'")
    return _opts.size(key, value)


def parse_options(extra: Mapping[str, Any]) -> KvtierOptions:
    """Validate ``extra`` (the connector's extra config) and return kvtier's options."""
    names = S.names_for(S.VLLM)
    other = sorted((k for k in extra if k in OTHER_SPEC_KEYS), key=str)
    if other:
        raise _err(
            other[0],
            f"read only by {OTHER_SPEC_KEYS[other[0]]}; KvtierOffloadingSpec does not use it "
            "and would ignore it, so it is refused",
        )
    unknown = sorted(
        (k for k in extra if k not in names and k not in VLLM_KEYS and k != "cache_policy_module_path"), key=str
    )
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
    # vLLM's "store a chunk on its N-th offer" (N >= 2; 0 and 1 store every chunk) is kvtier's
    # uses:N admission, whose N the core takes up to 255.
    st = _opts.int_in("store_threshold", extra.get("store_threshold", 0), 0, 255)
    if "cpu_admission" in extra and st >= 2:
        raise _err("cpu_admission", "set either cpu_admission or store_threshold, not both")
    values = S.read_values({k: v for k, v in extra.items() if k in names}, S.VLLM, _opts)
    if st >= 2:
        values["cpu_admission"] = _opts.admission("store_threshold", f"uses:{st}")
    return KvtierOptions(
        cpu_bytes=cpu_bytes,
        cpu_policy=values["cpu_policy"],
        cpu_admission=values["cpu_admission"],
        disk_root=values["disk_root"],
        disk_bytes=values["disk_bytes"],
        **{k: values[k] for k in _DISK_OPTION_KEYS if values[k] is not None},
        cost_model=CostModel.of(values["cost_model"]),
        guard=values["guard"],
        disk_slo_guard=values["disk_slo_guard"],
        slo_guard=values["slo_guard"],
        remote=S.remote_settings(values),
        written=S.written_names(extra, S.VLLM),
    )


# The disk tier's options that KvtierOptions holds under the tree's keys (their defaults stand
# when the disk tier is off).
_DISK_OPTION_KEYS = (
    "disk_policy",
    "disk_admission",
    "disk_io_engine",
    "disk_queue_depth",
    "disk_max_write_backlog",
    "disk_on_reset",
    "disk_max_promotions_in_flight",
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
    """A KvtierDiskTier entry's options: the disk tier's settings and vLLM's locality."""

    disk: S.DiskTierSettings
    locality: str = "LOCAL"
    #: Each option given -> the name the user wrote for it (``disk_tier_names``).
    written: dict[str, str] = field(default_factory=dict, compare=False)


def parse_disk_tier(entry: Mapping[str, Any], *, localities: tuple[str, ...] = LOCALITIES) -> DiskTierOptions:
    """Validate the keys of a KvtierDiskTier entry as the tier receives them (the entry less
    ``VLLM_TIER_KEYS``); every error names its key. What only the open tier can check (a
    capacity that holds no block, a directory it cannot open) is left to it."""
    v, locality, written = _read_tier_entry(entry, S.VLLM_DISK_TIER, DISK_TIER_READER, DISK_TIER_TYPE, localities)
    disk = S.settings_from_values({**_NO_CPU, **v}).disk
    assert disk is not None  # disk_root is required here
    return DiskTierOptions(disk, locality=locality, written=written)


#: The type name of kvtier's shared remote tier in ``secondary_tiers``.
REMOTE_TIER_TYPE = "KvtierRemoteTier"
#: The reader of a KvtierRemoteTier entry.
REMOTE_TIER_READER = OptionReader(f"secondary_tiers[type={REMOTE_TIER_TYPE}]")


@dataclass(frozen=True)
class RemoteTierOptions:
    """A KvtierRemoteTier entry's options: the remote tier's settings and vLLM's locality."""

    remote: S.RemoteTierSettings
    locality: str = "REMOTE"


def parse_remote_tier(entry: Mapping[str, Any], *, localities: tuple[str, ...] = LOCALITIES) -> RemoteTierOptions:
    """Validate the keys of a KvtierRemoteTier entry as the tier receives them (the entry less
    ``VLLM_TIER_KEYS``); every error names its key. Whether the store answers is left to the
    tier (a store that is down at start-up costs misses, not a failed start)."""
    v, locality, _ = _read_tier_entry(entry, S.VLLM_REMOTE_TIER, REMOTE_TIER_READER, REMOTE_TIER_TYPE, localities)
    remote = S.remote_settings(v)
    assert remote is not None  # remote_url is required here
    return RemoteTierOptions(remote, locality=locality)


def _read_tier_entry(
    entry: Mapping[str, Any], point: str, r: OptionReader, type_name: str, localities: tuple[str, ...]
) -> tuple[dict[str, Any], str, dict[str, str]]:
    """A secondary_tiers entry's values by key, its locality and the names the user wrote."""
    names = S.names_for(point)
    unknown = sorted((k for k in entry if k not in names), key=str)
    if unknown:
        theirs = ", ".join(VLLM_TIER_KEYS)
        raise r.error(unknown[0], f"unknown key; {type_name} keys: {', '.join(sorted(names))} (and vLLM's {theirs})")
    if entry.get("locality", "") is None:  # vLLM's own default
        entry = {k: x for k, x in entry.items() if k != "locality"}
    v = S.read_values(entry, point, r)
    locality = v["locality"]
    if locality not in localities:
        raise r.error("locality", f"{show(locality)} is not one of " + ", ".join(localities))
    return v, locality, S.written_names(entry, point)


# A disk tier entry sizes no CPU tier: the typed tree's CPU part is a placeholder here.
_NO_CPU = {"cpu_bytes": 0, "cpu_policy": D.POLICY, "cpu_admission": D.CPU_ADMISSION}
