"""`kvtier vllm-config '<json>'` (or `--file F`): check a vLLM ``--kv-transfer-config`` for
kvtier before starting an engine.

vLLM reads kv_connector_extra_config only once the model is loaded and the KV cache sized, so a
bad value costs a minute or more per try; this check runs kvtier's own parsers on the config
(the same functions the specs and the disk tier call), imports no vLLM and starts nothing. It
prints "ok" and the effective settings, or one error line naming the key (exit status 2).

What only a running engine can know (the KV geometry: whether a capacity holds one chunk, the
per-model directory name under a disk root) is left to the engine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvtier_rs.checks import show
from kvtier_rs.integrations.vllm import options as vo
from kvtier_rs.options import OptionReader
from kvtier_rs.planner.errors import PlanError

MODULE = "kvtier_rs.integrations.vllm"
#: kvtier's specs, and the module paths vLLM can load each from (getattr(import_module(p), name)).
SPECS = {
    "KvtierOffloadingSpec": (MODULE, f"{MODULE}.spec"),
    "KvtierTieringOffloadingSpec": (MODULE, f"{MODULE}.secondary"),
}
#: vLLM's own tiering spec (in vLLM's registry: no spec_module_path), under which kvtier's disk
#: tier can also run as a secondary tier.
VLLM_TIERING = "TieringOffloadingSpec"
_TIER_MODULES = (MODULE, f"{MODULE}.secondary")

_TOP = OptionReader("kv_transfer_config")
_EXTRA = vo.READER
_DISK = vo.DISK_TIER_READER

_KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")  # vLLM's KVRole


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "vllm-config",
        help="check a vLLM --kv-transfer-config for kvtier (no engine is started)",
        description="Check a vLLM --kv-transfer-config JSON that loads kvtier (KvtierOffloadingSpec, or "
        "KvtierDiskTier secondary tiers under the tiering spec) with kvtier's own parsers, and print the "
        "effective settings, or one error line naming the key. Starts no engine.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("config", nargs="?", metavar="JSON", help="the --kv-transfer-config value")
    src.add_argument("--file", metavar="F", help="read the JSON from file F (- for stdin)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=run_vllm_config)


def run_vllm_config(args: argparse.Namespace) -> int:
    text = _read(args)
    report = check(load(text))
    if args.json:
        print(json.dumps({"ok": True, **report}, sort_keys=True))
        return 0
    module = f" ({report['spec_module_path']})" if report["spec_module_path"] else ""
    print(f"ok: {report['spec_name']}{module}")
    _print_settings(report["settings"], "  ")
    return 0


def _read(args: argparse.Namespace) -> str:
    if args.file is None:
        return str(args.config)
    if args.file == "-":
        return sys.stdin.read()
    try:
        return Path(args.file).read_text()
    except OSError as e:
        raise PlanError(f"--file {args.file}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError:
        raise PlanError(f"--file {args.file}: not UTF-8 text") from None


# vLLM's --kv-transfer-config turns bare (unquoted) numbers with a k/m/g/t suffix (decimal) or
# K/M/G/T (binary) into integers before parsing the JSON (engine/arg_utils.py,
# _expand_json_human_readable_numbers): `{"cpu_bytes_to_use": 32G}` is valid there, so here too.
_QUOTED = re.compile(r'("(?:[^"\\]|\\.)*")')
_BARE = re.compile(r"\b(\d+(?:\.\d+)?)([kKmMgGtT])\b")
_MULT = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _expand_bare(m: re.Match[str]) -> str:
    number, suffix = m.groups()
    if suffix.isupper():
        if "." in number:
            raise PlanError(
                f"{m.group()}: vLLM allows no decimals with a binary suffix; did you mean {number}{suffix.lower()}?"
            )
        return str(int(number) * _MULT[suffix])
    return str(int(float(number) * _MULT[suffix]))


def load(text: str) -> Any:
    parts = _QUOTED.split(text)
    parts[::2] = [_BARE.sub(_expand_bare, part) for part in parts[::2]]
    try:
        return json.loads("".join(parts))
    except json.JSONDecodeError as e:
        raise PlanError(f"not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None


def check(cfg: Any) -> dict[str, Any]:
    """Validate a parsed --kv-transfer-config; return spec_name, spec_module_path and the
    effective settings, or raise naming the key."""
    if not isinstance(cfg, Mapping):
        raise PlanError(f"expected a JSON object (the --kv-transfer-config value), got {type(cfg).__name__}")
    connector = cfg.get("kv_connector")
    if connector != "OffloadingConnector":
        hint = ""
        if connector is None and ("spec_name" in cfg or "cpu_bytes_to_use" in cfg):
            hint = "; kvtier's keys go in kv_connector_extra_config, inside the whole --kv-transfer-config"
        raise _TOP.error("kv_connector", f"kvtier runs under vLLM's OffloadingConnector, got {_show(connector)}{hint}")
    if cfg.get("kv_connector_module_path") is not None:
        raise _TOP.error(
            "kv_connector_module_path",
            "must be unset: it loads another connector than vLLM's own OffloadingConnector",
        )
    role = cfg.get("kv_role")
    if role not in _KV_ROLES:
        raise _TOP.error("kv_role", f"required with kv_connector: one of {', '.join(_KV_ROLES)}, got {_show(role)}")
    extra = cfg.get("kv_connector_extra_config", {})
    if not isinstance(extra, Mapping):
        raise _TOP.error("kv_connector_extra_config", f"expected an object, got {_show(extra)}")

    name = extra.get("spec_name")
    path = extra.get("spec_module_path")
    if name == VLLM_TIERING:
        return {"spec_name": name, "spec_module_path": None, "settings": _tiering(extra, vllm_own=True)}
    if name not in SPECS:
        specs = f"{', '.join(SPECS)} (or vLLM's {VLLM_TIERING} with KvtierDiskTier secondary tiers)"
        if name is None:
            why = f"required: one of kvtier's specs, {specs}; unset, vLLM runs its CPUOffloadingSpec"
            raise _EXTRA.error("spec_name", why)
        raise _EXTRA.error("spec_name", f"{_show(name)} is not one of kvtier's specs: {specs}")
    if path not in SPECS[name]:
        raise _EXTRA.error("spec_module_path", f"{name} is loaded from {SPECS[name][0]!r}, got {_show(path)}")
    if name == "KvtierOffloadingSpec":
        settings = _offloading(extra)
    else:
        settings = _tiering(extra, vllm_own=False)
    return {"spec_name": name, "spec_module_path": path, "settings": settings}


def _offloading(extra: Mapping[str, Any]) -> dict[str, Any]:
    o = vo.parse_options(extra)
    # KvtierOffloadingSpec refuses it at start-up (after the model loads): said here first.
    if extra.get("canonical_layout") is True:
        raise _EXTRA.error("canonical_layout", "not supported by kvtier yet; kvtier stores each worker's direct pages")
    out: dict[str, Any] = {
        "cpu_bytes_to_use": o.cpu_bytes,
        "eviction_policy": o.cpu_policy,
        "cpu_admission": o.cpu_admission,
    }
    if o.disk_root is None:
        out["disk_root"] = None
        return out
    _existing_directory(_EXTRA, "disk_root", o.disk_root)
    cost = o.cost_model
    out.update(
        {
            "disk_root": o.disk_root,
            "disk_bytes_to_use": o.disk_bytes,
            "disk_policy": o.disk_policy,
            "disk_admission": o.disk_admission,
            "disk_io_engine": o.disk_io_engine,
            "disk_queue_depth": o.disk_queue_depth,
            "disk_on_reset": o.disk_on_reset,
            "cost_model": "always_load" if cost.prefill_tokens_per_s is None else asdict(cost),
            "guard": o.guard,
        }
    )
    return out


def _tiering(extra: Mapping[str, Any], *, vllm_own: bool) -> dict[str, Any]:
    # Keys only KvtierOffloadingSpec reads: the tiering spec would ignore them without a word.
    mine = sorted((k for k in extra if k in vo.KVTIER_KEYS), key=str)
    if mine:
        raise _EXTRA.error(
            mine[0],
            "read only by KvtierOffloadingSpec; under the tiering spec kvtier's disk tier is a "
            f"secondary_tiers entry of type {vo.DISK_TIER_TYPE}",
        )
    vo.check_vllm_bools(extra)
    if vllm_own:
        # vLLM's own spec takes int(cpu_bytes_to_use): bytes only.
        raw = extra.get("cpu_bytes_to_use")
        if isinstance(raw, str) and not raw.strip().isdigit():
            raise _EXTRA.error(
                "cpu_bytes_to_use",
                f"vLLM's {VLLM_TIERING} takes a number of bytes, got {_show(raw)}; for a size string use "
                f"spec_name 'KvtierTieringOffloadingSpec' with spec_module_path {MODULE!r}",
            )
        if isinstance(raw, str):
            raw = int(raw)
        cpu_bytes = vo.cpu_bytes_to_use({"cpu_bytes_to_use": raw})
    else:
        cpu_bytes = vo.cpu_bytes_to_use(extra)
    st = extra.get("store_threshold", 0)
    if isinstance(st, bool) or not isinstance(st, int):
        raise _EXTRA.error("store_threshold", f"expected an int, got {_show(st)}")
    if st >= 2:
        raise _EXTRA.error("store_threshold", "not supported by vLLM's tiering spec (it refuses a value of 2 or more)")
    tiers = extra.get("secondary_tiers", [])
    if not isinstance(tiers, list):
        raise _EXTRA.error("secondary_tiers", f"expected a list of tier configurations, got {_show(tiers)}")
    out_tiers: list[dict[str, Any]] = []
    roots: dict[str, int] = {}
    for i, entry in enumerate(tiers):
        if not isinstance(entry, Mapping) or not entry.get("type"):
            raise _EXTRA.error("secondary_tiers", f"entry {i}: expected an object with a 'type', got {_show(entry)}")
        if entry["type"] != vo.DISK_TIER_TYPE:
            out_tiers.append({"type": entry["type"], "checked": False})
            continue
        if entry.get("module_path") not in _TIER_MODULES:
            raise _DISK.error(
                "module_path",
                f"vLLM loads {vo.DISK_TIER_TYPE} from module_path {MODULE!r}, got {_show(entry.get('module_path'))}",
            )
        t = vo.parse_disk_tier({k: v for k, v in entry.items() if k not in vo.VLLM_TIER_KEYS})
        _existing_directory(_DISK, "root_dir", t.root_dir)
        # Two tiers on one root would derive the same per-model directory, which one tier locks.
        real = os.path.realpath(t.root_dir)
        if real in roots:
            raise _DISK.error("root_dir", f"{t.root_dir!r}: also the root_dir of secondary_tiers entry {roots[real]}")
        roots[real] = i
        out_tiers.append({"type": vo.DISK_TIER_TYPE, "checked": True, **asdict(t)})
    if vllm_own and not roots:
        raise _EXTRA.error(
            "secondary_tiers",
            f"no {vo.DISK_TIER_TYPE} entry: with vLLM's {VLLM_TIERING} and none, kvtier is not used",
        )
    return {
        "cpu_bytes_to_use": cpu_bytes,
        "eviction_policy": extra.get("eviction_policy", "lru"),
        "secondary_tiers": out_tiers,
    }


def _existing_directory(reader: OptionReader, key: str, path: str) -> None:
    """A path that exists must be a directory (the tier creates a missing one)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise reader.error(key, f"{path!r} exists and is not a directory")


