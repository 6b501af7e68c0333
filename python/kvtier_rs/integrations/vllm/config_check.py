"""A vLLM ``--kv-transfer-config`` checked with kvtier's own parsers, without vLLM.

The specs and the disk tier call the same parsers when the engine builds them, which vLLM does
only once the model is loaded and the KV cache sized; these checks run earlier: in `kvtier
vllm-config`, and in ``KvtierConnector`` at the first call vLLM makes with the configuration.
What only a running engine can know (the KV geometry: whether a capacity holds one chunk, the
per-model directory name under a disk root) is left to the engine.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from kvtier_rs import settings as S
from kvtier_rs._core import InvalidArgumentError
from kvtier_rs.checks import show
from kvtier_rs.integrations.vllm import options as vo
from kvtier_rs.options import OptionReader

MODULE = "kvtier_rs.integrations.vllm"
#: kvtier's specs, and the module paths vLLM can load each from (getattr(import_module(p), name)).
SPECS = {
    "KvtierOffloadingSpec": (MODULE, f"{MODULE}.spec"),
    "KvtierTieringOffloadingSpec": (MODULE, f"{MODULE}.secondary"),
}
#: vLLM's own tiering spec (in vLLM's registry: no spec_module_path), under which kvtier's disk
#: and remote tiers can also run as secondary tiers.
VLLM_TIERING = "TieringOffloadingSpec"
_TIER_MODULES = (MODULE, f"{MODULE}.secondary")
#: kvtier's connector (vLLM's OffloadingConnector plus kvtier's start-up behaviour).
CONNECTOR = "KvtierConnector"
#: The connectors kvtier runs under, and the kv_connector_module_path each is loaded with
#: (None: vLLM's registry).
CONNECTORS: dict[str, tuple[str | None, ...]] = {
    CONNECTOR: (MODULE, f"{MODULE}.connector"),
    "OffloadingConnector": (None,),
}

_TOP = OptionReader("kv_transfer_config")
_EXTRA = vo.READER
_DISK = vo.DISK_TIER_READER
_REMOTE = vo.REMOTE_TIER_READER
#: kvtier's secondary_tiers entry types -> their readers.
_TIER_TYPES = {vo.DISK_TIER_TYPE: _DISK, vo.REMOTE_TIER_TYPE: _REMOTE}

_KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")  # vLLM's KVRole


def check(cfg: Any) -> dict[str, Any]:
    """Validate a parsed --kv-transfer-config; return spec_name, spec_module_path and the
    effective settings, or raise naming the key."""
    if not isinstance(cfg, Mapping):
        raise InvalidArgumentError(
            f"kv_transfer_config: expected a JSON object (the --kv-transfer-config value), got {type(cfg).__name__}"
        )
    connector = cfg.get("kv_connector")
    connector_path = cfg.get("kv_connector_module_path")
    if connector not in CONNECTORS:
        hint = ""
        if connector is None and ("spec_name" in cfg or "cpu_bytes_to_use" in cfg):
            hint = "; kvtier's keys go in kv_connector_extra_config, inside the whole --kv-transfer-config"
        raise _TOP.error(
            "kv_connector",
            f"kvtier runs under {CONNECTOR} or vLLM's OffloadingConnector, got {_show(connector)}{hint}",
        )
    allowed = CONNECTORS[connector]
    if connector_path not in allowed:
        if allowed == (None,):
            why = f"must be unset: {_show(connector_path)} loads another connector than vLLM's own {connector}"
        else:
            why = f"{connector} is loaded from {allowed[0]!r}, got {_show(connector_path)}"
        raise _TOP.error("kv_connector_module_path", why)
    role = cfg.get("kv_role")
    if role not in _KV_ROLES:
        raise _TOP.error("kv_role", f"required with kv_connector: one of {', '.join(_KV_ROLES)}, got {_show(role)}")
    extra = cfg.get("kv_connector_extra_config", {})
    if not isinstance(extra, Mapping):
        raise _TOP.error("kv_connector_extra_config", f"expected an object, got {_show(extra)}")
    out = check_extra(extra)
    if connector != CONNECTOR and extra.get("slo_guard") is not None:
        raise _EXTRA.error(
            "slo_guard",
            f"needs kv_connector {CONNECTOR} (kv_connector_module_path {MODULE!r}), which measures "
            f"requests' TTFT and ITL; under {connector} nothing does, so the rule would never trip",
        )
    return out


def check_extra(extra: Mapping[str, Any]) -> dict[str, Any]:
    """Validate a kv_connector_extra_config that loads kvtier; return spec_name,
    spec_module_path and the effective settings, or raise naming the key."""
    name = extra.get("spec_name")
    path = extra.get("spec_module_path")
    if name == VLLM_TIERING:
        return {"spec_name": name, "spec_module_path": None, "settings": _tiering(extra, vllm_own=True)}
    if name not in SPECS:
        specs = f"{', '.join(SPECS)} (or vLLM's {VLLM_TIERING} with KvtierDiskTier or KvtierRemoteTier secondary tiers)"
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
        "cpu_bytes": o.cpu_bytes,
        "cpu_policy": o.cpu_policy,
        "cpu_admission": o.cpu_admission,
        "slo_guard": None if o.slo_guard is None else asdict(o.slo_guard),
    }
    out.update(_remote(o.remote))
    if o.disk_root is None:
        out["disk_root"] = None
        return out
    _existing_directory(_EXTRA, "disk_root", o.disk_root)
    cost = o.cost_model
    out.update(
        {
            "disk_root": o.disk_root,
            "disk_bytes": o.disk_bytes,
            "disk_policy": o.disk_policy,
            "disk_admission": o.disk_admission,
            "disk_io_engine": o.disk_io_engine,
            "disk_queue_depth": o.disk_queue_depth,
            "disk_max_write_backlog": o.disk_max_write_backlog,
            "disk_on_reset": o.disk_on_reset,
            "cost_model": "always_load" if cost.prefill_tokens_per_s is None else asdict(cost),
            "guard": o.guard,
            "disk_slo_guard": None if o.disk_slo_guard is None else asdict(o.disk_slo_guard),
            "disk_max_promotions_in_flight": o.disk_max_promotions_in_flight,
        }
    )
    return out


def _remote(r: S.RemoteTierSettings | None) -> dict[str, Any]:
    """The remote tier's settings, with what can be checked without the store: the password
    and secret files readable (their contents are never shown). Whether the cluster answers is
    the engine's to find out: a store that is down costs misses, not a failed start."""
    if r is None:
        return {"remote_url": None}
    from kvtier_rs.tiers.remote.build import read_secret
    from kvtier_rs.tiers.remote.client import read_password

    read_password(r.password_env, r.password_file)
    if r.secret_file:
        read_secret(r.secret_file)
    return {
        "remote_url": r.url,
        "remote_prefix": r.prefix,
        "remote_values": "MAC-keyed (remote_secret_file)" if r.secret_file else "checksummed, no secret",
        "remote_admission": r.admission,
        "remote_deadline_s": r.deadline_s,
        "remote_ttl_s": r.ttl_s,
    }


