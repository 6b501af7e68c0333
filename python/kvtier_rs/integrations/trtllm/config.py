"""kvtier's options for the TensorRT-LLM connector: parsing and validation.

TensorRT-LLM's ``KvCacheConnectorConfig`` carries only a module and two class names, no free-form
dict, so kvtier's options reach the connector one of two ways (first found wins):

1. a class attribute ``kvtier_config = {...}`` on a subclass of ``KvtierScheduler`` /
   ``KvtierWorker`` in the user's own module (that module is then the ``connector_module``);
2. the environment variable ``KVTIER_TRTLLM_CONFIG``: a JSON object, or the path of a JSON file.

Pure Python (no TensorRT-LLM import), so a bad value is reported with its key before the engine
allocates anything. Every error is an ``InvalidArgumentError`` (a ``KvTierError``) whose message
starts with ``kvtier trtllm config[<key>]``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier_rs import defaults as D
from kvtier_rs._core import InvalidArgumentError
from kvtier_rs.checks import show
from kvtier_rs.integrations.trtllm.identity import SCHEMES
from kvtier_rs.options import OptionReader, guard_rule
from kvtier_rs.orchestrator.gate import DEFAULT_MAX_IN_FLIGHT
from kvtier_rs.orchestrator.guard import GuardRule

ENV_VAR = "KVTIER_TRTLLM_CONFIG"

#: Every key, with the one-line description used in error messages and docs.
KEYS: dict[str, str] = {
    "cpu_bytes": 'CPU tier capacity (required), bytes or a size string such as "8GiB"',
    "cpu_policy": 'CPU tier eviction policy (default "priority": TensorRT-LLM retention semantics)',
    "cpu_admission": 'CPU tier admission: "always" (default) or "uses:K"',
    "min_offload_priority": "blocks whose retention priority is below this (0..100) are never "
    "offloaded, nor any later block of the same request (default 30, TensorRT-LLM's "
    "secondary_offload_min_priority default)",
    "disk_root": "directory of the disk tier; setting it enables the disk tier",
    "disk_bytes": "disk tier capacity (required with disk_root)",
    "disk_policy": 'disk tier eviction policy (default "priority")',
    "disk_admission": 'disk tier admission: "always" (default), "uses:K" or "priority:T"',
    "disk_io_engine": 'disk I/O engine: "auto" (default), "io_uring" or "pool"',
    "disk_queue_depth": f"disk I/O requests in flight (default {D.DISK_QUEUE_DEPTH})",
    "io_engine": 'device<->host copies: "auto" (default: CUDA for CUDA tensors), "cpu" or "cuda"',
    "cost_model": "null (default: always load a hit) or a dict with prefill_tokens_per_s: load a "
    "hit only when moving it beats recomputing it",
    "namespace": "string mixed into every block key, e.g. the model name (default: llm_args.model)",
    "load_timeout_s": "seconds wait_for_layer_load waits for a load before failing (default 60)",
    "block_identity": "\"auto\" (default: the engine's own block hash when TensorRT-LLM's hasher imports, "
    'else kvtier\'s chain), "engine" or "kvtier"',
    "cpu_slo_guard": "null (default: off) or a dict with p99_ms and optionally window_s (default 10), "
    "recover_s (default 30) and min_samples (default 20): when the p99 wait on the CPU tier's loads over "
    "window_s exceeds p99_ms, the tier is bypassed (its hits recomputed) for recover_s, then re-probed",
    "disk_slo_guard": "the same rule for the disk tier's promotions (needs disk_root)",
    "cpu_max_promotions_in_flight": "loads from the CPU tier in flight at most; a hit beyond them is "
    f"recomputed (default {DEFAULT_MAX_IN_FLIGHT['cpu']})",
    "disk_max_promotions_in_flight": "loads with a disk part in flight at most; a disk hit beyond them is "
    f"recomputed (default {DEFAULT_MAX_IN_FLIGHT['disk']}; needs disk_root)",
}

_IO_ENGINES = ("auto", "cpu", "cuda")


#: The reader of this config; ``naming`` maps the tiers' own arguments to its keys.
READER = OptionReader("kvtier trtllm config")
_opts = READER
_err = _opts.error
#: The CPU tier's (TierConfig, HostPool) and the disk tier's constructor arguments -> the keys
#: they come from (for READER.naming).
CPU_TIER_KEYS = {
    "capacity_bytes": "cpu_bytes",
    "total_bytes": "cpu_bytes",
    "policy": "cpu_policy",
    "admission": "cpu_admission",
}
DISK_TIER_KEYS = {
    "capacity_bytes": "disk_bytes",
    "policy": "disk_policy",
    "admission": "disk_admission",
    "engine": "disk_io_engine",
    "queue_depth": "disk_queue_depth",
}


def _admission(key: str, value: Any, *, allow_priority: bool) -> str:
    rule = _opts.admission(key, value)
    if rule.startswith("priority:") and not allow_priority:
        # Disk promotions enter the CPU tier at the default priority, so a CPU-side priority
        # rule above 35 would refuse every promotion; the connector filters instead.
        raise _err(
            key,
            "use min_offload_priority for the CPU tier (a priority admission rule there "
            "would also refuse blocks promoted back from disk)",
        )
    return rule


@dataclass(frozen=True)
class ConnectorOptions:
    cpu_bytes: int
    cpu_policy: str = "priority"
    cpu_admission: str = D.CPU_ADMISSION
    min_offload_priority: int = 30
    disk_root: str | None = None
    disk_bytes: int | None = None
    disk_policy: str = "priority"
    disk_admission: str = D.DISK_ADMISSION
    disk_io_engine: str = D.DISK_IO_ENGINE
    disk_queue_depth: int = D.DISK_QUEUE_DEPTH
    io_engine: str = "auto"
    prefill_tokens_per_s: float | None = None
    namespace: str | None = None
    load_timeout_s: float = 60.0
    block_identity: str = "auto"
    guards: dict[str, GuardRule] = field(default_factory=dict)
    max_promotions_in_flight: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_MAX_IN_FLIGHT))


def parse_options(raw: Mapping[str, Any]) -> ConnectorOptions:
    """Validate a config dict; every error names its key."""
    if not isinstance(raw, Mapping):
        raise InvalidArgumentError(f"kvtier trtllm config: expected a dict, got {type(raw).__name__}")
    unknown = sorted((k for k in raw if k not in KEYS), key=str)
    if unknown:
        raise _err(unknown[0], "unknown key; known keys: " + ", ".join(sorted(KEYS)))
    if raw.get("cpu_bytes") in (None, "", 0):
        raise _err("cpu_bytes", "required: capacity of the CPU tier, e.g. 8589934592 or '8GiB'")
    kw: dict[str, Any] = {"cpu_bytes": _opts.size("cpu_bytes", raw["cpu_bytes"])}
    kw["cpu_policy"] = _opts.policy("cpu_policy", raw.get("cpu_policy", "priority"))
    kw["cpu_admission"] = _admission("cpu_admission", raw.get("cpu_admission", D.CPU_ADMISSION), allow_priority=False)
    kw["min_offload_priority"] = _opts.int_in("min_offload_priority", raw.get("min_offload_priority", 30), 0, 100)
    disk_keys = [k for k in KEYS if k.startswith("disk_") and k != "disk_root" and k in raw]
    root = raw.get("disk_root")
    if root is None:
        if disk_keys:
            raise _err(disk_keys[0], "needs disk_root (the disk tier is off without it)")
    else:
        kw["disk_root"] = _opts.directory("disk_root", root)
        if "disk_bytes" not in raw:
            raise _err("disk_bytes", "required with disk_root: capacity of the disk tier")
        kw["disk_bytes"] = _opts.size("disk_bytes", raw["disk_bytes"])
        kw["disk_policy"] = _opts.policy("disk_policy", raw.get("disk_policy", "priority"))
        kw["disk_admission"] = _admission(
            "disk_admission", raw.get("disk_admission", D.DISK_ADMISSION), allow_priority=True
        )
        kw["disk_io_engine"] = _opts.disk_io_engine("disk_io_engine", raw.get("disk_io_engine", D.DISK_IO_ENGINE))
        kw["disk_queue_depth"] = _opts.queue_depth("disk_queue_depth", raw.get("disk_queue_depth", D.DISK_QUEUE_DEPTH))
    kw["io_engine"] = _opts.choice("io_engine", raw.get("io_engine", "auto"), _IO_ENGINES)
    cm = raw.get("cost_model")
    if cm is not None:
        if not isinstance(cm, Mapping) or set(cm) != {"prefill_tokens_per_s"}:
            raise _err("cost_model", f"expected null or {{'prefill_tokens_per_s': <number>}}, got {show(cm)}")
        kw["prefill_tokens_per_s"] = _opts.positive(
            "cost_model", cm["prefill_tokens_per_s"], field="prefill_tokens_per_s"
        )
    ns = raw.get("namespace")
    if ns is not None and not isinstance(ns, str):
        raise _err("namespace", f"expected a string, got {show(ns)}")
    kw["namespace"] = ns
    kw["load_timeout_s"] = _opts.positive("load_timeout_s", raw.get("load_timeout_s", 60.0), unit="of seconds")
    kw["block_identity"] = _opts.choice("block_identity", raw.get("block_identity", "auto"), SCHEMES)
    tiers = ("cpu", "disk") if root is not None else ("cpu",)
    guards = {t: guard_rule(_opts, f"{t}_slo_guard", raw.get(f"{t}_slo_guard")) for t in tiers}
    kw["guards"] = {t: g for t, g in guards.items() if g is not None}
    kw["max_promotions_in_flight"] = {
        t: _opts.int_in(f"{t}_max_promotions_in_flight", raw.get(f"{t}_max_promotions_in_flight", n), 1, 1 << 20)
        for t, n in DEFAULT_MAX_IN_FLIGHT.items()
        if t in tiers
    }
    return ConnectorOptions(**kw)


def load_options(class_config: Mapping[str, Any] | None) -> ConnectorOptions:
    """The connector's options: the class attribute if set, else the environment variable."""
    if class_config is not None:
        return parse_options(class_config)
    text = os.environ.get(ENV_VAR)
    if not text:
        raise InvalidArgumentError(
            f"kvtier trtllm config: none given. Set {ENV_VAR} to a JSON object (or a JSON file's path), "
            'e.g. {"cpu_bytes": "8GiB"}, or subclass KvtierScheduler/KvtierWorker with kvtier_config = {...}'
        )
    if not text.lstrip().startswith("{"):
        path = Path(text)
        if not path.is_file():
            raise InvalidArgumentError(f"{ENV_VAR}: {text!r} is neither a JSON object nor an existing file")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise InvalidArgumentError(f"{ENV_VAR}: {text!r} is not UTF-8 text (JSON is UTF-8): {e}") from None
        except OSError as e:
            raise InvalidArgumentError(f"{ENV_VAR}: cannot read {text!r}: {e}") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidArgumentError(f"{ENV_VAR}: not valid JSON: {e}") from None
    except (ValueError, RecursionError) as e:  # an integer of over 4300 digits, nesting too deep
        raise InvalidArgumentError(f"{ENV_VAR}: not usable JSON: {e}") from None
    return parse_options(raw)