def _show(value: Any) -> str:
    return "nothing" if value is None else show(value)


def _size(n: int) -> str:
    for unit, mult in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= mult:
            return f"{n} ({n / mult:.4g} {unit})"
    return str(n)


_SIZE_KEYS = ("cpu_bytes_to_use", "disk_bytes_to_use", "capacity_bytes")


def _print_settings(settings: Mapping[str, Any], indent: str) -> None:
    for key, value in settings.items():
        if key == "secondary_tiers":
            if not value:
                print(f"{indent}secondary_tiers: none")
            for i, tier in enumerate(value):
                if not tier["checked"]:
                    print(f"{indent}secondary_tiers[{i}]: {tier['type']} (not kvtier's: not checked here)")
                    continue
                print(f"{indent}secondary_tiers[{i}]: {tier['type']}")
                _print_settings({k: v for k, v in tier.items() if k not in ("type", "checked")}, indent + "  ")
            continue
        if key in ("disk_root", "root_dir"):
            shown = "none (disk tier off)" if value is None else f"{value} (a directory per model is made under it)"
        elif key in _SIZE_KEYS and isinstance(value, int):
            shown = _size(value)
        elif isinstance(value, Mapping):
            shown = ", ".join(f"{k}={v}" for k, v in value.items())
        else:
            shown = str(value)
        print(f"{indent}{key + ':':<19} {shown}")
