"""kvtier's ``OffloadingWorker``: moves chunks between vLLM's KV cache and a CPU tier.

Host slot layout, one slot per offloaded chunk -- the same as vLLM's own CPU worker, so the
bytes of a chunk do not depend on which worker wrote them:

    slot = [tensor 0 area | tensor 1 area | ...]                 (kv_caches.tensors, in order)
    tensor i area = [sub-block 0 | ... | sub-block bpc-1], each tensors[i].page_size_bytes

Sub-block j of a chunk is engine block j of the chunk; a layer ref copies the un-padded
``ref.page_size_bytes`` of row ``block_id`` of ``tensors[ref.tensor_idx]``.

Copies are synchronous on the CPU platform (the engine's "GPU" cache is host memory, so there is
nothing to overlap with); ``get_finished`` then reports each job once, on the next poll.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)


@dataclass(frozen=True)
class Region:
    """One layer: its engine tensor (dim 0 = block id), bytes copied per block, and the host
    view of its tensor's area, shaped (num_slots, blocks_per_chunk, page)."""

    tensor: torch.Tensor
    page_bytes: int
    host: torch.Tensor


def chunk_bytes(kv_caches: CanonicalKVCaches, blocks_per_chunk: int) -> int:
    """Bytes one host slot needs: every tensor's (padded) page, times blocks per chunk."""
    return sum(int(t.page_size_bytes) for t in kv_caches.tensors) * blocks_per_chunk


def pool_views(pool, kv_caches: CanonicalKVCaches, blocks_per_chunk: int) -> list[torch.Tensor]:
    """Per-tensor (num_slots, page * bpc) int8 views over a kvtier ``HostPool`` (zero copy)."""
    flat = torch.frombuffer(pool, dtype=torch.int8)
    stride = pool.slot_offset(1) - pool.slot_offset(0) if pool.num_slots > 1 else pool.slot_bytes
    views, off = [], pool.slot_offset(0)
    for t in kv_caches.tensors:
        size = int(t.page_size_bytes) * blocks_per_chunk
        views.append(flat.as_strided((pool.num_slots, size), (stride, 1), off))
        off += size
    return views


class KvtierWorker(OffloadingWorker):
    """Copies between engine KV blocks and host slots.

    ``host_views``: one int8 view per ``kv_caches.tensors`` entry, shaped
    (num_slots, page_size_bytes * blocks_per_chunk), addressing that tensor's area of every slot
    (``pool_views`` for a kvtier ``HostPool``; vLLM's shared region gives the same shape).
    """

    def __init__(self, kv_caches: CanonicalKVCaches, host_views: list[torch.Tensor], blocks_per_chunk: int) -> None:
        self.bpc = int(blocks_per_chunk)
        # ref.mapping (the canonical-layout certificate) is ignored: kvtier stores the direct
        # per-worker pages; the specs refuse canonical_layout=True.
        split = []
        for t, v in zip(kv_caches.tensors, host_views, strict=True):
            page = int(t.page_size_bytes)
            n, size = v.shape
            assert size == page * self.bpc, (size, page, self.bpc)
            # A strided (num_slots, bpc, page) view makes a batch copy one gather and one scatter
            # per layer, whatever the job size.
            split.append(v.as_strided((n, self.bpc, page), (v.stride(0), page, 1)))
        self.layouts: list[list[Region]] = [
            [Region(kv_caches.tensors[r.tensor_idx].tensor, int(r.page_size_bytes), split[r.tensor_idx]) for r in refs]
            for refs in kv_caches.group_data_refs
        ]
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

    def _copy(self, gpu: GPULoadStoreSpec, host_spec: LoadStoreSpec, to_host: bool) -> int:
        nbytes = 0
        for g, blocks, slots, subs in self._positions(gpu, host_spec.block_ids):
            bt = torch.from_numpy(blocks)
            st, jt = torch.from_numpy(slots), torch.from_numpy(subs)
            for r in self.layouts[g]:
                if to_host:
                    r.host[st, jt, : r.page_bytes] = r.tensor[bt, : r.page_bytes].to(r.host.device)
                else:
                    r.tensor[bt, : r.page_bytes] = r.host[st, jt, : r.page_bytes].to(r.tensor.device)
                nbytes += len(blocks) * r.page_bytes
        return nbytes

    # ---- OffloadingWorker -------------------------------------------------------------------

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        t = time.perf_counter()
        n = self._copy(src_spec, dst_spec, to_host=True)
        self._finished.append(TransferResult(job_id, True, n, time.perf_counter() - t))
        return True

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False
    ) -> bool:
        # ``expedited`` is vLLM 0.33's sync-load flag; copies here are synchronous anyway.
        t = time.perf_counter()
        n = self._copy(dst_spec, src_spec, to_host=False)
        self._finished.append(TransferResult(job_id, True, n, time.perf_counter() - t))
        return True

    def get_finished(self) -> list[TransferResult]:
        out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        return  # every submitted job is already complete

    def shutdown(self) -> None:
        cb, self.on_shutdown = self.on_shutdown, None
        if cb is not None:
            cb()
