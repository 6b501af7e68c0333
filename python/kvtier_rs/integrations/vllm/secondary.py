"""kvtier's disk tier as a vLLM ``SecondaryTierManager`` (under vLLM's ``TieringOffloadingSpec``).

    "secondary_tiers": [{"type": "KvtierDiskTier", "module_path": "kvtier_rs.integrations.vllm",
                         "disk_root": "/nvme/kv", "disk_bytes": "64GiB"}]

Against vLLM's own ``fs`` tier: bounded capacity with an eviction policy and admission, a
checksummed header per block (a corrupt or torn block is a miss, never served), restart
recovery from those headers, no temporary files, and synchronous lookups (an in-memory index,
so a disk hit costs no RETRY round trip).

Every method runs on vLLM's scheduler thread and returns without waiting for I/O: the disk
tier's reads and writes run on its own threads (io_uring or a thread pool, GIL released), and
``get_finished_jobs`` collects completions.

Data path: in place. The primary rows live in vLLM's shared region (an mmap, page-aligned, rows
PAGESIZE-padded); ``HostPool.wrap`` makes that memory a kvtier pool whose slots are the rows, so
the disk tier writes straight from a row vLLM keeps pinned for the job and reads straight into
the row vLLM allocated for a promotion. Nothing is copied on the scheduler thread. A failed or
unverified read leaves its row to vLLM, which frees it (the key is not in ``successful_keys``).

``KvtierTieringOffloadingSpec`` is vLLM's ``TieringOffloadingSpec`` whose worker, on platforms
vLLM's CPU worker refuses (vLLM's CPU build), is kvtier's: the tiering mode then runs there too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, cast

import numpy as np
from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    Locality,
    LookupResult,
    Medium,
    OffloadingWorker,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvtier_rs._core import HostPool, IndexFailedError, InvalidArgumentError, KvTierError, NoSpaceError
from kvtier_rs.integrations.vllm import metrics as m
from kvtier_rs.integrations.vllm.disk_layer import tier_dir
from kvtier_rs.integrations.vllm.options import DISK_TIER_READER, cpu_bytes_to_use, disk_tier_names, parse_disk_tier
from kvtier_rs.integrations.vllm.worker import KvtierWorker
from kvtier_rs.tiers.disk import open_disk_tier

_HIT = LookupResult.HIT
_MISS = LookupResult.MISS


_opts = DISK_TIER_READER


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
        **options: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        # vLLM passes the tier's config entries (less type, module_path and backpressure) as
        # keywords: every one is checked here, before anything is allocated.
        if isinstance(options.get("locality"), Locality):
            options["locality"] = options["locality"].value
        opts = parse_disk_tier(options, localities=tuple(loc.value for loc in Locality))
        self.locality = Locality(opts.locality)
        row = self.block_size_bytes
        try:
            # Slot i of this pool is primary row i: the disk tier's I/O uses the rows in place.
            self.pool: HostPool | None = HostPool.wrap(primary_kv_view, row)
        except InvalidArgumentError as e:
            raise InvalidArgumentError(
                f"secondary_tiers[type=KvtierDiskTier]: cannot use vLLM's primary CPU rows in place ({e}); "
                "kvtier's disk tier needs page-aligned rows of a multiple of 4096 bytes, as vLLM's "
                "shared offload region provides"
            ) from None
        path = tier_dir(opts.disk.root, offloading_spec.config, row)
        # What only the tier can check (a capacity holding no block of this size, a directory
        # it cannot open) is reported under the key the user wrote.
        args, root_name = disk_tier_names(opts.written)
        with _opts.naming(args, path_key=root_name):
            try:
                self.disk = open_disk_tier(
                    path,
                    opts.disk.bytes,
                    row,
                    policy=opts.disk.policy,
                    admission=opts.disk.admission,
                    engine=opts.disk.io_engine,
                    queue_depth=opts.disk.queue_depth,
                )
            except BaseException:
                # The error's traceback keeps this half-built tier alive; without this its
                # export of vLLM's mapped region would keep vLLM from unmapping it.
                self.pool = None
                raise
        # disk job id -> (vLLM job id, keys, True for a read)
        self._jobs: dict[int, tuple[int, list[OffloadKey], bool]] = {}
        self._done: list[JobResult] = []
        self._last_stats: dict[str, int] = {}
        self.counters = {"loads": 0, "stores": 0, "stores_no_space": 0, "failed_reads": 0}

    def _live_pool(self) -> HostPool:
        assert self.pool is not None, "the tier was shut down"
        return self.pool

    # ---- SecondaryTierManager ---------------------------------------------------------------

    def lookup(self, key: bytes, req_context: ReqContext) -> LookupResult:
        return _HIT if self.disk.contains([key])[0] else _MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        # vLLM keeps the rows pinned (ref_cnt + 1) until this job is reported: the disk tier
        # reads them in place. Keys already on disk are skipped by the disk tier itself.
        keys = list(job_metadata.keys)
        pool = self._live_pool()
        try:
            ticket = self.disk.submit_write(keys, pool, np.asarray(job_metadata.chunk_ids).tolist())
        except IndexFailedError:
            ticket = None  # the disk tier's index disabled itself: it stores nothing any more
        except NoSpaceError:
            # Every disk slot is being written, or the batch is larger than the tier: refused
            # like a write to a full device (vLLM's tiering has no failure path for a cascade).
            self.counters["stores_no_space"] += len(keys)
            ticket = None
        if ticket is None or not ticket.keys:
            # Nothing new, refused by admission / a full device, or a failed tier: not cascaded.
            if ticket is not None:
                # The tier finished this empty job at once; take its result now, or it waits
                # for a poll that comes only with a real job (never, on a disk that refuses
                # everything) and one result per cascade piles up in the tier.
                self.disk.try_take(ticket.job_id)
            self._done.append(JobResult(job_metadata.job_id, success=True))
            return
        # The disk tier hands back the keys it was given: vLLM's OffloadKeys.
        self._jobs[ticket.job_id] = (job_metadata.job_id, cast("list[OffloadKey]", list(ticket.keys)), False)
        self.counters["stores"] += len(ticket.keys)

    def submit_load(self, job_metadata: TransferJob) -> None:
        # The rows were allocated for this promotion (ref_cnt -1): read straight into them.
        keys = list(job_metadata.keys)
        pool = self._live_pool()
        try:
            job = self.disk.submit_read(keys, pool, np.asarray(job_metadata.chunk_ids).tolist())
        except KvTierError:
            # The tier is closed or failed: the promotion fails, its keys become misses.
            self.counters["failed_reads"] += len(keys)
            self._done.append(JobResult(job_metadata.job_id, success=False, successful_keys=[]))
            return
        self._jobs[job] = (job_metadata.job_id, keys, True)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        out, self._done = self._done, []
        if not self._jobs:
            return out
        for r in self.disk.poll():
            entry = self._jobs.pop(r.job_id, None)
            if entry is None:
                continue
            job_id, keys, is_read = entry
            if not is_read:
                out.append(JobResult(job_id, success=r.success, transfer_time=r.seconds, transfer_bytes=r.bytes))
            else:
                # ok_keys were verified (key and checksum) by the disk tier in their rows.
                self.counters["loads"] += len(r.ok_keys)
                self.counters["failed_reads"] += len(keys) - len(r.ok_keys)
                out.append(
                    JobResult(
                        job_id,
                        success=r.success,
                        successful_keys=None if r.success else cast("list[OffloadKey]", list(r.ok_keys)),
                        transfer_time=r.seconds,
                        transfer_bytes=r.bytes,
                    )
                )
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
        self.disk.poll()  # finished jobs hold the pool; collect them so it can go
        self.disk.close()
        # Drop the wrapped pool (an export of vLLM's mmap) so vLLM can unmap its region.
        self.pool = None


class KvtierTieringOffloadingSpec(TieringOffloadingSpec):
    """vLLM's tiering spec, with kvtier's worker where vLLM's own refuses the platform, and
    ``cpu_bytes_to_use`` read as KvtierOffloadingSpec reads it (bytes or a size string)."""

    def __init__(self, config: OffloadingConfig) -> None:
        # vLLM's CPU spec reads cpu_bytes_to_use with int(), failing on "32GiB" only once the
        # engine is up: parse it here (naming the key) and hand vLLM the bytes.
        extra = dict(config.extra_config)
        extra["cpu_bytes_to_use"] = cpu_bytes_to_use(extra)
        extra.pop("cpu_bytes", None)  # kvtier's name for it, which vLLM does not read
        super().__init__(dataclasses.replace(config, extra_config=extra))
        # kvtier's worker where vLLM's refuses the platform (vLLM's `_worker` slot is typed for its own).
        self._kvtier_worker: KvtierWorker | None = None

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if current_platform.is_cuda_alike() or current_platform.is_xpu():
            return super().get_worker(kv_caches)
        if self._kvtier_worker is None:
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
            # The whole shared region as a kvtier pool (in place: HostPool.wrap borrows the
            # mmap), one slot per chunk row; this worker's part of a row starts at its rank's
            # area, laid out exactly as vLLM's create_next_worker_view lays it out.
            need = sum(int(t.page_size_bytes) for t in kv_caches.tensors) * self.blocks_per_chunk
            if need > self.cpu_page_size_per_worker:
                raise InvalidArgumentError(
                    f"kvtier worker: the KV caches need {need} bytes per chunk, vLLM's shared region "
                    f"gives each worker {self.cpu_page_size_per_worker}"
                )
            assert region.mmap_obj is not None  # mapped by the constructor
            pool = HostPool.wrap(region.mmap_obj, self.kv_bytes_per_chunk)
            worker = KvtierWorker(
                kv_caches, pool, self.blocks_per_chunk, slot_offset=rank * self.cpu_page_size_per_worker
            )
            # The worker holds the only reference to the pool (the mmap's buffer export) and
            # drops it in shutdown before calling this: the mmap cannot close while exported.
            del pool
            worker.on_shutdown = region.cleanup
            self._kvtier_worker = worker
        return self._kvtier_worker
