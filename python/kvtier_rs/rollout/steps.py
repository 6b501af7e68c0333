"""The steps of a rollout: the GPU-only baseline, then one tier more per step (+CPU, +disk),
each either an endpoint the user started with that configuration or a configuration that the
launcher starts. From the command line's options or from a config file (JSON, or TOML by its
.toml suffix) listing the steps.

A config file::

    {"launch": {"model": "/models/llama", "args": ["--max-model-len", "8192"]},
     "steps": [
       {"name": "baseline"},
       {"name": "cpu", "cpu": "64GiB"},
       {"name": "disk", "cpu": "64GiB", "disk": "1TiB", "disk_root": "/nvme/kvtier",
        "extra": {"disk_admission": "uses:2"}, "env": {"VAR": "value"}}]}

A step with "endpoint" targets that running server instead (then "launch" is not needed); a
step with "kv_transfer_config" is launched with exactly that JSON.
"""

from __future__ import annotations

import json
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier_rs import settings
from kvtier_rs._core import InvalidArgumentError
from kvtier_rs.config import parse_bytes
from kvtier_rs.rollout.errors import RolloutError

MODULE = "kvtier_rs.integrations.vllm"
_STEP_KEYS = {"name", "endpoint", "cpu", "disk", "disk_root", "extra", "env", "kv_transfer_config"}
_LAUNCH_KEYS = {"model", "args", "served_model_name"}


@dataclass
class Step:
    name: str
    endpoint: str | None = None  # None: launched
    kv_transfer_config: dict[str, Any] | None = None  # launched steps; None: GPU only
    env: dict[str, str] = field(default_factory=dict)
    cpu_bytes: int | None = None
    disk_bytes: int | None = None

    @property
    def tiers(self) -> tuple[str, ...]:
        """The tiers this step runs, as far as its configuration tells."""
        extra = (self.kv_transfer_config or {}).get("kv_connector_extra_config") or {}
        out = ["gpu"]
        if self.cpu_bytes or _given(extra, "cpu_bytes"):
            out.append("cpu")
        if self.disk_bytes or _given(extra, "disk_bytes"):
            out.append("disk")
        return tuple(out)


@dataclass
class Launch:
    model: str
    served_model_name: str = "model"
    args: list[str] = field(default_factory=list)


def _given(extra: dict[str, Any], key: str) -> bool:
    """Whether vLLM's extra config sets the tree's option `key`, under its name or an alias."""
    return any(extra.get(name) for name in settings.BY_KEY[key].names_for(settings.VLLM))


def _size(value: Any, where: str) -> int:
    try:
        return parse_bytes(value, name=where)
    except InvalidArgumentError as e:
        raise RolloutError(f"{where}: {e.reason}") from None


def kvtier_config(cpu: int, disk: int | None, disk_root: str | None, extra: dict[str, Any]) -> dict[str, Any]:
    """The --kv-transfer-config of a step: kvtier's connector and spec, the CPU tier, the disk
    tier when sized, and any other kvtier keys (`extra`)."""
    cfg: dict[str, Any] = {"spec_name": "KvtierOffloadingSpec", "spec_module_path": MODULE, "cpu_bytes": cpu}
    if disk is not None:
        cfg.update(disk_root=disk_root, disk_bytes=disk)
    # An option `extra` gives under another of its names (cpu_bytes_to_use) replaces ours.
    for key in [k for k in cfg if k in settings.BY_KEY and _given(extra, k)]:
        del cfg[key]
    cfg.update(extra)
    return {
        "kv_connector": "KvtierConnector",
        "kv_connector_module_path": MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": cfg,
    }


def check_transfer_config(cfg: dict[str, Any], where: str) -> None:
    """kvtier's own parsers over a step's config (as `kvtier vllm-config` runs them), so a bad
    key is refused before any server starts, naming the step."""
    from kvtier_rs.integrations.vllm.config_check import check

    try:
        check(cfg)
    except InvalidArgumentError as e:
        raise RolloutError(f"{where}: {e}") from None


