"""kvtier's disk tier and its shared remote tier as vLLM ``SecondaryTierManager``s (under vLLM's
``TieringOffloadingSpec``).

    "secondary_tiers": [{"type": "KvtierDiskTier", "module_path": "kvtier_rs.integrations.vllm",
                         "disk_root": "/nvme/kv", "disk_bytes": "64GiB"},
                        {"type": "KvtierRemoteTier", "module_path": "kvtier_rs.integrations.vllm",
                         "remote_url": "redis://10.0.0.5:7000"}]

Against vLLM's own ``fs`` tier, the disk tier has bounded capacity with an eviction policy and
admission, a checksummed header per block (a corrupt or torn block is a miss, never served),
restart recovery from those headers, no temporary files, and synchronous lookups (an in-memory
index, so a disk hit costs no RETRY round trip).

The remote tier is the one ``KvtierOffloadingSpec`` runs behind its CPU tier (``tiers.remote``):
every replica of a deployment reads and writes one Valkey / Redis Cluster, each value verified
before it is served, under the namespace both specs derive (``layout_identity``), so replicas
under either spec share blocks. Its lookups never wait on the network: a chunk it knows nothing
of answers RETRY and is queued, and the chunks queued in a scheduler step go to the store in one
batched existence probe at the end of the step (``on_schedule_end``); vLLM asks again on a later
step (the tier has pending work while a probe is in flight, so the engine keeps stepping).

Every method runs on vLLM's scheduler thread and returns without waiting for I/O: the tiers'
reads and writes run on their own threads (GIL released for the disk tier), and
``get_finished_jobs`` collects completions.

Data path: in place. The primary rows live in vLLM's shared region (an mmap, page-aligned, rows
PAGESIZE-padded); ``HostPool.wrap`` makes that memory a kvtier pool whose slots are the rows, so
a tier writes straight from a row vLLM keeps pinned for the job and reads straight into the row
vLLM allocated for a promotion. Nothing is copied on the scheduler thread. A failed or unverified
read leaves its row to vLLM, which frees it (the key is not in ``successful_keys``).

``KvtierTieringOffloadingSpec`` is vLLM's ``TieringOffloadingSpec`` whose worker, on platforms
vLLM's CPU worker refuses (vLLM's CPU build), is kvtier's: the tiering mode then runs there too.
"""

from __future__ import annotations

import dataclasses
import logging
from abc import abstractmethod
from collections.abc import Iterable
from typing import Any, ClassVar, cast

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
    ScheduleEndContext,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvtier_rs._core import HostPool, IndexFailedError, InvalidArgumentError, KvTierError, NoSpaceError
from kvtier_rs.integrations.vllm import metrics as m
from kvtier_rs.integrations.vllm.options import (
    DISK_TIER_READER,
    DISK_TIER_TYPE,
    REMOTE_TIER_TYPE,
    cpu_bytes_to_use,
    disk_tier_names,
    parse_disk_tier,
    parse_remote_tier,
)
from kvtier_rs.integrations.vllm.tier_identity import layout_identity, log_earlier_formats, tier_dir
from kvtier_rs.integrations.vllm.worker import KvtierWorker
from kvtier_rs.tiers.disk import open_disk_tier
from kvtier_rs.tiers.remote.breaker import BreakerState
from kvtier_rs.tiers.remote.build import open_remote_tier
from kvtier_rs.tiers.remote.tier import RemoteTier

log = logging.getLogger("vllm." + __name__)

_HIT = LookupResult.HIT
_MISS = LookupResult.MISS
_RETRY = LookupResult.RETRY


_opts = DISK_TIER_READER


