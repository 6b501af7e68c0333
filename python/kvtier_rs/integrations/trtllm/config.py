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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier_rs._core import InvalidArgumentError
from kvtier_rs.integrations.trtllm.identity import SCHEMES
from kvtier_rs.options import OptionReader

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
    "disk_queue_depth": "disk I/O requests in flight (default 16)",
    "io_engine": 'device<->host copies: "auto" (default: CUDA for CUDA tensors), "cpu" or "cuda"',
    "cost_model": "null (default: always load a hit) or a dict with prefill_tokens_per_s: load a "
    "hit only when moving it beats recomputing it",
    "namespace": "string mixed into every block key, e.g. the model name (default: llm_args.model)",
    "load_timeout_s": "seconds wait_for_layer_load waits for a load before failing (default 60)",
    "block_identity": "\"auto\" (default: the engine's own block hash when TensorRT-LLM's hasher imports, "
    'else kvtier\'s chain), "engine" or "kvtier"',
}

_IO_ENGINES = ("auto", "cpu", "cuda")
_DISK_ENGINES = ("auto", "io_uring", "pool")


_opts = OptionReader("kvtier trtllm config")
_err = _opts.error


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
    cpu_admission: str = "always"
    min_offload_priority: int = 30
    disk_root: str | None = None
    disk_bytes: int | None = None
    disk_policy: str = "priority"
    disk_admission: str = "always"
    disk_io_engine: str = "auto"
    disk_queue_depth: int = 16
    io_engine: str = "auto"
    prefill_tokens_per_s: float | None = None
    namespace: str | None = None
    load_timeout_s: float = 60.0
    block_identity: str = "auto"


def parse_options(raw: Mapping[str, Any]) -> ConnectorOptions:
    """Validate a config dict; every error names its key."""
    if not isinstance(raw, Mapping):
        raise InvalidArgumentError(f"kvtier trtllm config: expected a dict, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise _err(unknown[0], "unknown key; known keys: " + ", ".join(sorted(KEYS)))
    if raw.get("cpu_bytes") in (None, "", 0):
        raise _err("cpu_bytes", "required: capacity of the CPU tier, e.g. 8589934592 or '8GiB'")
    kw: dict[str, Any] = {"cpu_bytes": _opts.size("cpu_bytes", raw["cpu_bytes"])}
    kw["cpu_policy"] = _opts.policy("cpu_policy", raw.get("cpu_policy", "priority"))
    kw["cpu_admission"] = _admission("cpu_admission", raw.get("cpu_admission", "always"), allow_priority=False)
    kw["min_offload_priority"] = _opts.int_in("min_offload_priority", raw.get("min_offload_priority", 30), 0, 100)
    disk_keys = [k for k in KEYS if k.startswith("disk_") and k != "disk_root" and k in raw]
    root = raw.get("disk_root")
    if root is None:
        if disk_keys:
            raise _err(disk_keys[0], "needs disk_root (the disk tier is off without it)")
    else:
        if not isinstance(root, str | os.PathLike) or not str(root):
            raise _err("disk_root", f"expected a directory path, got {root!r}")
        if "disk_bytes" not in raw:
            raise _err("disk_bytes", "required with disk_root: capacity of the disk tier")
        kw["disk_root"] = str(root)
        kw["disk_bytes"] = _opts.size("disk_bytes", raw["disk_bytes"])
        kw["disk_policy"] = _opts.policy("disk_policy", raw.get("disk_policy", "priority"))
        kw["disk_admission"] = _admission("disk_admission", raw.get("disk_admission", "always"), allow_priority=True)
        eng = raw.get("disk_io_engine", "auto")
        if eng not in _DISK_ENGINES:
            raise _err("disk_io_engine", f"{eng!r} is not one of " + ", ".join(_DISK_ENGINES))
        kw["disk_io_engine"] = eng
        kw["disk_queue_depth"] = _opts.int_in("disk_queue_depth", raw.get("disk_queue_depth", 16), 1, 1024)
    io = raw.get("io_engine", "auto")
    if io not in _IO_ENGINES:
        raise _err("io_engine", f"{io!r} is not one of " + ", ".join(_IO_ENGINES))
    kw["io_engine"] = io
    cm = raw.get("cost_model")
    if cm is not None:
        if not isinstance(cm, Mapping) or set(cm) != {"prefill_tokens_per_s"}:
            raise _err("cost_model", f"expected null or {{'prefill_tokens_per_s': <number>}}, got {cm!r}")
        rate = cm["prefill_tokens_per_s"]
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not rate > 0:
            raise _err("cost_model", f"prefill_tokens_per_s must be a positive number, got {rate!r}")
        kw["prefill_tokens_per_s"] = float(rate)
    ns = raw.get("namespace")
    if ns is not None and not isinstance(ns, str):
        raise _err("namespace", f"expected a string, got {ns!r}")
    kw["namespace"] = ns
    t = raw.get("load_timeout_s", 60.0)
    if isinstance(t, bool) or not isinstance(t, int | float) or not t > 0:
        raise _err("load_timeout_s", f"expected a positive number of seconds, got {t!r}")
    kw["load_timeout_s"] = float(t)
    ident = raw.get("block_identity", "auto")
    if ident not in SCHEMES:
        raise _err("block_identity", f"{ident!r} is not one of " + ", ".join(SCHEMES))
    kw["block_identity"] = ident
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
        text = path.read_text()
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidArgumentError(f"{ENV_VAR}: not valid JSON: {e}") from None
    return parse_options(raw)