def step_from_dict(d: Any, where: str) -> Step:
    if not isinstance(d, dict):
        raise RolloutError(f"{where}: expected an object, got {type(d).__name__}")
    unknown = set(d) - _STEP_KEYS
    if unknown:
        raise RolloutError(f"{where}: unknown key {sorted(unknown)[0]!r}; expected {', '.join(sorted(_STEP_KEYS))}")
    name = d.get("name")
    if not isinstance(name, str) or not name:
        raise RolloutError(f"{where}.name: required, a non-empty string")
    env = d.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        raise RolloutError(f"{where}.env: expected an object of strings")
    step = Step(name=name, endpoint=d.get("endpoint"), env=dict(env))
    if "cpu" in d:
        step.cpu_bytes = _size(d["cpu"], f"{where}.cpu")
    if "disk" in d:
        step.disk_bytes = _size(d["disk"], f"{where}.disk")
        if step.cpu_bytes is None:
            raise RolloutError(f"{where}.disk: the disk tier sits behind a CPU tier; give cpu too")
        if not d.get("disk_root"):
            raise RolloutError(f"{where}.disk_root: required with disk (the disk tier's parent directory)")
    extra = d.get("extra", {})
    if not isinstance(extra, dict):
        raise RolloutError(f"{where}.extra: expected an object of kv_connector_extra_config keys")
    if "kv_transfer_config" in d:
        if not isinstance(d["kv_transfer_config"], dict):
            raise RolloutError(f"{where}.kv_transfer_config: expected an object")
        step.kv_transfer_config = d["kv_transfer_config"]
    elif step.cpu_bytes is not None:
        step.kv_transfer_config = kvtier_config(step.cpu_bytes, step.disk_bytes, d.get("disk_root"), extra)
    elif extra:
        raise RolloutError(f"{where}.extra: kvtier keys need a CPU tier; give cpu too")
    if step.kv_transfer_config is not None:
        check_transfer_config(step.kv_transfer_config, where)
    return step


def load_config(path: str) -> tuple[list[Step], Launch | None]:
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise RolloutError(f"--config {path}: cannot read ({e.strerror or e})") from None
    try:
        doc = tomllib.loads(raw.decode()) if p.suffix == ".toml" else json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise RolloutError(f"--config {path}: not valid {'TOML' if p.suffix == '.toml' else 'JSON'} ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("steps"), list) or not doc["steps"]:
        raise RolloutError(f'--config {path}: expected an object with a non-empty list "steps"')
    steps = [step_from_dict(s, f"--config {path}: steps[{i}]") for i, s in enumerate(doc["steps"])]
    launch = None
    if "launch" in doc:
        launch = launch_from_dict(doc["launch"], f"--config {path}: launch")
    return steps, launch


def launch_from_dict(d: Any, where: str) -> Launch:
    if not isinstance(d, dict) or not isinstance(d.get("model"), str):
        raise RolloutError(f'{where}: expected an object with "model" (the model to serve)')
    unknown = set(d) - _LAUNCH_KEYS
    if unknown:
        raise RolloutError(f"{where}: unknown key {sorted(unknown)[0]!r}; expected {', '.join(sorted(_LAUNCH_KEYS))}")
    args = d.get("args", [])
    if isinstance(args, str):
        args = shlex.split(args)
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise RolloutError(f"{where}.args: expected a list of strings (vllm serve's arguments)")
    return Launch(d["model"], d.get("served_model_name") or "model", args)


def endpoint_steps(specs: list[str]) -> list[Step]:
    """`--endpoint [NAME=]URL`, in order; unnamed ones are baseline, cpu, disk by position."""
    default = ["baseline", "cpu", "disk"]
    steps = []
    for i, spec in enumerate(specs):
        name, sep, url = spec.partition("=")
        if not sep or "://" in name:
            name, url = (default[i] if i < len(default) else f"step{i + 1}"), spec
        if "://" not in url:
            raise RolloutError(f"--endpoint {spec}: expected [NAME=]http://HOST:PORT")
        steps.append(Step(name=name, endpoint=url))
    return steps


def launch_steps(cpu: str | None, disk: str | None, disk_root: str | None, extra: dict[str, Any]) -> list[Step]:
    """The standard rollout for the launcher: baseline, +CPU (with --cpu), +disk (with --disk)."""
    steps = [Step("baseline")]
    if cpu is not None:
        steps.append(step_from_dict({"name": "cpu", "cpu": cpu, "extra": extra}, "--cpu"))
    if disk is not None:
        if cpu is None:
            raise RolloutError("--disk: the disk tier sits behind a CPU tier; give --cpu too")
        d = {"name": "disk", "cpu": cpu, "disk": disk, "disk_root": disk_root, "extra": extra}
        steps.append(step_from_dict(d, "--disk"))
    return steps