class _InPlaceTier(SecondaryTierManager):
    """A kvtier tier with the staging contract (``submit_write`` / ``submit_read`` into a pool's
    slots, ``poll``, ``try_take``, ``wait_idle``, ``close``) behind vLLM's primary rows, used in
    place. A subclass opens its tier (``_open``) and answers ``lookup``, ``get_stats`` and
    ``reset``; the transfers, their results and the shutdown are the same for every tier."""

    medium = Medium.STORAGE
    #: The entry's type name in secondary_tiers.
    type_name: ClassVar[str]

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        **options: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        # tier job id -> (vLLM job id, keys, True for a read)
        self._jobs: dict[int, tuple[int, list[OffloadKey], bool]] = {}
        self._done: list[JobResult] = []
        self.counters = {"loads": 0, "stores": 0, "stores_no_space": 0, "failed_reads": 0}
        # vLLM passes the tier's config entries (less type, module_path and backpressure) as
        # keywords: every one is checked here (``_parse``), before anything is allocated.
        if isinstance(options.get("locality"), Locality):
            options["locality"] = options["locality"].value
        parsed = self._parse(options)
        row = self.block_size_bytes
        try:
            # Slot i of this pool is primary row i: the tier's I/O uses the rows in place.
            self.pool: HostPool | None = HostPool.wrap(primary_kv_view, row)
        except InvalidArgumentError as e:
            raise InvalidArgumentError(
                f"secondary_tiers[type={self.type_name}]: cannot use vLLM's primary CPU rows in place ({e}); "
                "kvtier's tiers need page-aligned rows of a multiple of 4096 bytes, as vLLM's "
                "shared offload region provides"
            ) from None
        try:
            self.store: Any = self._open(parsed, offloading_spec.config, row)
        except BaseException:
            # The error's traceback keeps this half-built tier alive; without this its
            # export of vLLM's mapped region would keep vLLM from unmapping it.
            self.pool = None
            raise

    # ---- what a tier defines --------------------------------------------------------------------

    @abstractmethod
    def _parse(self, options: dict[str, Any]) -> Any:
        """Check the entry's keys and set ``self.locality``; return what ``_open`` needs."""

    @abstractmethod
    def _open(self, parsed: Any, config: Any, row_bytes: int) -> Any:
        """Open the tier for blocks of `row_bytes` (one primary row each)."""

    def _stores_enabled(self) -> bool:
        return True

    def reset(self) -> None:
        """vLLM's cache reset (a sleep, new weights): called once the tier is idle."""
        return

    def _live_pool(self) -> HostPool:
        assert self.pool is not None, "the tier was shut down"
        return self.pool

    # ---- SecondaryTierManager ---------------------------------------------------------------

    def submit_store(self, job_metadata: TransferJob) -> None:
        # vLLM keeps the rows pinned (ref_cnt + 1) until this job is reported: the tier reads
        # them in place. Keys the tier holds already are skipped by the tier itself.
        keys = list(job_metadata.keys)
        pool = self._live_pool()
        ticket = None
        if self._stores_enabled():
            try:
                ticket = self.store.submit_write(keys, pool, np.asarray(job_metadata.chunk_ids).tolist())
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
                # for a poll that comes only with a real job (never, on a tier that refuses
                # everything) and one result per cascade piles up in the tier.
                self.store.try_take(ticket.job_id)
            self._done.append(JobResult(job_metadata.job_id, success=True))
            return
        # The tier hands back the keys it was given: vLLM's OffloadKeys.
        self._jobs[ticket.job_id] = (job_metadata.job_id, cast("list[OffloadKey]", list(ticket.keys)), False)
        self.counters["stores"] += len(ticket.keys)

    def submit_load(self, job_metadata: TransferJob) -> None:
        # The rows were allocated for this promotion (ref_cnt -1): read straight into them.
        keys = list(job_metadata.keys)
        pool = self._live_pool()
        try:
            job = self.store.submit_read(keys, pool, np.asarray(job_metadata.chunk_ids).tolist())
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
        for r in self.store.poll():
            entry = self._jobs.pop(r.job_id, None)
            if entry is None:
                continue
            job_id, keys, is_read = entry
            if not is_read:
                out.append(JobResult(job_id, success=r.success, transfer_time=r.seconds, transfer_bytes=r.bytes))
            else:
                # ok_keys were verified (key and checksum) by the tier in their rows.
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
        # vLLM calls this only from its cache reset, before it resets the primary tier.
        self.store.wait_idle()
        self.reset()

    def shutdown(self) -> None:
        self.store.wait_idle()
        self.store.poll()  # finished jobs hold the pool; collect them so it can go
        self.store.close()
        # Drop the wrapped pool (an export of vLLM's mmap) so vLLM can unmap its region.
        self.pool = None


