"""``KvtierOffloadingSpec``: kvtier as vLLM's offloading backend (CPU tier + optional disk tier).

vLLM builds two spec objects, one per role: the worker-role spec (``get_worker``, created first,
from ``register_kv_caches``) and the scheduler-role spec (``get_manager``). kvtier's scheduler side
owns the tiers (the index, the host memory and the disk tier, whose I/O reads and writes host
slots), and the worker copies between the engine's KV cache and the same host memory. Both sides
find that memory in a process-wide registry keyed by the engine id, which is why this spec needs
the worker in the scheduler's process: ``world_size == 1`` (vLLM's UniProcExecutor, which is what
``vllm serve`` and ``LLM`` use without tensor/pipeline parallelism). For TP > 1 use kvtier's disk
tier under vLLM's own tiering spec (``KvtierDiskTier``), whose CPU tier lives in shared memory.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingManager, OffloadingSpec, OffloadingWorker
from vllm.v1.kv_offload.config import OffloadingConfig

from kvtier_rs._core import BlockIndex, HostPool, InvalidArgumentError
from kvtier_rs.integrations.vllm import metrics as m
from kvtier_rs.integrations.vllm.manager import KvtierOffloadingManager
from kvtier_rs.integrations.vllm.options import READER, KvtierOptions, parse_options
from kvtier_rs.integrations.vllm.worker import KvtierWorker, chunk_bytes


@dataclass
class _EngineState:
    """What the two spec objects of one engine share."""

    pool: HostPool
    slot_bytes: int
    manager: KvtierOffloadingManager | None = None
    worker: KvtierWorker | None = None


_lock = threading.Lock()
_engines: dict[str, _EngineState] = {}


def engine_state(engine_id: str) -> _EngineState | None:
    """The shared state of a live engine (tests and status tools read kvtier's counters here)."""
    return _engines.get(engine_id)


def live_engines() -> dict[str, _EngineState]:
    return dict(_engines)


class KvtierOffloadingSpec(OffloadingSpec):
    """Load with ``kv_connector_extra_config={"spec_name": "KvtierOffloadingSpec",
    "spec_module_path": "kvtier_rs.integrations.vllm", "cpu_bytes_to_use": ...}``."""

    #: The worker class; a subclass may swap it (the tests' negative control does).
    worker_cls: type[KvtierWorker] = KvtierWorker

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        return m.metric_definitions()

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self.options: KvtierOptions = parse_options(self.extra_config)
        par = config.parallel
        if par.world_size != 1:
            raise InvalidArgumentError(
                f"KvtierOffloadingSpec runs with world_size 1 (got {par.world_size}: tp={par.tp_size}, "
                f"pp={par.pp_size}); with tensor or pipeline parallelism use spec_name "
                "'TieringOffloadingSpec' with secondary_tiers=[{'type': 'KvtierDiskTier', "
                "'module_path': 'kvtier_rs.integrations.vllm', ...}]"
            )
        if config.canonical_layout:
            raise InvalidArgumentError(
                "kv_connector_extra_config['canonical_layout']: not supported by kvtier yet; kvtier "
                "stores each worker's direct pages (world_size 1)"
            )
        self.engine_id = config.engine_id
        self.chunk_bytes = int(config.worker_kv_bytes_per_block) * int(self.blocks_per_chunk)

    def _state(self, chunk_bytes: int) -> _EngineState:
        """Get or create the engine's shared host memory (whichever role comes first)."""
        with _lock:
            st = _engines.get(self.engine_id)
            if st is None:
                stride = HostPool.stride_for(chunk_bytes)
                if self.options.cpu_bytes < stride:
                    raise InvalidArgumentError(
                        f"kv_connector_extra_config['cpu_bytes_to_use']: {self.options.cpu_bytes} bytes "
                        f"cannot hold one chunk of {chunk_bytes} bytes"
                    )
                with READER.naming({"total_bytes": "cpu_bytes_to_use"}):
                    pool = HostPool(self.options.cpu_bytes, chunk_bytes)
                st = _EngineState(pool=pool, slot_bytes=chunk_bytes)
                _engines[self.engine_id] = st
            elif st.slot_bytes < chunk_bytes:
                raise RuntimeError(
                    f"kvtier: engine {self.engine_id!r} has host slots of {st.slot_bytes} bytes, "
                    f"a chunk needs {chunk_bytes}"
                )
            return st

    def _release(self) -> None:
        with _lock:
            st = _engines.get(self.engine_id)
            if st is not None and st.manager is None and st.worker is None:
                del _engines[self.engine_id]

    def get_manager(self) -> OffloadingManager:
        st = self._state(self.chunk_bytes)
        if st.manager is None:
            o = self.options
            index = BlockIndex(
                st.pool.num_slots,
                policy=o.cpu_policy,
                admission=o.cpu_admission,
                tier="cpu",
                block_bytes=st.slot_bytes,
            )
            lower = None
            if o.disk_enabled:
                from kvtier_rs.integrations.vllm.disk_layer import DiskLayer

                try:
                    lower = DiskLayer.open(
                        o,
                        self.config,
                        host=st.pool,
                        cpu_index=index,
                        tokens_per_chunk=self.tokens_per_block[0] * self.blocks_per_chunk,
                    )
                except BaseException:
                    self._release()  # the host memory goes too, unless the worker holds it
                    raise
            st.manager = KvtierOffloadingManager(
                index, enable_events=self.kv_events_config.enable_kv_cache_events, lower=lower
            )
            st.manager.on_shutdown = self._manager_closed
        return st.manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        need = chunk_bytes(kv_caches, self.blocks_per_chunk)
        st = self._state(max(need, self.chunk_bytes))
        if st.worker is None:
            try:
                st.worker = self.worker_cls(kv_caches, st.pool, self.blocks_per_chunk)
            except BaseException:
                self._release()  # the host memory goes too, unless the manager holds it
                raise
            st.worker.on_shutdown = self._worker_closed
        return st.worker

    def _manager_closed(self) -> None:
        st = _engines.get(self.engine_id)
        if st is not None:
            st.manager = None
        self._release()

    def _worker_closed(self) -> None:
        st = _engines.get(self.engine_id)
        if st is not None:
            st.worker = None
        self._release()
