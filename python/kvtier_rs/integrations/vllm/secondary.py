"""kvtier's disk tier as a vLLM ``SecondaryTierManager`` (under vLLM's ``TieringOffloadingSpec``).

    "secondary_tiers": [{"type": "KvtierDiskTier", "module_path": "kvtier_rs.integrations.vllm",
                         "root_dir": "/nvme/kv", "capacity_bytes": "64GiB"}]

Against vLLM's own ``fs`` tier: bounded capacity with an eviction policy and admission, a
checksummed header per block (a corrupt or torn block is a miss, never served), restart
recovery from those headers, no temporary files, and synchronous lookups (an in-memory index,
so a disk hit costs no RETRY round trip).

Every method runs on vLLM's scheduler thread and returns without waiting for I/O: the disk
tier's reads and writes run on its own threads (io_uring or a thread pool, GIL released), and
``get_finished_jobs`` collects completions.

Data path: the disk tier reads and writes slots of a kvtier ``HostPool``. The primary rows live
in vLLM's shared region, so each job goes through a small staging pool: a store copies the
primary rows into staging slots (one memcpy per chunk on the scheduler thread), a load copies
verified blocks from staging into the primary rows when the read completes.

``KvtierTieringOffloadingSpec`` is vLLM's ``TieringOffloadingSpec`` whose worker, on platforms
vLLM's CPU worker refuses (vLLM's CPU build), is kvtier's: the tiering mode then runs there too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    Locality,
    LookupResult,
    Medium,
    OffloadingWorker,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvtier_rs._core import DiskTier, HostPool, InvalidArgumentError
from kvtier_rs.config import parse_bytes
from kvtier_rs.integrations.vllm import metrics as m
from kvtier_rs.integrations.vllm.disk_layer import tier_dir
from kvtier_rs.integrations.vllm.options import _admission, _policy
from kvtier_rs.integrations.vllm.worker import KvtierWorker

_HIT = LookupResult.HIT
_MISS = LookupResult.MISS


def _tier_err(key: str, msg: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"secondary_tiers[type=KvtierDiskTier][{key!r}]: {msg}")


class KvtierDiskTier(SecondaryTierManager):
    medium = Medium.STORAGE

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        return {
            k: v
            for k, v in m.metric_definitions().items()
            if k.removeprefix(m.PREFIX) in m.INDEX_COUNTERS or k.removeprefix(m.PREFIX) in m.INDEX_GAUGES
        }

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        *,
        root_dir: str | None = None,
        capacity_bytes: int | str | None = None,
        policy: str = "lru",
        admission: str = "always",
        io_engine: str = "auto",
        queue_depth: int = 16,
        staging_chunks: int = 64,
        locality: str | None = None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if not isinstance(root_dir, str) or not root_dir:
            raise _tier_err("root_dir", f"required: the disk tier's directory, got {root_dir!r}")
        if capacity_bytes is None:
            raise _tier_err("capacity_bytes", "required: the disk tier's size, e.g. '64GiB'")
        try:
            cap = parse_bytes(capacity_bytes, name="capacity_bytes")
        except InvalidArgumentError as e:
            raise _tier_err("capacity_bytes", str(e).split(": ", 1)[-1]) from None
        if io_engine not in ("auto", "io_uring", "pool"):
            raise _tier_err("io_engine", f"{io_engine!r} is not one of auto, io_uring, pool")
        if isinstance(staging_chunks, bool) or not isinstance(staging_chunks, int) or staging_chunks < 1:
            raise _tier_err("staging_chunks", f"expected a positive int, got {staging_chunks!r}")
        self.locality = Locality(locality) if locality else Locality.LOCAL
        row = self.block_size_bytes
        self._rows = np.frombuffer(primary_kv_view, dtype=np.uint8).reshape(-1, row)
        path = tier_dir(root_dir, offloading_spec.config, row)
        path.mkdir(parents=True, exist_ok=True)
        self.disk = DiskTier(
            str(path),
            cap,
            row,
            policy=_policy("policy", policy),
            admission=_admission("admission", admission),
            engine=io_engine,
            queue_depth=queue_depth,
        )
        self.staging = HostPool(staging_chunks * -(-row // 4096) * 4096, row)
        self._staging_bytes = np.frombuffer(self.staging, dtype=np.uint8)
        self._free = list(range(self.staging.num_slots - 1, -1, -1))
        # disk job id -> (vLLM job id, keys, staging slots, primary rows or None for a write)
        self._jobs: dict[int, tuple[int, list[bytes], list[int], np.ndarray | None]] = {}
        self._done: list[JobResult] = []
        self._last_stats: dict[str, int] = {}
        self.counters = {"loads": 0, "stores": 0, "staging_full": 0, "failed_reads": 0}

    def _slot(self, s: int) -> np.ndarray:
        off = self.staging.slot_offset(s)
        return self._staging_bytes[off : off + self.block_size_bytes]

    def _take(self, n: int) -> list[int] | None:
        if len(self._free) < n:
            self.counters["staging_full"] += 1
            return None
        return [self._free.pop() for _ in range(n)]

    # ---- SecondaryTierManager ---------------------------------------------------------------

    def lookup(self, key: bytes, req_context: ReqContext) -> LookupResult:
        return _HIT if self.disk.contains([key])[0] else _MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        present = self.disk.contains(keys)
        todo = [(k, int(c)) for k, c, p in zip(keys, job_metadata.chunk_ids, present, strict=True) if not p]
        slots = self._take(len(todo)) if todo else []
        if not todo or slots is None:
            # Nothing new, or no staging room: the chunk is simply not cascaded (not an error).
            self._done.append(JobResult(job_metadata.job_id, success=slots is not None))
            return
        for (_, row), s in zip(todo, slots, strict=True):
            self._slot(s)[:] = self._rows[row]
        ticket = self.disk.submit_write([k for k, _ in todo], self.staging, slots)
        self._jobs[ticket.job_id] = (job_metadata.job_id, [k for k, _ in todo], slots, None)
        self.counters["stores"] += len(todo)

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        slots = self._take(len(keys))
        if slots is None:
            self._done.append(JobResult(job_metadata.job_id, success=False, successful_keys=[]))
            return
        job = self.disk.submit_read(keys, self.staging, slots)
        rows = np.asarray(job_metadata.chunk_ids, dtype=np.int64)
        self._jobs[job] = (job_metadata.job_id, keys, slots, rows)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        out, self._done = self._done, []
        if not self._jobs:
            return out
        for r in self.disk.poll():
            entry = self._jobs.pop(r.job_id, None)
            if entry is None:
                continue
            job_id, keys, slots, rows = entry
            if rows is None:
                out.append(JobResult(job_id, success=r.success, transfer_time=r.seconds, transfer_bytes=r.bytes))
            else:
                ok = set(r.ok_keys)
                for k, s, row in zip(keys, slots, rows, strict=True):
                    if k in ok:  # verified (key and checksums) by the disk tier
                        self._rows[row] = self._slot(s)
                self.counters["loads"] += len(ok)
                self.counters["failed_reads"] += len(keys) - len(ok)
                out.append(
                    JobResult(
                        job_id,
                        success=r.success,
                        successful_keys=None if r.success else list(r.ok_keys),
                        transfer_time=r.seconds,
                        transfer_bytes=r.bytes,
                    )
                )
            self._free.extend(slots)
        return out

    def has_pending_work(self) -> bool:
        return bool(self._jobs or self._done)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        self.disk.wait_idle()

    def get_stats(self) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

        stats = OffloadingConnectorStats()
        now = {k: v for k, v in self.disk.stats().items() if isinstance(v, int)}
        m.emit_index_stats(stats, "disk", now, self._last_stats)
        self._last_stats = now
        return stats

    def shutdown(self) -> None:
        self.disk.wait_idle()
        self.disk.close()


class KvtierTieringOffloadingSpec(TieringOffloadingSpec):
    """vLLM's tiering spec, with kvtier's worker where vLLM's own refuses the platform."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if current_platform.is_cuda_alike() or current_platform.is_xpu():
            return super().get_worker(kv_caches)
        if self._worker is None:
            if self.config.canonical_layout:
                raise InvalidArgumentError(
                    "kv_connector_extra_config['canonical_layout']: not supported by kvtier's CPU worker"
                )
            rank = 0 if self.replicated_layout else self.config.parallel.rank
            region = SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            views = [
                region.create_next_worker_view(int(t.page_size_bytes) * self.blocks_per_chunk)
                for t in kv_caches.tensors
            ]
            worker = KvtierWorker(kv_caches, views, self.blocks_per_chunk)
            worker.on_shutdown = region.cleanup
            self._worker = worker
        return self._worker
