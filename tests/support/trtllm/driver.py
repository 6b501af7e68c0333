"""A test double of TensorRT-LLM's PyTorch executor, as far as the KV cache connector sees it.

It calls the connector in the engine's order and with its shapes (tensorrt_llm/_torch/pyexecutor:
py_executor.py, connectors/kv_cache_connector.py, resource_manager.py):

  scheduling:  get_num_new_matched_tokens(request, num_computed_tokens) -> update_state_after_alloc
  batch start: SchedulerOutput(new_requests, cached_requests) of RequestData deltas ->
               build_connector_meta (rank 0) -> pickled (MPI broadcast) -> bind_connector_meta ->
               start_load_kv(stream)
  forward:     per decoder layer wait_for_layer_load(i) before, save_kv_layer(i) after
  then:        wait_for_save(stream); request_finished(req, block_ids) for finished requests;
               get_finished(new finished-saving ids, new async-loading ids); blocks of requests
               reported done are freed.

Async loads (a request answered load_kv_async=True) as in the 2026 releases: the request keeps
its blocks but is left out of the SchedulerOutput and the forward pass (parked); its id is passed
once, in the next get_finished; once get_finished returns it, it is scheduled on the next step as
a new request whose computed_position already counts the loaded tokens, without being asked
again. Returning an id never passed in, or twice, fails (TensorRT-LLM's KeyError). A forward
error fails parked requests too and frees their blocks at once, without telling the connector
(PyExecutor._handle_errors as read in the 2026 source); a later report of their id is set aside.
A step whose
batch holds only requests just parked builds and binds its metadata and starts loads, but runs
no forward pass and no wait_for_save. A step with nothing scheduled only calls get_finished.

The KV pool is a real torch tensor [blocks, layers, 2, tokens_per_block * heads * dim] (dim 0 =
block id, TensorRT-LLM's get_unique_primary_pool shape). The "model" writes, for every token it
computes, KV that is a pure function of the token prefix and the layer, and before running a
layer it checks that every block of the batch holds exactly that KV for the layer, so a wrong,
missing or late load fails the forward pass. Freed blocks are overwritten with garbage at once,
so a block freed while kvtier still copies it would be caught. Only the engine is faked: the
connector, orchestrator, tiers and transfer engine are kvtier's real ones.
"""

from __future__ import annotations

import hashlib
import pickle
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch


@dataclass
class RequestData:  # field for field as tensorrt_llm's (2026 release, V1 KV cache manager)
    request_id: int
    new_tokens: list[int]
    new_block_ids: list[int]
    computed_position: int
    num_scheduled_tokens: int
    block_hashes: list[int] = field(default_factory=list)
    priorities: list[int] | None = None
    cache_salt: str | None = None
    new_block_ids_by_layer_group: list[list[int]] = field(default_factory=list)


@dataclass
class LegacyRequestData:  # tensorrt_llm 1.2's: no block_hashes, priorities, cache_salt
    request_id: int
    new_tokens: list[int]
    new_block_ids: list[int]
    computed_position: int
    num_scheduled_tokens: int


@dataclass
class SchedulerOutput:
    new_requests: list[RequestData] = field(default_factory=list)
    cached_requests: list[RequestData] = field(default_factory=list)
    attention_dp_rank: int | None = None


@dataclass
class TokenRange:  # KvCacheRetentionConfig.TokenRangeRetentionConfig
    token_start: int
    token_end: int | None
    priority: int
    duration_ms: Any = None  # datetime.timedelta in the bindings


@dataclass
class Retention:  # KvCacheRetentionConfig
    token_range_retention_configs: list[TokenRange]
    decode_retention_priority: int = 35
    decode_duration_ms: Any = None


class Request:
    """The LlmRequest attributes connectors read."""

    def __init__(self, request_id, prompt, max_new_tokens=1, retention=None, cache_salt=None):
        self.request_id = request_id
        self.py_request_id = request_id
        self.tokens = list(prompt)
        self.prompt_len = len(prompt)
        self.max_new_tokens = max_new_tokens
        self.kv_cache_retention_config = retention
        self.cache_salt = cache_salt
        self.lora_task_id = None
        self.multimodal_hashes = None
        self.is_generation_only_request = False
        self.context_current_position = 0
        self.state = "CONTEXT_INIT"
        self.block_ids: list[int] = []
        self.reported_blocks = 0
        self.reported_tokens = 0
        self.generated = 0
        self.external = 0

    def get_tokens(self, beam):
        assert beam == 0
        return list(self.tokens)

    @property
    def is_finished(self):  # LlmRequest.is_finished: state GENERATION_COMPLETE
        return self.state == "GENERATION_COMPLETE"


