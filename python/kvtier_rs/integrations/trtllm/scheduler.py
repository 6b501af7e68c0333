"""Scheduler side (rank 0): match prompts against kvtier's tiers, and say per iteration what each
worker loads and saves (``KvtierConnectorMetadata``)."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

from kvtier_rs._core import InvalidArgumentError, KvTierError
from kvtier_rs.checks import invalid_argument
from kvtier_rs.integrations.trtllm import shared
from kvtier_rs.integrations.trtllm.config import ConnectorOptions, load_options
from kvtier_rs.integrations.trtllm.identity import HASH_MASK, block_identity
from kvtier_rs.integrations.trtllm.metadata import (
    DEFAULT_PRIORITY,
    KvtierConnectorMetadata,
    LoadSpec,
    ReservationId,
    SaveSpec,
    block_retention,
)

log = logging.getLogger(__name__)


def tokens_per_block_of(llm_args: Any) -> int:
    kv = getattr(llm_args, "kv_cache_config", None)
    tpb = getattr(kv, "tokens_per_block", None)
    if isinstance(tpb, bool) or not isinstance(tpb, int) or tpb < 1:
        raise invalid_argument("llm_args.kv_cache_config.tokens_per_block", f"expected a positive int, got {tpb!r}")
    if getattr(kv, "enable_block_reuse", True) is False:
        raise invalid_argument(
            "llm_args.kv_cache_config.enable_block_reuse",
            "TensorRT-LLM ignores a KV cache connector when block reuse is off; set enable_block_reuse=True",
        )
    return tpb


@dataclass
class _Req:
    salt: Any
    lora: Any
    prompt_len: int
    retention: Any
    tokens: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)  # of full blocks known so far
    block_ids: list[int] = field(default_factory=list)
    # engine-reported, per block id; None: the release reports none (read the retention config)
    priorities: list[int | None] = field(default_factory=list)
    gpu_blocks: int = 0  # blocks TensorRT-LLM matched itself
    external_tokens: int = 0
    load_keys: list[bytes] = field(default_factory=list)
    reservation: ReservationId | None = None  # the load's blocks, held until the worker binds them
    load_dst: list[int] | None = None
    load_async: bool = False  # answered load_kv_async: waits outside the batch for its load
    saved: int = 0  # leading blocks already handed to a SaveSpec (or skipped as GPU/loaded)
    stopped: bool = False  # a block fell below min_offload_priority: nothing later is offloaded
    renew_only: bool = False  # stopped by priority: later blocks held by kvtier are still renewed
    unkeyed: bool = False  # its block identity cannot be reproduced: never matched or saved
    hashes_checked: int = 0  # leading keys checked against the engine's block_hashes
    request: Any = None  # the engine's request object (LlmRequest), read for is_finished
    ever_saved: bool = False
    seen: bool = False  # reported in a SchedulerOutput


class SchedulerCore:
    """Everything the scheduler does, independent of TensorRT-LLM's base class."""

    kvtier_config: dict | None = None

    def _kvtier_init(self, llm_args: Any) -> None:
        self.options: ConnectorOptions = load_options(type(self).kvtier_config)
        self.tokens_per_block = tokens_per_block_of(llm_args)
        self.engine = shared.engine_name(llm_args, self.options.namespace)
        self.namespace = self.engine
        self.identity = block_identity(self.options.block_identity, self.namespace, self.tokens_per_block)
        self._reqs: dict[int, _Req] = {}
        self._steps = itertools.count()
        self._reservations = itertools.count()  # one id per reservation, never reused
        # Requests answered load_kv_async whose blocks are allocated: TensorRT-LLM leaves them out
        # of every SchedulerOutput until their staging is reported, so the next metadata carries
        # their staging whatever the output holds.
        self._async_to_start: list[int] = []
        # Parked requests (their staging handed to the worker): TensorRT-LLM fails or cancels a
        # parked request without a connector call, so each iteration looks for the finished
        # ones (_drop_finished_parked), or their reservations would pin CPU slots for good.
        self._parked: set[int] = set()
        self.counts = {
            "matched_blocks": 0,
            "saved_blocks": 0,
            "below_min_priority_blocks": 0,
            "unkeyed_requests": 0,
            "engine_hash_mismatches": 0,
            "abandoned_loads": 0,
        }

    # ---- helpers ----------------------------------------------------------------------------
    def _tiers(self) -> shared.EngineTiers:
        t = shared.lookup(self.engine)
        if t is None:
            raise KvTierError(
                f"kvtier: no KV pool registered for engine {self.engine!r} in this process. The "
                "worker's register_kv_caches must run first, in the scheduler's process "
                "(kvtier's TensorRT-LLM connector needs tensor parallelism 1)"
            )
        if t.tokens_per_block != self.tokens_per_block:
            raise KvTierError(
                f"kvtier: worker uses {t.tokens_per_block} tokens per block, scheduler {self.tokens_per_block}"
            )
        return t

    def _req(self, request_id: int, where: str) -> _Req:
        r = self._reqs.get(request_id)
        if r is None:
            raise InvalidArgumentError(
                f"invalid argument `request` in {where}: request {request_id} is unknown to kvtier "
                "(get_num_new_matched_tokens was never called for it)"
            )
        return r

    def _extend_keys(self, r: _Req) -> None:
        full = len(r.tokens) // self.tokens_per_block
        if full > len(r.keys) and not r.unkeyed:
            parent = r.keys[-1] if r.keys else None
            more = self.identity.extend(parent, r.tokens, len(r.keys), full - len(r.keys), r.lora, r.salt)
            if more is None:
                r.unkeyed = r.stopped = True
                self.counts["unkeyed_requests"] += 1
            else:
                r.keys += more

    def _check_engine_hashes(self, rid: int, r: _Req, hashes: list[int]) -> None:
        """Compare kvtier's keys with the engine's own block hashes (cumulative, block i at
        index i). A difference stops saving the request: kvtier must not file KV under a name
        the engine would not give it."""
        n = min(len(hashes), len(r.keys))
        if self.identity.scheme != "engine" or r.stopped or n <= r.hashes_checked:
            return
        mine = [self.identity.engine_hash(k) for k in r.keys[r.hashes_checked : n]]
        theirs = [int(h) & HASH_MASK for h in hashes[r.hashes_checked : n]]
        if mine != theirs:
            first = r.hashes_checked + next(i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b)
            r.stopped = True
            self.counts["engine_hash_mismatches"] += 1
            log.warning(
                "kvtier: request %s block %d: kvtier's hash %#x differs from the engine's %#x; not saving it",
                rid,
                first,
                mine[first - r.hashes_checked],
                theirs[first - r.hashes_checked],
            )
        r.hashes_checked = n

    def _release_reservation(self, r: _Req) -> None:
        if r.reservation is not None:
            t = shared.lookup(self.engine)
            if t is not None:
                t.orchestrator.release(r.reservation)
            r.reservation = None

    # ---- TensorRT-LLM interface --------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if isinstance(num_computed_tokens, bool) or not isinstance(num_computed_tokens, int) or num_computed_tokens < 0:
            raise invalid_argument("num_computed_tokens", f"expected a non-negative int, got {num_computed_tokens!r}")
        rid = request.request_id
        old = self._reqs.pop(rid, None)
        if old is not None:  # asked again (a reset or replay): start over
            self._parked.discard(rid)
            self._release_reservation(old)
        tokens = list(request.get_tokens(0))
        salt = getattr(request, "cache_salt_id", None)
        if salt is None:
            salt = getattr(request, "cache_salt", None)
        r = _Req(
            salt=salt,
            lora=getattr(request, "lora_task_id", None),
            prompt_len=len(tokens),
            retention=getattr(request, "kv_cache_retention_config", None),
            tokens=tokens,
        )
        self._reqs[rid] = r
        tpb = self.tokens_per_block
        if num_computed_tokens > len(tokens):
            raise invalid_argument("num_computed_tokens", f"{num_computed_tokens} > prompt length {len(tokens)}")
        self._extend_keys(r)
        if r.unkeyed:
            return 0, False
        # The engine recomputes at least the prompt's last token (it needs its logits), so only
        # blocks ending before it can be served.
        usable = (len(tokens) - 1) // tpb
        r.gpu_blocks = min(num_computed_tokens // tpb, usable)
        if getattr(request, "multimodal_hashes", None) or usable <= r.gpu_blocks:
            # Multimodal prompts: token ids alone do not identify the KV (kvtier cannot see the
            # media hashes consistently), so such requests are neither matched nor saved.
            r.stopped = bool(getattr(request, "multimodal_hashes", None))
            return 0, False
        orch = self._tiers().orchestrator
        if self.options.remote_probe_wait_s is not None:
            # TensorRT-LLM asks once per request: the remote tier's answer must be in before the
            # plan, or the blocks it holds would be recomputed. One batched round trip, waited
            # for a few ms at most; a late answer serves the next request.
            orch.probe(r.keys[:usable], r.gpu_blocks, wait_s=self.options.remote_probe_wait_s)
        # The scheduling decision: plan() counts it (one lookup, its hits, misses and refusals),
        # also when nothing is worth loading and the worker never sees this request. Asked again
        # for the same request on a later step (a reset, a replay, or a request that did not fit
        # yet), it is a new lookup and counted again.
        plan = orch.plan(r.keys[:usable], r.gpu_blocks)
        if plan.loaded == 0:
            return 0, False
        # The engine will treat the tokens answered here as computed, and TensorRT-LLM has no
        # way to report a load that fell short: so answer only what is held now. The CPU hits
        # are pinned; the disk hits get CPU slots to stage through and their reads start at
        # once; so do the remote hits' (a block the store evicted since the probe, or whose value
        # does not verify, then fails the load: TensorRT-LLM cannot take a promise back). A
        # staged hit with no CPU slot free is recomputed instead of promised.
        res = orch.reserve(
            r.keys[:usable],
            request_id=("trtllm", rid, next(self._reservations)),
            gpu_hit_blocks=r.gpu_blocks,
            plan=plan,
        )
        n = res.blocks
        if n == 0:
            orch.release(res.request_id)
            return 0, False
        r.reservation = res.request_id
        r.load_keys = r.keys[r.gpu_blocks : r.gpu_blocks + n]
        r.external_tokens = (r.gpu_blocks + n) * tpb - num_computed_tokens
        self.counts["matched_blocks"] += n
        # A load that reads from a staged tier can take a network round trip or a slow disk:
        # with async loads the request waits outside the batch instead of every layer of the
        # step waiting for it. CPU hits copy at memory speed and stay overlapped per layer.
        r.load_async = self.options.async_loads == "staged" and res.disk + res.remote > 0
        if r.load_async:
            r.request = request  # read for is_finished while it is parked; dropped on its return
        return r.external_tokens, r.load_async

    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        r = self._req(request.request_id, "update_state_after_alloc")
        ids = [int(b) for b in block_ids]
        if r.load_keys:
            need = r.gpu_blocks + len(r.load_keys)
            if len(ids) < need:
                raise invalid_argument(
                    "block_ids",
                    f"{len(ids)} blocks allocated for request "
                    f"{request.request_id}, which needs {need} (GPU-matched + loaded)",
                )
            if any(b < 0 for b in ids[r.gpu_blocks : need]):
                raise invalid_argument("block_ids", "-1 (no page) where kvtier must load a block")
            r.load_dst = ids[r.gpu_blocks : need]
            if r.load_async:
                self._async_to_start.append(request.request_id)

    def update_state_after_alloc_by_layer_group(self, request: Any, block_ids_by_layer_group: list[list[int]]) -> None:
        if len(block_ids_by_layer_group) != 1:
            raise KvTierError(
                f"kvtier's TensorRT-LLM connector supports one layer group, got {len(block_ids_by_layer_group)} "
                "(variable sliding-window attention is not supported)"
            )
        self.update_state_after_alloc(request, block_ids_by_layer_group[0])

    def build_connector_meta(self, scheduler_output: Any) -> KvtierConnectorMetadata:
        loads: list[LoadSpec] = []
        saves: list[SaveSpec] = []
        new = list(getattr(scheduler_output, "new_requests", None) or ())
        cached = list(getattr(scheduler_output, "cached_requests", None) or ())
        for data, is_new in [(d, True) for d in new] + [(d, False) for d in cached]:
            r = self._req(data.request_id, "build_connector_meta")
            if is_new and r.seen:
                raise invalid_argument("scheduler_output", f"request {data.request_id} is in new_requests twice")
            if is_new:
                # new_tokens of a new request is its whole token list so far: the prompt we saw.
                r.tokens = list(data.new_tokens)
            else:
                if not r.seen and data.request_id in self._parked:
                    # A parked request back among the cached requests: what its new tokens and
                    # block ids cover is not known here, so none of it is saved (its load goes).
                    r.stopped = True
                    log.warning("kvtier: request %s came back from its async load as a cached request", data.request_id)
                r.tokens += list(data.new_tokens)
            r.seen = True
            new_ids = [int(b) for b in data.new_block_ids]
            prios = getattr(data, "priorities", None)
            if prios is not None and len(prios) != len(new_ids):
                raise invalid_argument(
                    "scheduler_output",
                    f"request {data.request_id} has {len(prios)} priorities for {len(new_ids)} new block ids",
                )
            r.block_ids += new_ids
            if prios is not None:
                r.priorities += list(prios)
            elif hasattr(data, "priorities"):
                # The release reports priorities, and None means the engine keeps these blocks
                # at the default: KV cache manager V2 ignores KvCacheRetentionConfig altogether.
                # Reading the request's config here held blocks the engine keeps at 35 below
                # min_offload_priority (never offloaded) or above other blocks in kvtier's tiers.
                r.priorities += [DEFAULT_PRIORITY] * len(new_ids)
            else:
                # A release without the field (1.2): its V1 manager applies the request's
                # retention config, which _retention reads for these blocks.
                r.priorities += [None] * len(new_ids)
            self._extend_keys(r)
            hashes = getattr(data, "block_hashes", None)
            if hashes:
                self._check_engine_hashes(data.request_id, r, list(hashes))
            # A parked request's load goes with its first appearance after the report, new (as
            # the releases read do) or not: the engine counts its tokens as computed either way.
            if r.load_keys and (is_new or data.request_id in self._parked):
                if r.load_dst is None:
                    raise KvTierError(
                        f"kvtier: request {data.request_id} has a load but update_state_after_alloc never ran"
                    )
                # A request back from an async load copies here, synchronously, from the CPU
                # slots its staging filled: only now is it in the batch, so only now are its
                # device blocks surely its own (see _stage_spec).
                loads.append(self._take_load(data.request_id, r))
            # Blocks whose KV is complete after this forward pass. computed_position of a new
            # request excludes what the connector matched synchronously; add it back. A request
            # back from an async load comes as new with its loaded tokens already counted.
            loaded = r.external_tokens if is_new and not r.load_async else 0
            valid = data.computed_position + data.num_scheduled_tokens + loaded
            spec = self._save_spec(data.request_id, r, valid // self.tokens_per_block)
            if spec is not None:
                saves.append(spec)
        for rid in dict.fromkeys(self._async_to_start):  # once each, in order
            held = self._reqs.get(rid)
            if held is not None and held.load_keys:  # not finished since its blocks were allocated
                loads.append(self._stage_spec(rid, held))
        self._async_to_start.clear()
        return KvtierConnectorMetadata(next(self._steps), tuple(loads), tuple(saves))

    def _take_load(self, rid: int, r: _Req) -> LoadSpec:
        """The request's load, handed to the worker (which binds its reservation; the
        orchestrator unpins the blocks once loaded)."""
        assert r.reservation is not None and r.load_dst is not None
        spec = LoadSpec(rid, tuple(r.load_keys), tuple(r.load_dst), r.reservation)
        r.reservation = None
        r.load_keys = []
        r.request = None
        self._parked.discard(rid)
        return spec

    def _stage_spec(self, rid: int, r: _Req) -> LoadSpec:
        """A parked request's staging, for the worker to watch and report: its reservation's
        reads fill CPU slots, and nothing is copied to the device until the request is back in
        a batch (`_take_load`, the step it resumes). TensorRT-LLM frees a parked request's
        blocks at once when it fails or cancels it, without telling the connector; a copy
        started while it is parked could land in blocks already given to another request."""
        assert r.reservation is not None and r.load_dst is not None
        self._parked.add(rid)
        # Checked from the worker's get_finished, which runs every iteration, idle ones too
        # (build_connector_meta does not run while nothing is scheduled).
        self._tiers().drop_finished_parked = self._drop_finished_parked
        return LoadSpec(rid, tuple(r.load_keys), tuple(r.load_dst), r.reservation, asynchronous=True)

    def _drop_finished_parked(self) -> None:
        """Forget the parked requests TensorRT-LLM has finished (its error handler fails parked
        requests too, a cancel finishes them) without a connector call; their reservations are
        given back. A request whose staging was reported but that waits for room in a batch
        is not finished, however long it waits."""
        for rid in [rid for rid in self._parked if getattr(self._reqs[rid].request, "is_finished", False)]:
            self._parked.discard(rid)
            self._release_reservation(self._reqs.pop(rid))
            self.counts["abandoned_loads"] += 1
            log.warning(
                "kvtier: request %s was finished by TensorRT-LLM (failed or cancelled) while it waited for "
                "its async load; its reserved blocks are released",
                rid,
            )

    def _retention(self, r: _Req, block: int) -> tuple[int, float | None]:
        """(priority, duration_s) of one of the request's blocks."""
        prio, dur = block_retention(r.retention, r.prompt_len, self.tokens_per_block, block)
        engine_prio = r.priorities[block]
        if engine_prio is not None:
            prio = int(engine_prio)  # the engine's own view of the block wins
        return prio, dur

    def _renew_held(self, r: _Req, first: int, upto: int) -> None:
        """Blocks first..upto of a request that kvtier does not offload (below the minimum
        priority, or after such a block): copies kvtier holds from an earlier claim still take
        this claim's priorities, since a later claim overrides an earlier one. Tail first, as a
        store ranks a chain, so that the head stays the more recent."""
        orch = self._tiers().orchestrator
        for j in reversed(range(first, upto)):
            prio, dur = self._retention(r, j)
            orch.renew(r.keys[j : j + 1], priority=prio, duration_s=dur)

    def _save_spec(self, rid: int, r: _Req, complete: int) -> SaveSpec | None:
        upto = min(complete, len(r.keys), len(r.block_ids))
        if r.stopped:
            if r.renew_only and upto > r.saved:  # later chunks of a prompt, say
                self._renew_held(r, r.saved, upto)
                r.saved = upto
            return None
        keys, ids, prios, durs = [], [], [], []
        for i in range(r.saved, upto):
            prio, dur = self._retention(r, i)
            if prio < self.options.min_offload_priority:
                # Below the minimum: never offloaded, and neither is anything after it (a chain
                # with a hole cannot be matched past the hole, so later blocks would only take space).
                self.counts["below_min_priority_blocks"] += upto - i
                r.stopped = r.renew_only = True
                self._renew_held(r, i, upto)
                break
            if r.block_ids[i] < 0:
                r.stopped = True  # no page (out of window): the chain ends here too
                break
            keys.append(r.keys[i])
            ids.append(r.block_ids[i])
            prios.append(prio)
            durs.append(dur)
        r.saved = max(r.saved, upto)
        if not keys:
            return None
        r.ever_saved = True
        self.counts["saved_blocks"] += len(keys)
        return SaveSpec(rid, tuple(keys), tuple(ids), tuple(prios), tuple(durs))

    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        """True when kvtier offloaded some of this request's blocks: the engine then keeps them
        allocated until every worker's get_finished reports the saves done."""
        r = self._reqs.pop(request.request_id, None)
        if r is None:
            return False  # never matched (e.g. cancelled before scheduling): nothing of ours
        self._parked.discard(request.request_id)
        self._release_reservation(r)
        return r.ever_saved

    def request_finished_by_layer_group(self, request: Any, cache_block_ids_by_layer_group: list[list[int]]) -> bool:
        if len(cache_block_ids_by_layer_group) != 1:
            raise KvTierError(
                f"kvtier's TensorRT-LLM connector supports one layer group, got {len(cache_block_ids_by_layer_group)}"
            )
        return self.request_finished(request, cache_block_ids_by_layer_group[0])

    def wait_for_initialization(self) -> None:
        return None

    # ---- introspection -----------------------------------------------------------------------
    def priority_of(self, request_id: int, block: int) -> int:
        r = self._req(request_id, "priority_of")
        if block < len(r.priorities):
            return self._retention(r, block)[0]
        return block_retention(r.retention, r.prompt_len, self.tokens_per_block, block)[0]


__all__ = ["DEFAULT_PRIORITY", "SchedulerCore", "tokens_per_block_of"]
