"""Worker side: copies between TensorRT-LLM's KV pool and kvtier's tiers, driven by the
scheduler's metadata, through kvtier's TierOrchestrator and transfer engine.

Per iteration (TensorRT-LLM's order): ``bind_connector_meta`` -> ``start_load_kv`` (every load
of the step is submitted) -> per decoder layer ``wait_for_layer_load(i)`` / ``save_kv_layer(i)``
-> ``wait_for_save`` (the step's offloads are submitted, ordered after the forward pass on
CUDA) -> ``get_finished`` (requests whose offloads are done).

Loads: TensorRT-LLM's pool row holds every layer of a block (``[blocks, layers, kv, ...]``), and
kvtier's layout has one region per layer in that order, so a host slot is byte for byte the
device row. Each request's load is split into one transfer job per layer (region groups of the
orchestrator), submitted in layer order, so ``wait_for_layer_load(i)`` returns as soon as layer i
of every load of the step is in place, while later layers are still copying: layer i's attention
overlaps the copies of layers i+1.. (on CUDA the copy streams run beside the forward stream).

Async loads (``async_loads: "staged"``): the scheduler answered the request ``load_kv_async``
and TensorRT-LLM keeps it out of the batch while its reservation's reads fill CPU slots;
``get_finished`` reports it once they are in and TensorRT-LLM has announced it
(``started_loading_req_ids``), and the step it comes back in loads it like a CPU hit
(``async_loads.py``).
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvtier_rs._core import KvTierError
from kvtier_rs.checks import invalid_argument
from kvtier_rs.integrations.trtllm import shared
from kvtier_rs.integrations.trtllm.async_loads import SHORT_LOAD_CAUSES, AsyncLoads
from kvtier_rs.integrations.trtllm.config import READER, ConnectorOptions, load_options
from kvtier_rs.integrations.trtllm.metadata import KvtierConnectorMetadata, validate_metadata
from kvtier_rs.integrations.trtllm.scheduler import tokens_per_block_of
from kvtier_rs.orchestrator import TierOrchestrator
from kvtier_rs.tiers.build import open_data_path, open_disk, open_host_tier, open_remote
from kvtier_rs.transfer import BlockLayout, CpuTransferEngine, Region, TransferEngine

_PAGE = 4096


def layer_layout(kv_cache_tensor: torch.Tensor) -> BlockLayout:
    """One region per layer over TensorRT-LLM's pool ``[blocks, layers, kv_factor, ...]``
    (dim 0 = block id, each row contiguous)."""
    t = kv_cache_tensor
    if not isinstance(t, torch.Tensor) or t.dim() < 2:
        raise invalid_argument(
            "kv_cache_tensor",
            "expected the KV pool tensor [blocks, layers, ...], got "
            + (f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__),
        )
    if t.shape[0] and not t[0].is_contiguous():
        raise invalid_argument("kv_cache_tensor", "each block row (tensor[i]) must be contiguous")
    layers = t.shape[1]
    layer_bytes = t[0][0].numel() * t.element_size() if t.shape[0] else 0
    return BlockLayout(
        [Region.rows_of(t, offset_bytes=i * layer_bytes, bytes_per_block=layer_bytes) for i in range(layers)]
    )


def _rank_and_world(llm_args: Any) -> tuple[int, int]:
    pc = getattr(llm_args, "parallel_config", None)
    try:
        m = pc.to_mapping() if pc is not None else None
    except Exception:  # noqa: BLE001 - older llm_args without a mapping: assume one rank
        m = None
    rank = getattr(m, "rank", 0) if m is not None else 0
    world = getattr(m, "world_size", 1) if m is not None else 1
    return int(rank), int(world)


class WorkerCore:
    """Everything the worker does, independent of TensorRT-LLM's base class."""

    kvtier_config: dict | None = None
    #: Builds the transfer engine from (layout, host pool); None = by `io_engine`. Tests swap in
    #: an engine whose copies they can hold back.
    engine_factory: Callable[[BlockLayout, Any], TransferEngine] | None = None
    #: How many of the most recent load results `load_results` keeps (for inspection; a
    #: serving process must not keep one per request for good).
    keep_load_results: int = 256

    def _kvtier_init(self, llm_args: Any) -> None:
        self.options: ConnectorOptions = load_options(type(self).kvtier_config)
        self.tokens_per_block = tokens_per_block_of(llm_args)
        rank, world = _rank_and_world(llm_args)
        if world != 1:
            raise KvTierError(
                f"kvtier's TensorRT-LLM connector runs with one rank (tensor parallelism 1); this engine has "
                f"{world} ranks (this is rank {rank}). Each rank would need its own mirrored host pool."
            )
        self.engine = shared.engine_name(llm_args, self.options.namespace)
        self.tiers: shared.EngineTiers | None = None
        self._pending_loads: dict[Any, Any] = {}  # orchestrator request id -> LoadSpec
        # Loads of a step whose forward pass ended before its last layer (it failed, and
        # TensorRT-LLM failed its requests): still copying into blocks the engine may have given
        # to other requests since. Waited for, never reported (see _retire_pending_loads).
        self._stale_loads: dict[Any, Any] = {}
        self._loads_done = True
        # Async loads (LoadSpec.asynchronous): their requests wait outside the batch, so no layer
        # waits for them; get_finished reports each once TensorRT-LLM has announced it.
        self._async = AsyncLoads(self.options.load_timeout_s)
        self._save_jobs: dict[int, set[int]] = {}  # request id -> its offloads' copy jobs
        self._saving: set[int] = set()  # finished requests whose saves we must report
        self._known: set[int] = set()  # request ids seen in any SaveSpec
        # Bounded: one result per load would otherwise grow for the life of the engine.
        self.load_results: deque[Any] = deque(maxlen=type(self).keep_load_results)
        self.counts = {
            "loaded_blocks": 0,
            "offloaded_blocks": 0,
            "offload_no_space": 0,
            "offload_refused": 0,
            "finished_without_save": 0,  # reported finished with no save submitted (a failed step)
            "stale_loads": 0,  # loads of a failed step, landed (or failed) after it
        }

    if TYPE_CHECKING:
        # Provided by the connector base class: TensorRT-LLM's, or _FallbackWorkerBase without it.
        def get_connector_meta(self) -> object: ...
        def _clear_connector_meta(self) -> None: ...

    # ---- registration ------------------------------------------------------------------------
    def register_kv_caches(self, kv_cache_tensor: torch.Tensor) -> None:
        if self.tiers is not None:
            raise KvTierError("kvtier: register_kv_caches called twice")
        layout = layer_layout(kv_cache_tensor)
        o = self.options
        # What only the tiers can check (a capacity that holds no block of this engine's size, a
        # directory the disk tier cannot open) is reported under the key the user wrote.
        settings = o.settings
        assert settings is not None  # parse_options sets it
        host = open_host_tier(settings, layout.bytes_per_block, reader=READER)
        factory = type(self).engine_factory
        if factory is not None:
            engine = factory(layout, host.pool)
        elif o.io_engine == "cpu" or (o.io_engine == "auto" and layout.device.type != "cuda"):
            engine = CpuTransferEngine(layout, host.pool)
        else:
            from kvtier_rs.transfer.cuda import CudaTransferEngine

            engine = CudaTransferEngine(layout, host.pool)
        # One directory per engine name and block geometry under disk_root: a different model
        # or layout never reads another's blocks.
        sub = f"{self.engine.replace('/', '_')}_{layout.bytes_per_block}b_{len(layout.regions)}l"
        disk = None
        if settings.disk is not None:
            disk = open_disk(settings, host.pool.slot_bytes, path=Path(settings.disk.root) / sub, reader=READER)
        # The shared store's namespace: what every replica serving this model with this KV
        # geometry and byte layout agrees on (the same name and geometry as the directory above,
        # plus what a key is made of), never anything of this process.
        identity = json.dumps(
            {
                "engine": "tensorrt_llm",
                "namespace": self.engine,
                "tokens_per_block": self.tokens_per_block,
                "block_bytes": layout.bytes_per_block,
                "block_shape": list(kv_cache_tensor.shape[1:]),  # layers, K/V, heads, tokens, ...
                "dtype": str(kv_cache_tensor.dtype),
            },
            sort_keys=True,
        )
        remote = open_remote(settings, layout.bytes_per_block, identity)
        orch = open_data_path(
            settings,
            host,
            engine,
            tokens_per_block=self.tokens_per_block,
            block_bytes=layout.bytes_per_block,
            disk=disk,
            remote=remote,
        )
        self.tiers = shared.EngineTiers(orch, layout, len(layout.regions), self.tokens_per_block)
        shared.publish(self.engine, self.tiers)

    def register_kv_cache_layout(self, layout: Any) -> None:
        tensor = layout.as_single_pool_tensor() if hasattr(layout, "as_single_pool_tensor") else None
        if tensor is None:
            raise KvTierError(
                "kvtier's TensorRT-LLM connector needs a KV cache that one pool tensor describes "
                "(one layer group, one region)"
            )
        self.register_kv_caches(tensor)

    def register_forward_pass_callable(self) -> None:
        return None

    def _tiers(self, where: str) -> shared.EngineTiers:
        if self.tiers is None:
            raise KvTierError(f"kvtier: {where} before register_kv_caches")
        return self.tiers

    def _orch(self, where: str) -> TierOrchestrator:
        return self._tiers(where).orchestrator

    def _meta(self, where: str) -> KvtierConnectorMetadata | None:
        meta = self.get_connector_meta()
        if meta is None:
            return None
        return validate_metadata(meta, self.tiers.layout.num_blocks if self.tiers else 0)

    # ---- per iteration -----------------------------------------------------------------------
    def start_load_kv(self, stream: Any) -> None:
        tiers = self._tiers("start_load_kv")
        orch = tiers.orchestrator
        meta = self._meta("start_load_kv")
        # Loads of an earlier step still in flight: its forward pass failed before its last
        # layer. Their copies must land before this step's copies and forward pass touch the
        # same blocks. They are waited for, not raised about: this runs outside TensorRT-LLM's
        # forward error handler, where an exception would end the executor loop.
        self._retire_pending_loads()
        if self._stale_loads:
            self._poll_until(
                orch,
                lambda: not self._stale_loads,
                lambda: (
                    f"kvtier: loads of an earlier, failed step (requests "
                    f"{sorted(s.request_id for s in self._stale_loads.values())}) still copying after "
                    f"{self.options.load_timeout_s} s; not starting a step whose blocks they may overwrite"
                ),
            )
        self._loads_done = True
        if meta is None:
            return
        groups = [[layer] for layer in range(tiers.num_layers)]
        # Copies into the destination blocks wait for the work queued on the engine's stream:
        # a forward pass still running may read those blocks for the requests that held them.
        after = stream if tiers.layout.device.type == "cuda" else None
        for n, spec in enumerate(meta.loads):
            if spec.asynchronous:
                self._async.stage(spec)  # its request is parked: nothing is copied to the device
                continue
            # The scheduler reserved these blocks when it matched them (CPU hits pinned, disk
            # hits being read into reserved CPU slots): give the reservation its destinations.
            try:
                res = orch.bind(spec.reservation, list(spec.block_ids), region_groups=groups, after_stream=after)
            except BaseException:
                # The step stops here; this reservation and the later ones must not stay held
                # (the scheduler handed them over). A parked request's is watched instead: the
                # scheduler still owns it (it copies on the resume).
                for later in meta.loads[n:]:
                    if later.asynchronous:
                        self._async.stage(later)
                    elif orch.is_reserved(later.reservation):
                        orch.release(later.reservation)
                raise
            self._pending_loads[res.request_id] = spec
            self._loads_done = False

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        if self.tiers is None:
            raise KvTierError("kvtier: wait_for_layer_load before register_kv_caches")
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not 0 <= layer_idx < self.tiers.num_layers:
            raise invalid_argument(
                "layer_idx", f"{layer_idx!r} not in 0..{self.tiers.num_layers - 1} (layers of the registered KV pool)"
            )
        if self._loads_done:
            return
        orch = self.tiers.orchestrator

        def layer_landed() -> bool:
            # No load still in flight is missing layer `layer_idx`.
            return all((orch.groups_ready(rid) or 0) > layer_idx for rid in self._pending_loads)

        self._poll_until(
            orch,
            layer_landed,
            lambda: (
                f"kvtier: layer {layer_idx} of the loads for requests "
                f"{sorted(s.request_id for s in self._pending_loads.values())} "
                f"not in place after {self.options.load_timeout_s} s"
            ),
        )
        if not self._pending_loads:
            self._loads_done = True
        elif layer_idx == self.tiers.num_layers - 1:
            # Every layer has landed; the last completions are collected here so that failures
            # surface in this step, not the next.
            while self._pending_loads:
                self._collect(orch.poll())
                time.sleep(0.0002)
            self._loads_done = True

    def _poll_until(self, orch: Any, done: Callable[[], bool], timed_out: Callable[[], str]) -> None:
        """Collect finished loads until `done()`; KvTierError(timed_out()) after load_timeout_s.
        Polls at least once."""
        deadline = time.monotonic() + self.options.load_timeout_s
        while True:
            self._collect(orch.poll())
            if done():
                return
            if time.monotonic() > deadline:
                raise KvTierError(timed_out())
            time.sleep(0.0002)

    def _retire_pending_loads(self) -> None:
        """The step of the loads still pending is over (called between steps: its forward
        pass ended before its last layer, so it failed and TensorRT-LLM failed its requests).
        Their results concern no request any more: they are collected as stale, never raised."""
        self._stale_loads.update(self._pending_loads)
        self._pending_loads.clear()
        self._loads_done = True

    def _collect(self, results: list[Any]) -> None:
        # Every result of the batch is taken before a shortfall is raised: the orchestrator
        # reports each finished load once, so one left in _pending_loads here would stay there
        # for good (and every later start_load_kv would refuse to run).
        error = None
        for res in results:
            spec = self._pending_loads.pop(res.request_id, None)
            if spec is None:
                if self._stale_loads.pop(res.request_id, None) is not None:
                    self.counts["stale_loads"] += 1  # its request failed with its step
                continue
            self.load_results.append(res)
            if res.loaded != len(spec.keys):
                # Everything promised was held (see the scheduler), so only a fault gets here.
                error = error or KvTierError(
                    f"kvtier: request {spec.request_id}: {len(spec.keys) - res.loaded} of {len(spec.keys)} blocks "
                    f"failed to load ({SHORT_LOAD_CAUSES}); refusing to run the layer on missing KV"
                )
                continue
            self.counts["loaded_blocks"] += res.loaded
        if error is not None:
            raise error

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        # Offloads are whole blocks (every layer of a pool row), submitted once per step in
        # wait_for_save; nothing to do per layer.
        if self.tiers is None:
            raise KvTierError("kvtier: save_kv_layer before register_kv_caches")

    def wait_for_save(self, stream: Any) -> None:
        """Submit this step's offloads. They do not block: a CUDA copy is ordered after the
        forward pass on `stream`; completion is reported through get_finished."""
        tiers = self._tiers("wait_for_save")
        orch = tiers.orchestrator
        meta = self._meta("wait_for_save")
        if meta is None:
            return
        after = stream if tiers.layout.device.type == "cuda" else None
        for spec in meta.saves:
            self._known.add(spec.request_id)
            # One offload per run of equal (priority, duration): the orchestrator takes one hint per call.
            i = 0
            while i < len(spec.keys):
                j = i + 1
                hint = (spec.priorities[i], spec.durations_s[i])
                while j < len(spec.keys) and (spec.priorities[j], spec.durations_s[j]) == hint:
                    j += 1
                t = orch.offload(
                    list(spec.keys[i:j]),
                    list(spec.block_ids[i:j]),
                    priority=hint[0],
                    duration_s=hint[1],
                    after_stream=after,
                )
                if t.no_space:
                    self.counts["offload_no_space"] += j - i
                self.counts["offload_refused"] += len(t.refused)
                self.counts["offloaded_blocks"] += len(t.stored)
                if t.job_id is not None:
                    self._save_jobs.setdefault(spec.request_id, set()).add(t.job_id)
                i = j
        self._clear_connector_meta()

    def get_finished(
        self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]
    ) -> tuple[list[int], list[int]]:
        orch = self._orch("get_finished")
        self._async.announce(started_loading_req_ids)
        # An id with no save known here is not an error: the scheduler says a request saves once
        # it has put a SaveSpec in some step's metadata, and a forward pass that failed before
        # wait_for_save (TensorRT-LLM then fails every active request) never submitted it. Such
        # a request has nothing in flight and is reported finished below. Raising here (outside
        # the engine's forward error handler) ended the executor loop and left the request's
        # blocks allocated for good.
        self.counts["finished_without_save"] += sum(1 for r in finished_gen_req_ids if r not in self._known)
        self._saving.update(finished_gen_req_ids)
        # The forward pass is over; a successful one waited for every layer of every load, so a
        # load still pending belongs to a step that failed (a shortfall raised here, outside the
        # engine's forward error handler, would end the executor loop).
        self._retire_pending_loads()
        self._collect(orch.poll())  # completes finished stores in the CPU tier
        drop = self._tiers("get_finished").drop_finished_parked
        if drop is not None:
            drop()  # a parked request the engine finished is no staging to wait for
        loaded = self._async.report(orch)  # before the saves' bookkeeping: it may raise
        done = []
        for rid in sorted(self._saving):
            # Once its own copy jobs are over the engine's blocks are no longer read and may be
            # freed. (Not "none of its blocks is being written": a block can be written again
            # for unrelated work, a disk promotion or another request's store, and the request
            # waited for that too.)
            if all(orch.store_finished(job) for job in self._save_jobs.get(rid, ())):
                done.append(rid)
        for rid in done:
            self._saving.discard(rid)
            self._save_jobs.pop(rid, None)
            self._known.discard(rid)
        return done, loaded

    # ---- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        """Finish every job and release the tiers (tests; the engine process just exits)."""
        if self.tiers is None:
            return
        self.tiers.orchestrator.drain()
        self.tiers.orchestrator.engine.close()
        for stager in self.tiers.orchestrator.stagers.values():
            stager.disk.close()
        shared.withdraw(self.engine)
        self.tiers = None