def standin_engine_hash(tokens, parent, lora, salt_id):
    """Stands in for TensorRT-LLM's BlockKeyHasher (not installable here): a 64-bit hash chained
    over the parent hash, LoRA task, salt id (first block) and the block's tokens."""
    h = hashlib.blake2b(repr((parent, lora, salt_id, [int(t) for t in tokens])).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little")


def llm_args(tokens_per_block, model="tiny-model"):
    return SimpleNamespace(
        model=model,
        kv_cache_config=SimpleNamespace(tokens_per_block=tokens_per_block, enable_block_reuse=True),
        parallel_config=None,
    )


class Engine:
    def __init__(
        self,
        scheduler,
        worker,
        *,
        num_blocks=64,
        layers=3,
        tokens_per_block=4,
        width=24,
        dtype=torch.float16,
        block_hasher=None,
        request_data="v1",
    ):
        """`block_hasher`: when set, RequestData carries the engine's block_hashes computed with
        it (as releases from mid-2026 do with the V1 KV cache manager); else they are empty.
        `request_data`: "v1" (2026 release, V1 KV cache manager: per-block priorities), "v2"
        (KV cache manager V2, which ignores retention configs: priorities always None) or
        "legacy" (1.2's RequestData: its five fields, no priorities at all)."""
        self.request_data = request_data
        self.sched, self.worker = scheduler, worker
        self.block_hasher = block_hasher
        self.tpb, self.layers = tokens_per_block, layers
        self.pool = torch.zeros(num_blocks, layers, 2, tokens_per_block * width, dtype=dtype)
        self.width = width
        self.free = list(range(num_blocks))
        self.running: dict[int, Request] = {}
        self.saving: dict[int, Request] = {}  # finished, blocks kept until get_finished says done
        self.new_saving: list[int] = []
        self.parked: dict[int, Request] = {}  # waiting for an async load, out of every batch
        self.new_loading: list[int] = []  # parked since the last get_finished
        self.announced_loading: set[int] = set()  # passed to get_finished, not yet returned
        self.dropped_loading: set[int] = set()  # parked, then failed: a late report is set aside
        self.matched: dict[int, int] = {}  # request id -> connector-matched tokens
        self.layer_calls: list[tuple[str, int]] = []
        self.forward_errors: list[BaseException] = []
        self.worker.register_kv_caches(self.pool)

    # ---- the "model" ---------------------------------------------------------------------------
    def token_kv(self, prefix: list[int], layer: int) -> torch.Tensor:
        """KV of the last token of `prefix` at `layer`: [2, width], a function of prefix and layer."""
        d = hashlib.blake2b(repr((tuple(prefix), layer)).encode(), digest_size=8).digest()
        g = torch.Generator().manual_seed(int.from_bytes(d, "little") >> 1)
        return torch.randn(2, self.width, generator=g).to(self.pool.dtype)

    def block_hashes(self, req):
        """The engine's cumulative hash chain over the request's full blocks."""
        if self.block_hasher is None:
            return []
        out, parent = [], 0
        for i in range(len(req.tokens) // self.tpb):
            salt = getattr(req, "cache_salt_id", None) if i == 0 else None
            parent = self.block_hasher(req.tokens[i * self.tpb : (i + 1) * self.tpb], parent, req.lora_task_id, salt)
            out.append(parent)
        return out

    def _slot(self, block, pos, layer):
        off = (pos % self.tpb) * self.width
        return self.pool[block, layer, :, off : off + self.width]

    def priority_of(self, req: Request, block: int) -> int:
        """What the engine's get_priority_by_block_id reports (its own reading of the config)."""
        cfg = req.kv_cache_retention_config
        lo, hi = block * self.tpb, (block + 1) * self.tpb
        if lo >= req.prompt_len:
            return cfg.decode_retention_priority
        for r in cfg.token_range_retention_configs:
            if r.token_start < hi and (r.token_end is None or lo < r.token_end):
                return r.priority
        return 35

    # ---- one iteration -------------------------------------------------------------------------
    def step(self, new_requests=(), *, gpu_matched=None, finish=(), model_error_at_layer=None, handle_errors=False):
        """Schedule `new_requests` (whole prompt in one chunk) and one decode token for each
        running one; finish the requests named in `finish` after the step. Returns the metadata.

        `handle_errors`: an error in the forward pass (the model's, or the connector's
        wait_for_layer_load / save_kv_layer / wait_for_save) is handled as
        PyExecutor._forward_step does: caught, every active request terminated
        (request_finished, then freed unless it saves asynchronously), and the loop goes on to
        get_finished. The error is kept in `forward_errors`. start_load_kv and get_finished run
        outside that handler, as in TensorRT-LLM: their errors propagate. The driver's own KV
        checks (AssertionError) always propagate. Off by default, so that a connector error in
        any other test fails it. `model_error_at_layer`: the model raises in that layer (after
        its wait_for_layer_load); implies handle_errors."""
        handle_errors = handle_errors or model_error_at_layer is not None
        gpu_matched = gpu_matched or {}
        out = SchedulerOutput()
        computing: list[tuple[Request, int, int]] = []  # (req, first pos, end pos) computed now
        parked_now = any([self._schedule(req, gpu_matched.get(req.request_id, 0)) for req in new_requests])
        for req in list(self.running.values()):
            if req.state == "CONTEXT_INIT":
                start = req.context_current_position
                data = self._request_data(
                    req.request_id,
                    req.get_tokens(0),
                    list(req.block_ids),
                    start - req.external,
                    req.prompt_len - start,
                    block_hashes=self.block_hashes(req),
                    priorities=None
                    if req.kv_cache_retention_config is None or self.request_data == "v2"
                    else [self.priority_of(req, i) for i in range(len(req.block_ids))],
                    cache_salt=req.cache_salt,
                )
                req.reported_tokens = len(req.tokens)
                out.new_requests.append(data)
                computing.append((req, start, req.prompt_len))
            else:
                new_tokens = req.tokens[req.reported_tokens :]
                req.reported_tokens = len(req.tokens)
                data = self._request_data(
                    req.request_id,
                    new_tokens,
                    [],
                    len(req.tokens) - 1,
                    1,
                    block_hashes=self.block_hashes(req),
                    cache_salt=req.cache_salt,
                )
                out.cached_requests.append(data)
                computing.append((req, len(req.tokens) - 1, len(req.tokens)))
        if not new_requests and not computing:
            # Nothing scheduled: the executor skips the batch (no metadata, no forward pass)
            # and only asks get_finished, as it does at the end of every iteration.
            self.poll_finished()
            return None
        meta = self.sched.build_connector_meta(out)
        meta = pickle.loads(pickle.dumps(meta))  # the MPI broadcast
        self.worker.bind_connector_meta(meta)
        self.worker.start_load_kv(None)
        if parked_now and not computing:  # the batch emptied when its requests were parked
            self.poll_finished()
            return meta
        try:
            self._forward(computing, model_error_at_layer)
        except AssertionError:
            raise  # wrong KV reached attention: the test fails
        except Exception as e:  # PyExecutor._forward_step's handler
            if not handle_errors:
                raise
            self.forward_errors.append(e)
            self._handle_errors()
            self.poll_finished()
            return meta
        for req, _, _ in computing:  # sampling
            if req.state == "CONTEXT_INIT":
                req.state = "GENERATION_IN_PROGRESS"
            req.tokens.append(1000 + (sum(req.tokens) * 31 + req.generated) % 997)
            req.generated += 1
        for rid in finish:
            self._terminate(self.running.pop(rid))
        self.poll_finished()
        return meta

    def _schedule(self, req, nct):
        """Match and allocate a new request (`nct` tokens matched by the engine itself); True
        if it was answered load_kv_async and is parked."""
        n, load_async = self.sched.get_num_new_matched_tokens(req, nct)
        if n == 0 and load_async:
            raise RuntimeError("load_kv_async must be False when num_tokens is 0!")
        req.external = 0 if load_async else n  # a parked request comes back with n counted
        self.matched[req.request_id] = n
        need = -(-(req.prompt_len + req.max_new_tokens + 8) // self.tpb)  # room for a few decode steps
        req.block_ids = [self.free.pop(0) for _ in range(need)]
        if nct:  # blocks TensorRT-LLM reused itself: fill them as its radix tree would
            for pos in range(nct):
                for layer in range(self.layers):
                    self._slot(req.block_ids[pos // self.tpb], pos, layer).copy_(
                        self.token_kv(req.tokens[: pos + 1], layer)
                    )
        self.sched.update_state_after_alloc(req, list(req.block_ids))
        req.context_current_position = nct + n
        if not load_async:
            self.running[req.request_id] = req
            return False
        req.state = "DISAGG_GENERATION_TRANS_IN_PROGRESS"
        self.parked[req.request_id] = req
        self.new_loading.append(req.request_id)
        return True

    def _request_data(self, *args, **kwargs):
        if self.request_data == "legacy":
            return LegacyRequestData(*args)
        return RequestData(*args, **kwargs)

    def _terminate(self, req):
        if self.sched.request_finished(req, list(req.block_ids)):
            self.saving[req.request_id] = req
            self.new_saving.append(req.request_id)
        else:
            self._free(req)

    def _handle_errors(self):
        """PyExecutor._handle_errors: every active request fails and is terminated. Parked ones
        (waiting for an async load) too, and their blocks are freed at once, without a
        connector call (no request_finished: only the batch's requests get one)."""
        for rid in list(self.running):
            self.running[rid].state = "GENERATION_COMPLETE"
            self._terminate(self.running.pop(rid))
        for rid in list(self.parked):
            self.parked[rid].state = "GENERATION_COMPLETE"
            self._free(self.parked.pop(rid))
            self.dropped_loading.add(rid)

    def cancel_parked(self, rid):
        """A client cancels request `rid` while it is parked for an async load: without a KV
        transceiver the executor does not wait for the load (_try_cancel_request), and the
        request is terminated and freed without a connector call."""
        req = self.parked.pop(rid)
        req.state = "GENERATION_COMPLETE"
        self._free(req)
        self.dropped_loading.add(rid)

    def _forward(self, computing, model_error_at_layer):
        for layer in range(self.layers):
            self.layer_calls.append(("wait", layer))
            self.worker.wait_for_layer_load(layer, None)
            if layer == model_error_at_layer:
                raise RuntimeError(f"model error in layer {layer}")
            for req, lo, hi in computing:
                # Attention reads every earlier token's KV at this layer: it must all be there.
                for pos in range(lo):
                    got = self._slot(req.block_ids[pos // self.tpb], pos, layer)
                    want = self.token_kv(req.tokens[: pos + 1], layer)
                    if not torch.equal(got, want):
                        raise AssertionError(f"request {req.request_id}: layer {layer} KV of token {pos} is wrong")
                for pos in range(lo, hi):
                    self._slot(req.block_ids[pos // self.tpb], pos, layer).copy_(
                        self.token_kv(req.tokens[: pos + 1], layer)
                    )
            self.worker.save_kv_layer(layer, None)
            self.layer_calls.append(("save", layer))
        self.worker.wait_for_save(None)

    def poll_finished(self):
        ids, self.new_saving = self.new_saving, []
        loading, self.new_loading = self.new_loading, []
        self.announced_loading.update(loading)
        done_saving, done_loading = self.worker.get_finished(ids, loading)
        for rid in done_loading:
            assert rid in self.announced_loading, f"get_finished returned loading id {rid}, not waiting to be"
            self.announced_loading.discard(rid)
            if rid in self.dropped_loading:  # failed while parked: its manager entry is set aside
                self.dropped_loading.discard(rid)
                continue
            req = self.parked.pop(rid)
            req.state = "CONTEXT_INIT"  # scheduled on the next step, as a new request
            self.running[rid] = req
        for rid in done_saving:
            assert rid in self.saving, f"get_finished returned {rid}, never passed in"
            self._free(self.saving.pop(rid))
        return done_saving

    def _free(self, req):
        # Poison: a block still being copied by kvtier would be read as garbage.
        for b in req.block_ids:
            self.pool[b].fill_(float("nan"))
        self.free += req.block_ids
        req.block_ids = []

    def wait_loaded(self, rid):
        """Call get_finished (as the executor does at the end of each step) until parked request
        `rid` has been reported loaded; it is then running, to be scheduled on the next step."""
        deadline = time.monotonic() + 60  # far beyond any stall; spent only when kvtier is broken
        while rid in self.parked:
            # get_finished polls the orchestrator itself (orchestrator.drain would take the
            # load's result away from the worker).
            self.poll_finished()
            assert time.monotonic() < deadline, f"request {rid}'s async load was never reported"
            time.sleep(0.001)

    def run_request(self, req, *, gpu_matched=0):
        """Prefill, one decode step, finish; then wait until its saves are reported."""
        self.step([req], gpu_matched={req.request_id: gpu_matched})
        self.step(finish=[req.request_id])
        for _ in range(2000):
            if req.request_id not in self.saving:
                return
            self.worker.tiers.orchestrator.drain()
            self.poll_finished()
        raise AssertionError(f"request {req.request_id} never reported its saves finished")
