"""The CPU transfer engine: the same interface as the CUDA engine for torch CPU tensors, so the
whole data path (offload, disk staging, promotion) runs and is tested without a GPU, and so that
engines running on CPU (vLLM's CPU build) can offload at all.

Copies run on one background thread in submission order (torch's index ops release the GIL),
one gather or scatter per region per job: the job's blocks in one call, however scattered.
"""

from __future__ import annotations

import queue
import threading

import torch

from kvtier_rs._core import HostPool, InvalidArgumentError
from kvtier_rs.transfer.base import TransferEngine, _Job
from kvtier_rs.transfer.layout import BlockLayout


class CpuTransferEngine(TransferEngine):
    name = "cpu"

    def __init__(self, layout: BlockLayout, pool: HostPool) -> None:
        if layout.device.type != "cpu":
            raise InvalidArgumentError(
                f"invalid argument `layout`: the CPU engine needs CPU tensors, got {layout.device}"
            )
        super().__init__(layout, pool)
        self._host = torch.frombuffer(pool, dtype=torch.uint8).view(pool.num_slots, pool.slot_bytes)
        self._rows = [r.byte_rows() for r in layout.regions]
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvtier-cpu-transfer", daemon=True)
        self._thread.start()

    def _submit(self, job: _Job, block_ids: list[int], slots: list[int], after_stream: object) -> None:
        self._queue.put((job, block_ids, slots))

    def copy_now(self, direction: str, block_ids: list[int], slots: list[int]) -> None:
        """The copy itself, synchronously on the caller's thread."""
        ids = torch.tensor(block_ids, dtype=torch.long)
        sl = torch.tensor(slots, dtype=torch.long)
        for rows, off, region in zip(self._rows, self.layout.host_offsets, self.layout.regions, strict=True):
            cols = slice(off, off + region.bytes_per_block)
            if direction == "d2h":
                self._host[sl, cols] = rows.index_select(0, ids)
            else:
                rows.index_copy_(0, ids, self._host[sl, cols])

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, block_ids, slots = item
            try:
                self.copy_now(job.direction, block_ids, slots)
            except Exception as e:  # noqa: BLE001 - reported through poll()
                self._finish(job, f"{type(e).__name__}: {e}")
            else:
                self._finish(job)

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
