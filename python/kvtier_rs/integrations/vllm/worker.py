"""kvtier's ``OffloadingWorker``: moves chunks between vLLM's KV cache and a CPU tier.

Host slot layout, one slot per offloaded chunk -- the same as vLLM's own CPU worker, so the
bytes of a chunk do not depend on which worker wrote them:

    slot = [tensor 0 area | tensor 1 area | ...]                 (kv_caches.tensors, in order)
    tensor i area = [sub-block 0 | ... | sub-block bpc-1], each tensors[i].page_size_bytes

Sub-block j of a chunk is engine block j of the chunk; a layer ref copies the un-padded
``ref.page_size_bytes`` of row ``block_id`` of ``tensors[ref.tensor_idx]``.

The copies themselves are kvtier's transfer engines (``kvtier_rs.transfer``): each KV group is
described as a ``BlockLayout`` (one region per distinct tensor of the group, placed at its
tensor's area, ``blocks_per_slot = blocks_per_chunk``) and ``transfer.auto`` picks the CUDA
engine for CUDA caches (cudaMemcpy on dedicated streams, host memory pinned once) and the CPU
engine on vLLM's CPU platform (inline copies: see below). Jobs may complete asynchronously;
``get_finished`` reports each vLLM job once, when every group's copy of it has finished.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from kvtier_rs._core import HostPool, KvTierError
from kvtier_rs.tiers.shared_region import SlotSeals
from kvtier_rs.transfer import BlockLayout, Region, TransferEngine, auto
from kvtier_rs.transfer.base import TransferResult as EngineResult

# Under vLLM's logger, so that the lines reach vLLM's own log handler and format.
log = logging.getLogger("vllm." + __name__)

if TYPE_CHECKING:
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec


def chunk_bytes(kv_caches: CanonicalKVCaches, blocks_per_chunk: int) -> int:
    """Bytes one host slot needs: every tensor's (padded) page, times blocks per chunk."""
    return sum(int(t.page_size_bytes) for t in kv_caches.tensors) * blocks_per_chunk


def group_layouts(
    kv_caches: CanonicalKVCaches, blocks_per_chunk: int, slot_offset: int = 0
) -> list[BlockLayout | None]:
    """One ``BlockLayout`` per KV group, placing each tensor's pages at that tensor's area of a
    host slot (``slot_offset`` is where this worker's part of a slot starts); None for a group
    with no offloaded layers."""
    bpc = int(blocks_per_chunk)
    area, off = [], slot_offset
    for t in kv_caches.tensors:
        area.append(off)
        off += int(t.page_size_bytes) * bpc
    layouts = []
    for refs in kv_caches.group_data_refs:
        # Layers that alias the same bytes share one tensor: copy it once, as much as the
        # largest ref needs (never past the tensor's padded page).
        pages: dict[int, int] = {}
        for r in refs:
            pages[r.tensor_idx] = max(pages.get(r.tensor_idx, 0), int(r.page_size_bytes))
        # ref.mapping (the canonical-layout certificate) is ignored: kvtier stores the direct
        # per-worker pages; the specs refuse canonical_layout=True.
        regions, offsets, strides = [], [], []
        for idx, page in pages.items():
            t = kv_caches.tensors[idx]
            tensor = t.tensor
            regions.append(
                Region(
                    tensor=tensor,
                    bytes_per_block=page,
                    block_stride_bytes=tensor.stride(0) * tensor.element_size(),
                )
            )
            offsets.append(area[idx])
            strides.append(int(t.page_size_bytes))
        layouts.append(
            BlockLayout(regions, blocks_per_slot=bpc, host_offsets=offsets, sub_block_strides=strides)
            if regions
            else None
        )
    return layouts


@dataclass
class _Pending:
    """A vLLM job: the transfer-engine jobs (one per KV group) it is waiting for."""

    started: float
    parts: set[tuple[int, int]]  # (group, engine job id)
    nbytes: int = 0
    errors: list[str] = field(default_factory=list)
    # A store's host rows and the seals of the chunks written there, sealed once it succeeded.
    rows: np.ndarray | None = None
    seals: np.ndarray | None = None


