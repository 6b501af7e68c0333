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
from kvtier_rs import settings as S
from kvtier_rs._core import InvalidArgumentError
from kvtier_rs.checks import invalid_argument
from kvtier_rs.options import OptionReader
from kvtier_rs.orchestrator.gate import DEFAULT_MAX_IN_FLIGHT
from kvtier_rs.orchestrator.guard import GuardRule

ENV_VAR = "KVTIER_TRTLLM_CONFIG"

#: Every key, with its one-line meaning, from the one configuration tree.
KEYS: dict[str, str] = {s.key: s.meaning for s in S.settings_for(S.TRTLLM)}


#: The reader of this config; ``naming`` maps the tiers' own arguments to its keys.
READER = OptionReader("kvtier trtllm config")
_opts = READER
_err = _opts.error


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
    disk_max_write_backlog: int = D.DISK_MAX_WRITE_BACKLOG
    io_engine: str = "auto"
    prefill_tokens_per_s: float | None = None
    disk_read_bytes_per_s: float | None = None
    namespace: str | None = None
    load_timeout_s: float = 60.0
    remote_probe_wait_s: float | None = None  # None: no remote tier
    async_loads: str = "off"
    block_identity: str = "auto"
    guards: dict[str, GuardRule] = field(default_factory=dict)
    max_promotions_in_flight: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_MAX_IN_FLIGHT))
    #: The same options as the configuration tree's typed settings (``tiers.build`` opens the
    #: tiers from them).
    settings: S.Settings | None = field(default=None, compare=False)


def parse_options(raw: Mapping[str, Any]) -> ConnectorOptions:
    """Validate a config dict; every error names its key."""
    if not isinstance(raw, Mapping):
        raise invalid_argument(
            "kvtier_config",
            f"expected a dict, got {type(raw).__name__}",
            message=f"kvtier trtllm config: expected a dict, got {type(raw).__name__}",
        )
    settings = S.settings_from_values(S.read_values(raw, S.TRTLLM, _opts))
    cpu, disk, path = settings.cpu, settings.disk, settings.data_path
    if cpu.admission.startswith("priority:"):
        # Disk promotions enter the CPU tier at the default priority, so a CPU-side priority
        # rule above 35 would refuse every promotion; the connector filters instead.
        raise _err(
            "cpu_admission",
            "use min_offload_priority for the CPU tier (a priority admission rule there "
            "would also refuse blocks promoted back from disk)",
        )
    disk_kw: dict[str, Any] = {}
    if disk is not None:
        disk_kw = {
            "disk_root": disk.root,
            "disk_bytes": disk.bytes,
            "disk_policy": disk.policy,
            "disk_admission": disk.admission,
            "disk_io_engine": disk.io_engine,
            "disk_queue_depth": disk.queue_depth,
            "disk_max_write_backlog": path.max_disk_write_backlog,
        }
    return ConnectorOptions(
        cpu_bytes=cpu.bytes,
        cpu_policy=cpu.policy,
        cpu_admission=cpu.admission,
        **disk_kw,
        prefill_tokens_per_s=path.cost.prefill_tokens_per_s if path.cost else None,
        disk_read_bytes_per_s=path.cost.disk_read_bytes_per_s if path.cost else None,
        guards=dict(path.guards),
        max_promotions_in_flight=dict(path.max_promotions_in_flight),
        settings=settings,
        **settings.engine,
    )


def _env_error(reason: str) -> InvalidArgumentError:
    """An error in what the environment variable holds, with ``.arg`` naming it."""
    return invalid_argument(ENV_VAR, reason, message=f"{ENV_VAR}: {reason}")


def load_options(class_config: Mapping[str, Any] | None) -> ConnectorOptions:
    """The connector's options: the class attribute if set, else the environment variable."""
    if class_config is not None:
        return parse_options(class_config)
    text = os.environ.get(ENV_VAR)
    if not text:
        reason = (
            f"none given. Set {ENV_VAR} to a JSON object (or a JSON file's path), "
            'e.g. {"cpu_bytes": "8GiB"}, or subclass KvtierScheduler/KvtierWorker with kvtier_config = {...}'
        )
        raise invalid_argument(ENV_VAR, reason, message=f"kvtier trtllm config: {reason}")
    if not text.lstrip().startswith("{"):
        path = Path(text)
        if not path.is_file():
            raise _env_error(f"{text!r} is neither a JSON object nor an existing file")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise _env_error(f"{text!r} is not UTF-8 text (JSON is UTF-8): {e}") from None
        except OSError as e:
            raise _env_error(f"cannot read {text!r}: {e}") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise _env_error(f"not valid JSON: {e}") from None
    except (ValueError, RecursionError) as e:  # an integer of over 4300 digits, nesting too deep
        raise _env_error(f"not usable JSON: {e}") from None
    return parse_options(raw)