def _tiering(extra: Mapping[str, Any], *, vllm_own: bool) -> dict[str, Any]:
    # Keys only KvtierOffloadingSpec reads: the tiering spec would ignore them without a word.
    mine = sorted((k for k in extra if k in vo.KVTIER_KEYS), key=str)
    if mine:
        raise _EXTRA.error(
            mine[0],
            "read only by KvtierOffloadingSpec; under the tiering spec kvtier's disk and remote tiers "
            f"are secondary_tiers entries of type {vo.DISK_TIER_TYPE} and {vo.REMOTE_TIER_TYPE}",
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
        kind = entry["type"]
        if kind not in _TIER_TYPES:
            out_tiers.append({"type": kind, "checked": False})
            continue
        if entry.get("module_path") not in _TIER_MODULES:
            raise _TIER_TYPES[kind].error(
                "module_path",
                f"vLLM loads {kind} from module_path {MODULE!r}, got {_show(entry.get('module_path'))}",
            )
        if kind == vo.REMOTE_TIER_TYPE:
            r = vo.parse_remote_tier({k: v for k, v in entry.items() if k not in vo.VLLM_TIER_KEYS})
            out_tiers.append({"type": kind, "checked": True, **_remote(r.remote), "locality": r.locality})
            continue
        t = vo.parse_disk_tier({k: v for k, v in entry.items() if k not in vo.VLLM_TIER_KEYS})
        root_name = t.written.get("disk_root", "disk_root")
        _existing_directory(_DISK, root_name, t.disk.root)
        # Two tiers on one root would derive the same per-model directory, which one tier locks.
        real = os.path.realpath(t.disk.root)
        if real in roots:
            raise _DISK.error(
                root_name, f"{t.disk.root!r}: also the {root_name} of secondary_tiers entry {roots[real]}"
            )
        roots[real] = i
        shown = {f"disk_{k}": v for k, v in asdict(t.disk).items()} | {"locality": t.locality}
        out_tiers.append({"type": vo.DISK_TIER_TYPE, "checked": True, **shown})
    if vllm_own and not any(t["checked"] for t in out_tiers):
        raise _EXTRA.error(
            "secondary_tiers",
            f"no {vo.DISK_TIER_TYPE} or {vo.REMOTE_TIER_TYPE} entry: with vLLM's {VLLM_TIERING} and none, "
            "kvtier is not used",
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