def _compute_stream(layout: BlockLayout | None) -> object:
    """The stream the model computes on, for a layout on a CUDA device; None on the CPU."""
    if layout is None or layout.device.type != "cuda":
        return None
    return torch.cuda.current_stream(layout.device)


class KvtierWorker(OffloadingWorker):
    """Copies between engine KV blocks and the slots of a kvtier ``HostPool``.

    ``pool``: the host memory, one slot per chunk (kvtier's shared host region, or
    ``HostPool.wrap`` over vLLM's shared CPU region). ``slot_offset``: where this worker's
    part of a slot starts (``rank * bytes of a rank's chunk``).

    ``seals``: the region's seal table, with specs that carry the seal of each chunk
    (``KvtierHostSpec``, from kvtier's manager): a store seals this rank's part of its rows once
    its copies succeeded, and a load refuses rows not sealed for the chunks it is asked for.
    None under vLLM's own manager (tiering mode), whose specs carry no seals.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        pool: HostPool,
        blocks_per_chunk: int,
        *,
        slot_offset: int = 0,
        seals: SlotSeals | None = None,
        rank: int = 0,
    ) -> None:
        self.bpc = int(blocks_per_chunk)
        self.pool: HostPool | None = pool
        self.seals = seals
        self.rank = int(rank)
        self.layouts = group_layouts(kv_caches, self.bpc, slot_offset)
        # One engine per group (each group has its own block ids); they share the pool. On
        # vLLM's CPU platform the copies run inline on the worker thread: the model's compute
        # already uses every core, and a copy thread would contend with it (CpuTransferEngine).
        self.engines: list[TransferEngine | None] = [
            None if lay is None else auto(lay, pool, cpu_inline=True) for lay in self.layouts
        ]
        self._pending: dict[int, _Pending] = {}
        self._owner: dict[tuple[int, int], int] = {}  # (group, engine job) -> vLLM job
        self._finished: list[TransferResult] = []
        #: Called once by ``shutdown`` (the spec uses it to release the engine's host memory).
        self.on_shutdown: Callable[[], None] | None = None

    # ---- spec decoding -----------------------------------------------------------------------

    def _positions(self, gpu: GPULoadStoreSpec, chunk_slots: np.ndarray):
        """Yield (group, gpu block ids, host slot per block, sub-block per block)."""
        block_ids = np.asarray(gpu.block_ids, dtype=np.int64)
        b0 = c0 = 0
        for g, (n, first) in enumerate(zip(gpu.group_sizes, gpu.block_indices, strict=True)):
            if n == 0:
                continue
            skip = int(first) % self.bpc
            logical = np.arange(skip, skip + n, dtype=np.int64)
            chunks = logical // self.bpc
            nchunks = int(chunks[-1]) + 1
            slots = np.asarray(chunk_slots[c0 : c0 + nchunks], dtype=np.int64)[chunks]
            yield g, block_ids[b0 : b0 + n], slots, logical % self.bpc
            b0 += n
            c0 += nchunks
        if b0 != len(block_ids) or c0 != len(chunk_slots):
            raise ValueError(f"spec mismatch: {len(block_ids)} blocks / {len(chunk_slots)} chunks, decoded {b0} / {c0}")

    def _check_seals(self, host_spec: CPULoadStoreSpec) -> None:
        """Refuse to load rows that do not hold the chunks the scheduler names: the scheduler's
        host memory would then not be this worker's (a process layout kvtier cannot serve),
        and loading would put another chunk's KV, or none, under the request's tokens."""
        seals = getattr(host_spec, "seals", None)
        if self.seals is None or seals is None:
            return
        rows = np.asarray(host_spec.block_ids, dtype=np.int64)
        ok = self.seals.matches(rows, seals, self.rank)
        if not ok.all():
            bad = rows[~ok][:8].tolist()
            raise KvTierError(
                f"kvtier worker (rank {self.rank}): host rows {bad} do not hold the chunks the scheduler asked "
                "to load (their seals differ); the scheduler and this worker do not share the CPU tier's "
                "memory. Refusing to serve them"
            )

    def _submit(self, job_id: int, gpu: GPULoadStoreSpec, spec: LoadStoreSpec, to_host: bool) -> None:
        # The host side of every job is a CPU spec: vLLM's own, or kvtier's KvtierHostSpec.
        host_spec = cast("CPULoadStoreSpec", spec)
        if not to_host:
            self._check_seals(host_spec)
        job = _Pending(time.perf_counter(), set())
        seals = getattr(host_spec, "seals", None)
        if to_host and self.seals is not None and seals is not None:
            job.rows = np.asarray(host_spec.block_ids, dtype=np.int64)
            job.seals = np.asarray(seals, dtype=np.uint64)
        self._pending[job_id] = job
        for g, blocks, slots, subs in self._positions(gpu, host_spec.block_ids):
            eng = self.engines[g]
            if eng is None:
                raise ValueError(f"KV group {g} has no offloaded layers but the spec names {len(blocks)} blocks")
            b, s = blocks.tolist(), slots.tolist()
            sub = subs.tolist() if self.bpc > 1 else None
            if to_host:
                # vLLM submits stores at the start of the next step, while the last forward pass
                # may still run on the GPU: the copy stream must wait for the model's kernels
                # to have written the blocks (as vLLM's own handler does).
                tid = eng.store(b, s, sub_blocks=sub, after_stream=_compute_stream(self.layouts[g]))
            else:
                # The destination blocks were just allocated to this request; a forward pass
                # still running may read them for the request that held them before.
                tid = eng.load(s, b, sub_blocks=sub, after_stream=_compute_stream(self.layouts[g]))
            job.parts.add((g, tid))
            self._owner[(g, tid)] = job_id
        if not job.parts:
            self._retire(job_id)

    def _record(self, g: int, r: EngineResult) -> None:
        job_id = self._owner.pop((g, r.job_id), None)
        if job_id is None:
            return
        job = self._pending[job_id]
        job.parts.discard((g, r.job_id))
        job.nbytes += r.bytes
        if not r.success:
            job.errors.append(f"group {g}: {r.error}")
        if not job.parts:
            self._retire(job_id)

    def _retire(self, job_id: int) -> None:
        job = self._pending.pop(job_id)
        if job.errors:
            # vLLM 0.32 treats a failed transfer as fatal (it asserts); say why first.
            log.error("kvtier: transfer job %d failed: %s", job_id, "; ".join(job.errors))
        elif job.rows is not None and job.seals is not None and self.seals is not None:
            # Sealed before vLLM hears of the job: the scheduler reads a row (for a load or a
            # disk write) only after the job is reported done.
            self.seals.seal(job.rows, job.seals, self.rank)
        self._finished.append(TransferResult(job_id, not job.errors, job.nbytes, time.perf_counter() - job.started))

    # ---- OffloadingWorker -------------------------------------------------------------------

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        self._submit(job_id, src_spec, dst_spec, to_host=True)
        return True

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False
    ) -> bool:
        self._submit(job_id, dst_spec, src_spec, to_host=False)
        if expedited:
            # vLLM 0.33's sync load: its request runs in this same step, so the data must land now.
            self.wait({job_id})
        return True

    def get_finished(self) -> list[TransferResult]:
        if self._pending:
            for g, eng in enumerate(self.engines):
                if eng is not None:
                    for r in eng.poll():
                        self._record(g, r)
        out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        # Ids may be already retired (vLLM allows that); results consumed here are reported by
        # the next get_finished.
        for job_id in job_ids:
            job = self._pending.get(job_id)
            if job is None:
                continue
            for g, tid in list(job.parts):
                eng = self.engines[g]
                assert eng is not None  # only groups with an engine have jobs
                for r in eng.wait([tid]):
                    self._record(g, r)

    def shutdown(self) -> None:
        for eng in self.engines:
            if eng is not None:
                eng.close()
        self.engines = []
        self.pool = None
        cb, self.on_shutdown = self.on_shutdown, None
        if cb is not None:
            cb()
