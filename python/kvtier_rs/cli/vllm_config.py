"""`kvtier vllm-config '<json>'` (or `--file F`): check a vLLM ``--kv-transfer-config`` for
kvtier before starting an engine.

vLLM reads kv_connector_extra_config only once the model is loaded and the KV cache sized, so a
bad value costs a minute or more per try; this check runs kvtier's own parsers on the config
(``integrations.vllm.config_check``), imports no vLLM and starts nothing. It prints "ok" and the
effective settings, or one error line naming the key (exit status 2).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvtier_rs.planner.errors import PlanError


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
    # Imported here, not at the top: it pulls in numpy, which every other command would pay
    # for at start-up just to build the parser.
    from kvtier_rs.integrations.vllm.config_check import check

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


def _size(n: int) -> str:
    for unit, mult in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= mult:
            return f"{n} ({n / mult:.4g} {unit})"
    return str(n)


_SIZE_KEYS = ("cpu_bytes", "cpu_bytes_to_use", "disk_bytes")


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
        if key == "disk_root":
            shown = "none (disk tier off)" if value is None else f"{value} (a directory per model is made under it)"
        elif key == "remote_url" and value is None:
            shown = "none (remote tier off)"
        elif key in _SIZE_KEYS and isinstance(value, int):
            shown = _size(value)
        elif isinstance(value, Mapping):
            shown = ", ".join(f"{k}={v}" for k, v in value.items())
        elif value is None:
            shown = "off"
        else:
            shown = str(value)
        print(f"{indent}{key + ':':<19} {shown}")
