"""``KvtierOffloadingSpec``: kvtier as vLLM's offloading backend (CPU tier + optional disk tier).

vLLM builds two spec objects, one per role: the worker-role spec (``get_worker``, in each worker
process, created first, from ``register_kv_caches``) and the scheduler-role spec (``get_manager``,
in the engine-core process, once every worker has registered its KV caches). kvtier's scheduler
side owns the tiers (the index and the disk tier, whose I/O reads and writes host slots); the
workers copy between the engine's KV cache and the same host memory.

That memory is one ``SharedHostRegion`` per engine, a file in /dev/shm that the scheduler and
every worker rank map (``vllm serve`` runs its workers in their own processes, and tensor or
pipeline parallelism runs one per rank). A row is one chunk of every rank (rank r's part at
``r * worker_kv_bytes_per_block * blocks_per_chunk``), so the disk tier writes and promotes whole
chunks. Rows carry seals (see ``kvtier_rs.tiers.shared_region``): a worker seals the rows it stored,
the disk tier seals the rows it promoted, and no row is loaded, or written to disk, for a key it
is not sealed for. The scheduler refuses to start unless every rank mapped the region.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingManager, OffloadingSpec, OffloadingWorker
from vllm.v1.kv_offload.config import OffloadingConfig

from kvtier_rs._core import BlockIndex, HostPool, InvalidArgumentError, KvTierError
from kvtier_rs.integrations.vllm import metrics as m
from kvtier_rs.integrations.vllm.manager import KvtierOffloadingManager
from kvtier_rs.integrations.vllm.options import READER, KvtierOptions, parse_options, request_guard
from kvtier_rs.integrations.vllm.worker import KvtierWorker, chunk_bytes
from kvtier_rs.tiers.shared_region import SharedHostRegion, region_name

# Under vLLM's logger, so that the lines reach vLLM's own log handler and format.
log = logging.getLogger("vllm." + __name__)


@dataclass
class _EngineState:
    """What this process holds of one engine: its map of the shared host region, and the
    manager or the worker (or both, with vLLM's in-process executor) built on it."""

    region: SharedHostRegion
    manager: KvtierOffloadingManager | None = None
    worker: KvtierWorker | None = None

    @property
    def pool(self) -> HostPool:
        assert self.region.pool is not None, "the region was closed"
        return self.region.pool


_lock = threading.Lock()
_engines: dict[str, _EngineState] = {}


def engine_state(engine_id: str) -> _EngineState | None:
    """The state of a live engine in this process (tests and status tools read kvtier's
    counters here, where the scheduler runs in-process)."""
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
        if config.canonical_layout:
            raise InvalidArgumentError(
                "kv_connector_extra_config['canonical_layout']: not supported by kvtier yet; kvtier "
                "stores each worker's direct pages"
            )
        if config.replicated_layout and par.world_size > 1:
            raise InvalidArgumentError(
                f"KvtierOffloadingSpec: vLLM's replicated layout (one KV copy for {par.world_size} workers, "
                "as for MLA) is not supported by kvtier yet; kvtier stores each worker's pages in turn"
            )
        self.engine_id = config.engine_id
        self.ranks = int(par.world_size)
        #: Bytes of one rank's part of a chunk; a host row holds every rank's part in turn.
        self.chunk_bytes = int(config.worker_kv_bytes_per_block) * int(self.blocks_per_chunk)
        self.row_bytes = HostPool.stride_for(self.chunk_bytes * self.ranks)

    def open_region(self, rank: int | None) -> SharedHostRegion:
        """This process's map of the engine's host region, for worker `rank` or for the
        scheduler (None); the engine's first process creates it."""
        with READER.naming({"total_bytes": "cpu_bytes_to_use"}):
            return SharedHostRegion(
                region_name(self.engine_id),
                rows=self.options.cpu_bytes // self.row_bytes,
                row_bytes=self.row_bytes,
                ranks=self.ranks,
                rank_bytes=self.chunk_bytes,
                rank=rank,
            )

    def _state(self, rank: int | None) -> _EngineState:
        """Get or map the engine's host region in this process (whichever role comes first)."""
        with _lock:
            st = _engines.get(self.engine_id)
            if st is None:
                st = _EngineState(region=self.open_region(rank))
                _engines[self.engine_id] = st
            elif rank is not None:
                st.region.attach(rank)
            return st

    def _release(self) -> None:
        with _lock:
            st = _engines.get(self.engine_id)
            if st is not None and st.manager is None and st.worker is None:
                del _engines[self.engine_id]
                st.region.close()

    def _lower_tiers(self, index: BlockIndex, guard: Any) -> Any:
        """The disk and remote tiers behind the CPU tier (those configured), sharing one gate."""
        from kvtier_rs.integrations.vllm.disk_layer import DiskLayer, build_gate
        from kvtier_rs.integrations.vllm.lower_tiers import LowerTiers

        o, st = self.options, self._state(None)
        tokens = self.tokens_per_block[0] * self.blocks_per_chunk
        gate = build_gate(o, o.lower_tiers, tokens, st.pool.slot_bytes, request_guard=guard)
        seals = st.region.seals
        layers: list[DiskLayer] = []
        try:
            if o.disk_enabled:
                layers.append(
                    DiskLayer.open(
                        o, self.config, host=st.pool, cpu_index=index, tokens_per_chunk=tokens, seals=seals, gate=gate
                    )
                )
            if o.remote is not None:
                from kvtier_rs.integrations.vllm.remote_layer import RemoteLayer

                layers.append(
                    RemoteLayer.open_remote(
                        o, self.config, host=st.pool, cpu_index=index, tokens_per_chunk=tokens, seals=seals, gate=gate
                    )
                )
        except BaseException:
            for layer in layers:
                layer.shutdown()
            raise
        return LowerTiers(layers)

    def get_manager(self) -> OffloadingManager:
        st = self._state(None)
        if st.manager is None:
            o = self.options
            lower = None
            guard = request_guard(o, log)
            try:
                # vLLM builds the scheduler once every worker has registered its KV caches: a
                # rank missing now runs where this process cannot see its memory.
                st.region.require_attached("KvtierOffloadingSpec")
                st.region.unlink()  # every process that needs the name has mapped it
                index = BlockIndex(
                    st.pool.num_slots,
                    policy=o.cpu_policy,
                    admission=o.cpu_admission,
                    tier="cpu",
                    block_bytes=st.pool.slot_bytes,
                )
                if o.lower_tiers:
                    lower = self._lower_tiers(index, guard)
            except BaseException:
                self._release()  # the host memory goes too, unless the worker holds it
                raise
            st.manager = KvtierOffloadingManager(
                index,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                lower=lower,
                seals=st.region.seals,
                request_guard=guard,
            )
            st.manager.on_shutdown = self._manager_closed
            log.info(
                "kvtier: CPU tier: %d chunks of %d bytes (%d rank(s)), policy %s, shared memory %s",
                st.pool.num_slots,
                st.pool.slot_bytes,
                self.ranks,
                o.cpu_policy,
                st.region.path,
            )
        return st.manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        need = chunk_bytes(kv_caches, self.blocks_per_chunk)
        if need > self.chunk_bytes:
            raise KvTierError(
                f"kvtier worker: the KV caches need {need} bytes per chunk, more than vLLM's "
                f"worker_kv_bytes_per_block x blocks_per_chunk ({self.chunk_bytes})"
            )
        rank = int(self.config.parallel.rank)
        st = self._state(rank)
        if st.worker is None:
            try:
                st.worker = self.worker_cls(
                    kv_caches,
                    st.pool,
                    self.blocks_per_chunk,
                    slot_offset=rank * self.chunk_bytes,
                    seals=st.region.seals,
                    rank=rank,
                )
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
