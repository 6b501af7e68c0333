"""kvtier for TensorRT-LLM (PyTorch backend KV cache connector): a CPU tier and an optional
NVMe tier behind the engine's GPU (and host) block pools, honouring retention priorities.

Enable it with::

    from tensorrt_llm import LLM
    from tensorrt_llm.llmapi import KvCacheConfig, KvCacheConnectorConfig
    os.environ["KVTIER_TRTLLM_CONFIG"] = '{"cpu_bytes": "16GiB", "disk_root": "/nvme/kv", "disk_bytes": "200GiB"}'
    llm = LLM(model, backend="pytorch",
              kv_cache_config=KvCacheConfig(enable_block_reuse=True, host_cache_size=None),
              kv_connector_config=KvCacheConnectorConfig(
                  connector_module="kvtier_rs.integrations.trtllm",
                  connector_scheduler_class="KvtierScheduler",
                  connector_worker_class="KvtierWorker"))

Targets TensorRT-LLM 1.2 (``kv_connector_config=``, constructors taking ``TorchLlmArgs``, ABCs in
``tensorrt_llm._torch.pyexecutor.kv_cache_connector``) through the 2026 releases (ABCs moved to
``...pyexecutor.connectors.kv_cache_connector``, ``RequestData.priorities``/``cache_salt``, the
``*_by_layer_group`` forms). This module imports without TensorRT-LLM; when it is importable the
classes subclass its real base classes, otherwise they carry the same duck-typed surface (what
the tests' engine driver calls). ``connector_config()`` needs TensorRT-LLM and says so.
"""

from __future__ import annotations

from typing import Any

#: TensorRT-LLM releases the adapter is written against (see module docstring).
SUPPORTED_TRTLLM = ("1.2", "1.3", "1.4")

_BASE_MODULES = (
    "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector",  # 2026 releases
    "tensorrt_llm._torch.pyexecutor.kv_cache_connector",  # 1.1 / 1.2
)


def _resolve_bases() -> tuple[type | None, type | None, str | None, str | None]:
    import importlib

    why = None
    for name in _BASE_MODULES:
        try:
            mod = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - tensorrt_llm fails with ImportError, OSError (CUDA libs), RuntimeError
            why = f"{type(e).__name__}: {e}"
            continue
        return mod.KvCacheConnectorScheduler, mod.KvCacheConnectorWorker, name, None
    return None, None, None, why


_SchedBase, _WorkerBase, BASE_MODULE, _IMPORT_ERROR = _resolve_bases()


class _FallbackWorkerBase:
    """The ABC's concrete surface, for use without TensorRT-LLM (the runtime only calls methods
    by name on the V1 path)."""

    supports_attention_dp = False

    def __init__(self, llm_args: Any) -> None:
        self._llm_args = llm_args
        self._metadata: object = None

    def bind_connector_meta(self, metadata: object) -> None:
        self._metadata = metadata

    def get_connector_meta(self) -> object:
        return self._metadata

    def _clear_connector_meta(self) -> None:
        self._metadata = None


class _FallbackSchedulerBase:
    supports_attention_dp = False

    def __init__(self, llm_args: Any) -> None:
        self._llm_args = llm_args


from kvtier_rs.integrations.trtllm.config import READER  # noqa: E402
from kvtier_rs.integrations.trtllm.metadata import KvtierConnectorMetadata, LoadSpec, SaveSpec  # noqa: E402
from kvtier_rs.integrations.trtllm.scheduler import SchedulerCore  # noqa: E402
from kvtier_rs.integrations.trtllm.worker import WorkerCore  # noqa: E402


def resumes_async_loads() -> bool:
    """Whether the installed TensorRT-LLM keeps a request parked for an async load on the
    blocks it allocated and, once the load is reported, runs it as a new request without
    allocating again (its connector manager's ``should_add_sequence``): what kvtier's staged
    loads rely on, since they copy into those blocks in the step the request comes back in.
    True without TensorRT-LLM (the tests' engine driver models that behaviour)."""
    if BASE_MODULE is None:
        return True
    import importlib

    manager = getattr(importlib.import_module(BASE_MODULE), "KvCacheConnectorManager", None)
    return manager is not None and hasattr(manager, "should_add_sequence")


# The ignores below (misc): the base class is chosen at import time, which mypy cannot follow.
class KvtierScheduler(SchedulerCore, _SchedBase or _FallbackSchedulerBase):  # type: ignore[misc]
    """TensorRT-LLM ``connector_scheduler_class``; runs on rank 0."""

    def __init__(self, llm_args: Any) -> None:
        super().__init__(llm_args)
        self._kvtier_init(llm_args)
        if self.options.async_loads != "off" and not resumes_async_loads():
            raise READER.error(
                "async_loads",
                f"{self.options.async_loads!r} needs a TensorRT-LLM release whose connector manager keeps a "
                f"parked request's blocks and resumes it as a new request (should_add_sequence); {BASE_MODULE} "
                "has none. Use 'off'",
            )


class KvtierWorker(WorkerCore, _WorkerBase or _FallbackWorkerBase):  # type: ignore[misc]
    """TensorRT-LLM ``connector_worker_class``; runs on every rank (kvtier supports one)."""

    def __init__(self, llm_args: Any) -> None:
        super().__init__(llm_args)
        self._kvtier_init(llm_args)


def check_trtllm() -> str:
    """The installed TensorRT-LLM version, or an ImportError saying what is needed."""
    if BASE_MODULE is None:
        raise ImportError(
            "kvtier_rs.integrations.trtllm needs TensorRT-LLM "
            + " / ".join(SUPPORTED_TRTLLM)
            + " (pip install tensorrt_llm, on a machine with its CUDA libraries) to run inside the engine; "
            f"importing its connector base classes failed: {_IMPORT_ERROR}"
        )
    import tensorrt_llm

    return str(getattr(tensorrt_llm, "__version__", "unknown"))


def connector_config(
    scheduler_class: str = "KvtierScheduler",
    worker_class: str = "KvtierWorker",
    module: str = "kvtier_rs.integrations.trtllm",
) -> Any:
    """A ``KvCacheConnectorConfig`` naming kvtier's classes (needs TensorRT-LLM)."""
    check_trtllm()
    from tensorrt_llm.llmapi.llm_args import KvCacheConnectorConfig

    return KvCacheConnectorConfig(
        connector_module=module, connector_scheduler_class=scheduler_class, connector_worker_class=worker_class
    )


__all__ = [
    "BASE_MODULE",
    "SUPPORTED_TRTLLM",
    "KvtierConnectorMetadata",
    "KvtierScheduler",
    "KvtierWorker",
    "LoadSpec",
    "SaveSpec",
    "check_trtllm",
    "connector_config",
    "resumes_async_loads",
]