class KvtierDiskTier(_InPlaceTier):
    """kvtier's disk tier. vLLM keeps a secondary tier's blocks across a cache reset (as for its
    own ``fs`` tier), and so does this one."""

    type_name = DISK_TIER_TYPE

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        return {
            k: v
            for k, v in m.metric_definitions().items()
            if k.removeprefix(m.PREFIX) in m.INDEX_COUNTERS or k.removeprefix(m.PREFIX) in m.INDEX_GAUGES
        }

    def _parse(self, options: dict[str, Any]) -> Any:
        opts = parse_disk_tier(options, localities=tuple(loc.value for loc in Locality))
        self.locality = Locality(opts.locality)
        self._last_stats: dict[str, int] = {}
        return opts

    def _open(self, parsed: Any, config: Any, row_bytes: int) -> Any:
        path = tier_dir(parsed.disk.root, config, row_bytes)
        log_earlier_formats(path)
        # What only the tier can check (a capacity holding no block of this size, a directory
        # it cannot open) is reported under the key the user wrote.
        args, root_name = disk_tier_names(parsed.written)
        with _opts.naming(args, path_key=root_name):
            return open_disk_tier(
                path,
                parsed.disk.bytes,
                row_bytes,
                policy=parsed.disk.policy,
                admission=parsed.disk.admission,
                engine=parsed.disk.io_engine,
                queue_depth=parsed.disk.queue_depth,
            )

    @property
    def disk(self) -> Any:
        """The disk tier (``tiers.disk``)."""
        return self.store

    def lookup(self, key: bytes, req_context: ReqContext) -> LookupResult:
        return _HIT if self.store.contains([key])[0] else _MISS

    def get_stats(self) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

        stats = OffloadingConnectorStats()
        now = {k: v for k, v in self.store.stats().items() if isinstance(v, int)}
        m.emit_index_stats(stats, "disk", now, self._last_stats)
        self._last_stats = now
        return stats


class KvtierRemoteTier(_InPlaceTier):
    """kvtier's shared remote tier (a Valkey / Redis Cluster), locality REMOTE unless the entry
    says otherwise.

    ``lookup`` never waits on the network: known present is a HIT, known absent (or the circuit
    breaker open, or the tier switched off) a MISS, anything else RETRY, its key queued for the
    step's batched probe. A cache reset (vLLM's, e.g. after new weights) switches the tier off
    for this process, as ``KvtierOffloadingSpec`` does by default: the shared store may hold
    blocks of the old weights, which this process can neither tell apart nor delete for every
    replica."""

    type_name = REMOTE_TIER_TYPE

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in m.metric_definitions().items() if k.removeprefix(m.PREFIX) in m.REMOTE_SERIES}

    def _parse(self, options: dict[str, Any]) -> Any:
        opts = parse_remote_tier(options, localities=tuple(loc.value for loc in Locality))
        self.locality = Locality(opts.locality)
        # Keys this step's lookups asked about and the tier knows nothing of (a dict: ordered,
        # each once), probed together at the end of the step.
        self._to_probe: dict[OffloadKey, None] = {}
        self._last_stats: dict[str, int] = {}
        #: Why the tier is off for the rest of this process, or None.
        self.off_reason: str | None = None
        self.counters["lookups_deferred"] = 0
        return opts

    def _open(self, parsed: Any, config: Any, row_bytes: int) -> RemoteTier:
        # The namespace KvtierOffloadingSpec derives for the same model and layout: replicas
        # under either spec read each other's blocks. A primary row here is laid out as a host
        # row there where the row sizes agree (one rank's part per rank, in turn); where they
        # do not, the identities differ and nothing is shared.
        return open_remote_tier(parsed.remote, row_bytes, layout_identity(config, row_bytes))

    @property
    def remote(self) -> RemoteTier:
        """The remote tier (``tiers.remote.RemoteTier``)."""
        return cast("RemoteTier", self.store)

    def _stores_enabled(self) -> bool:
        return self.off_reason is None

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self.off_reason is not None:
            return _MISS
        remote = self.remote
        known = remote.known(key)
        if known is None:
            if remote.breaker.state is BreakerState.OPEN:
                return _MISS  # not asking a store that is not answering
            if not remote.probing(key):
                self._to_probe[key] = None
            self.counters["lookups_deferred"] += 1
            return _RETRY
        return _HIT if known else _MISS

    def flush_probes(self) -> None:
        """Send the probe of the keys queued by the lookups so far (one batch)."""
        if self._to_probe:
            keys, self._to_probe = list(self._to_probe), {}
            self.remote.probe(keys)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        # Every lookup of this step has been made: one probe for all of their unknown keys.
        self.flush_probes()

    def has_pending_work(self) -> bool:
        # A probe queued or in flight: keep the engine stepping, so that vLLM asks again.
        return super().has_pending_work() or bool(self._to_probe) or self.remote.stats()["probes_in_flight"] > 0

    def reset(self) -> None:
        self._to_probe = {}
        self.remote.forget()
        if self.off_reason is None:
            self.off_reason = "a cache reset: the shared store may hold blocks computed before it (old weights)"
            log.warning("kvtier: remote tier switched off for this process: %s", self.off_reason)

    def get_stats(self) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

        stats = OffloadingConnectorStats()
        now = {k: v for k, v in self.remote.stats().items() if isinstance(v, int)}
        now["switched_off"] = int(self.off_reason is not None)
        m.emit_remote_stats(stats, now, self._last_stats, self.remote.take_latencies())
        self._last_stats = now
        return stats


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
