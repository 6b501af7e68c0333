"""kvtier's ``OffloadingManager`` for vLLM 0.32: the scheduler-side bookkeeping of offloaded
chunks, delegated to kvtier's Rust block index.

All methods run on vLLM's scheduler thread, one at a time (vLLM takes no lock). The index keeps
every policy decision (recency, admission, victim choice, pin and write states); this class only
translates vLLM's contract onto it:

* ``lookup``: HIT when the chunk is ready in the CPU tier, HIT_PENDING while it is being written
  (a GPU->CPU store, or a disk->CPU promotion started by a disk hit), MISS otherwise. The chunks
  that answered HIT to a request are pinned from its first promotion until its lookups end, so
  that no promotion evicts a chunk vLLM is about to load.
* ``prepare_load`` pins; ``complete_load`` unpins. Pinned chunks are never evicted.
* ``prepare_store`` is all-or-nothing: ``None`` when the new chunks cannot all get a slot, and then
  nothing was evicted. It never evicts one of its own input keys (the index never evicts a key of
  the batch it is placing, nor pinned or writing chunks). Once the index has failed it answers
  "nothing to store" (an empty output), never None, which vLLM would retry on every step.
* Events for stores and evictions, when the engine has KV events on.
* ``get_stats`` reports kvtier's per-tier counters through vLLM's offloading metrics.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable
from typing import Any, Protocol, cast

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier_rs._core import BlockIndex, IndexFailedError, InvalidArgumentError, NoSpaceError, NotReadyError
from kvtier_rs.checks import invalid_argument
from kvtier_rs.integrations.vllm import metrics as m
from kvtier_rs.integrations.vllm.disk_layer import DiskLayer, PromotedChunks
from kvtier_rs.integrations.vllm.lower_tiers import LowerTiers
from kvtier_rs.orchestrator.gate import LoadGate
from kvtier_rs.orchestrator.request_guard import RequestGuard
from kvtier_rs.tiers.shared_region import SlotSeals, seals_of

_HIT = LookupResult.HIT
_MISS = LookupResult.MISS
_PENDING = LookupResult.HIT_PENDING
_RETRY = LookupResult.RETRY
# A key no index holds (keys are 32-byte hashes + 4-byte group): checks that the index's lookup
# results are vLLM's members before binding the fast path.
_PROBE_KEY = b"kvtier-lookup-probe"
# Policies whose touch only refreshes recency. ARC and S3-FIFO count a touch as a repeat use
# (ARC moves the chunk to its frequent list), which a request's own store is not: for them a
# finished request's stored-only chunks are refreshed (`BlockIndex.refresh`) instead.
_RECENCY_ONLY_TOUCH = frozenset({"lru", "fifo", "priority"})


class _LookupResultFn(Protocol):
    """`BlockIndex.lookup_result` once its results are vLLM's LookupResult members."""

    def __call__(self, key: OffloadKey, context: object = None, /) -> LookupResult: ...


# Longest a quiet engine goes without a metrics report (see KvtierOffloadingManager.get_stats).
STATS_INTERVAL_S = 1.0


class KvtierHostSpec(CPULoadStoreSpec):
    """CPU chunk slots (host rows) and, per slot, the seal of the chunk it is loaded or stored
    for: the worker seals the rows a store wrote, and refuses to load a row sealed for another
    chunk (see ``kvtier_rs.tiers.shared_region``). Picklable: it travels to worker processes."""

    def __init__(self, block_ids: list[int], seals: Any) -> None:
        super().__init__(block_ids)
        self.seals = np.asarray(seals, dtype=np.uint64)
        if len(self.seals) != len(self.block_ids):
            raise ValueError(f"{len(self.block_ids)} slots, {len(self.seals)} seals")


class _RequestKeys:
    """Keys a request loaded or stored, per KV-cache group in the order first seen, and which
    of them it reused (loaded, or found ready) or only stored: replayed to the policy when it
    ends.

    vLLM 0.32 never calls ``touch``; like its own CPU manager, recency comes from the request's
    accesses, applied once when the request finishes (one batch call instead of one per key).
    """

    __slots__ = ("owner", "generation", "groups", "seen", "inserted", "reused")

    def __init__(self, owner: object, generation: int) -> None:
        self.owner = owner
        self.generation = generation
        self.groups: dict[int, list[OffloadKey]] = {}
        self.seen: set[OffloadKey] = set()
        self.inserted: set[OffloadKey] = set()
        self.reused: set[OffloadKey] = set()

    def clear(self) -> None:
        self.groups = {}
        self.seen = set()
        self.inserted = set()
        self.reused = set()

    def record(self, keys: Iterable[OffloadKey]) -> None:
        seen = self.seen
        for k in keys:
            if k not in seen:
                seen.add(k)
                self.groups.setdefault(get_offload_group_idx(k), []).append(k)

    def prefix_order(self, req_context: ReqContext) -> list[OffloadKey]:
        """The recorded keys head to tail, as vLLM's CPU manager orders them: each group by the
        end-token positions the scheduler recorded (call order if one of its keys has none),
        groups by index, and all groups interleaved by position when every key has one."""
        position = req_context.get_offload_key_position
        positions: dict[OffloadKey, int] = {}
        ordered: list[OffloadKey] = []
        all_positioned = True
        for g in sorted(self.groups):
            keys = self.groups[g]
            pos = {k: p for k in keys if (p := position(k)) is not None}
            if len(pos) == len(keys):
                keys = sorted(keys, key=pos.__getitem__)
            else:
                all_positioned = False
            positions.update(pos)
            ordered.extend(keys)
        if all_positioned and len(self.groups) > 1:
            ordered.sort(key=positions.__getitem__)  # stable: ties keep group order
        return ordered


def _pin_ready(index: BlockIndex, keys: list[OffloadKey]) -> list[OffloadKey]:
    """Pin those of `keys` that are ready in `index` (all of them, unless something evicted one
    since it answered HIT); returns the keys pinned."""
    try:
        index.pin_for_load(keys)  # all-or-nothing
        return keys
    except NotReadyError:
        ready = [k for k, ok in zip(keys, index.contains(keys), strict=True) if ok]
        index.pin_for_load(ready)
        return ready
    except IndexFailedError:
        return []  # nothing is evicted any more


class KvtierOffloadingManager(OffloadingManager):  # noqa: PLR0904 - vLLM's OffloadingManager interface
    """Scheduler-side manager over a kvtier ``BlockIndex`` of CPU chunk slots.

    ``lower``: an optional lower tier (kvtier's disk tier, see ``disk_layer``). Chunks that become
    ready in the CPU tier are written through to it; a CPU miss that it holds is promoted back
    into a CPU slot (lookup answers HIT_PENDING, then HIT once the read is done).

    ``seals``: the host region's seal table: a slot handed out for a store is unsealed first,
    and every spec names the seal of each chunk, which the workers write and check.
    """

    def __init__(
        self,
        cpu_index: BlockIndex,
        *,
        enable_events: bool = False,
        lower: DiskLayer | LowerTiers | None = None,
        seals: SlotSeals | None = None,
        request_guard: RequestGuard | None = None,
    ) -> None:
        self._cpu = cpu_index
        self._seals = seals
        if lower is not None and not isinstance(lower, LowerTiers):
            lower = LowerTiers([lower])
        # Bound builtins, looked up once: lookup() is the scheduler's hottest call.
        self._state = cpu_index.state
        self._lower = lower
        # Whether a request's stored-only chunks are touched when it ends (see on_request_finished).
        self._touch_stored = cpu_index.policy in _RECENCY_ONLY_TOUCH
        # One Rust call per lookup, returning vLLM's own LookupResult members (HIT for ready,
        # HIT_PENDING while written, MISS when absent). Without a lower tier to consult on a
        # miss, that call *is* lookup: binding it on the instance removes the Python frame.
        try:
            cpu_index.set_lookup_results(_HIT, _PENDING, _MISS)
        except InvalidArgumentError:
            # Set already (an index reused, e.g. after a manager restart): fine if to ours.
            if cpu_index.lookup_result(_PROBE_KEY) is not _MISS:
                raise invalid_argument("cpu_index", "its lookup results were set to other objects") from None
        # Answers with the LookupResult members set above; the context is ignored.
        self._lookup_result = cast(_LookupResultFn, cpu_index.lookup_result)
        #: The request-level rule (``slo_guard``): while it bypasses the CPU tier, CPU hits are
        #: answered as misses; the disk tier's gate consults it for disk hits.
        self.request_guard = request_guard
        # The gate whose guard states are reported: the disk tier's, or one for the CPU tier
        # alone when only the request rule watches it.
        self._guard_gate: LoadGate | None = (
            lower.gate
            if lower is not None
            else None
            if request_guard is None
            else LoadGate(tiers=("cpu",), request_guard=request_guard, log=logging.getLogger(__name__))
        )
        self._guard_trips: dict[str, int] = {}  # trips reported to vLLM so far, per tier
        #: Set by KvtierConnector, which measures requests for the request rule; without it
        #: the rule would wait for samples that never come (said once in the log).
        self.request_timings = False
        self._said_untimed = False
        if lower is None and request_guard is None:
            # The bound Rust call replaces the method on this instance (mypy types it unbound).
            self.lookup = self._lookup_result  # type: ignore[method-assign, assignment]
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        self._generation = 0
        # Keys now in the CPU tier because a disk read put them there: their next load is
        # counted as served by disk (and reported as a DISK cache hit to vLLM).
        self._from_lower: PromotedChunks = PromotedChunks()
        # Keys of loads in flight that the lower tier supplied: vLLM asks get_load_source after
        # prepare_load (when the keys have left _from_lower), so the answer is kept until the
        # load completes.
        self._loading_from_lower: set[OffloadKey] = set()
        # The request whose lookups run now, the keys that answered HIT to them, and those of
        # them pinned (held) since a promotion was to start: see lookup.
        self._lookup_req: ReqContext | None = None
        self._lookup_hits: list[OffloadKey] = []
        self._held: list[OffloadKey] = []
        # Set by a cache reset that left GPU jobs in flight: no promotion starts until a job
        # issued after it completes (see reset_cache).
        self._flush_pending = False
        self.counters = m.ManagerCounters()
        if lower is not None:
            # The lower tier fills both as its promotions complete.
            self._from_lower = lower.promoted
            lower.counters = self.counters
            lower.events_enabled = enable_events
        self._last_index_stats: dict[str, int] = dict(cpu_index.stats())
        self._alloc_sizes: list[int] = []
        # get_stats runs every engine step. Reading both tiers' stats and emitting them costs
        # ~150 us, a few percent of a small model's step, so it is skipped while nothing moved
        # (no load or store since the last report), at most STATS_INTERVAL_S at a time: lookup
        # counters, which move on the Rust fast path, reach the metrics that late at most.
        self._dirty = True
        self._last_report = 0.0
        self._reported = False  # the first report carries every counter at zero
        #: Called once by ``shutdown`` (the spec uses it to release the engine's host memory).
        self.on_shutdown: Callable[[], None] | None = None

    # ---- helpers ----------------------------------------------------------------------------

    @property
    def cpu_index(self) -> BlockIndex:
        return self._cpu

    @property
    def lower(self) -> Any:
        return self._lower

    def _request_keys(self, req_context: ReqContext) -> _RequestKeys:
        st = req_context.get_state(_RequestKeys)
        if st is None or st.owner is not self or st.generation != self._generation:
            st = _RequestKeys(self, self._generation)
            req_context.set_state(st)
        return st

    # ---- OffloadingManager ------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._request_keys(req_context)
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        # With a lower tier (without one, __init__ binds the index's lookup_result here).
        # HIT when ready, HIT_PENDING while a GPU->CPU store or a promotion from disk writes it.
        res = self._lookup_result(key)
        if req_context is not self._lookup_req:
            self._end_lookups()
            self._lookup_req = req_context
        rg = self.request_guard
        if rg is not None and res is not _MISS and not rg.allows("cpu"):
            # The CPU tier is out (and the disk tier with it: the rule bypasses it first).
            self.counters.cpu_refused_guard += 1
            self._dirty = True
            return _MISS
        if res is _HIT:
            self._lookup_hits.append(key)
        # The disk tier is vLLM's STORAGE medium, local to this engine: a request whose
        # kv_load_tiers leave it out (load_tier_filter) is never served from it.
        # The lower tiers filter by the request's kv_load_tiers themselves (the disk tier is
        # vLLM's LOCAL STORAGE, the remote tier its REMOTE STORAGE).
        elif res is _MISS and self._lower is not None:
            if self._flush_pending:
                return _MISS  # recomputed: a promotion could land in a slot a flushed job uses
            # A promotion takes its CPU slot by eviction, and must not evict this request's
            # hits: vLLM may load them without looking them up again, even after a lookup that
            # answered HIT_PENDING (a sliding-window group's scan drops a pending chunk that a
            # miss cuts off from the window; a pending partial tail falls back to the complete
            # hits). So they stay pinned until the request's lookups end.
            return self._lower.lookup_and_promote(key, req_context, self._hold_hits)
        return res

    def _hold_hits(self) -> None:
        """Pin the current request's hits not held yet (each once, however many promotions)."""
        if self._lookup_hits:
            self._held += _pin_ready(self._cpu, self._lookup_hits)
            self._lookup_hits = []

    def _end_lookups(self) -> None:
        """The current request's lookups are over (it loads, or the step or the request
        changed): vLLM looks up one request's keys, then loads them, before the next request's.
        Its hits need no holding any more (a load pins them; otherwise vLLM looks again)."""
        self._lookup_req = None
        self._lookup_hits = []
        if self._lower is not None:
            self._lower.end_lookups()  # the remote tier probes what they asked about
        if self._held:
            held, self._held = self._held, []
            self._cpu.unpin(held)

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        from_lower = key in self._from_lower or key in self._loading_from_lower
        return CacheHitSource.DISK if from_lower else CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        self._dirty = True
        self._end_lookups()
        keys = list(keys)
        # All-or-nothing; vLLM passes only keys that just answered HIT, so a failure here is a
        # broken contract and is raised (NotReadyError), like the in-tree manager's assert. So
        # is IndexFailedError, if the index disabled itself between those lookups and this
        # call: no spec could name valid bytes for keys the index no longer vouches for.
        slots = self._cpu.pin_for_load(keys)
        if self._lower is not None:
            # The load pin now protects promoted chunks; drop the promotion's reservation.
            self._lower.release(keys, req_context)
        c = self.counters
        if self._from_lower:
            from_lower = [k for k in keys if k in self._from_lower]
            for k in from_lower:
                if self._from_lower.pop(k) == "remote":
                    c.loads_remote += 1
                else:
                    c.loads_disk += 1
            self._loading_from_lower.update(from_lower)
            c.loads_cpu += len(keys) - len(from_lower)
            if self._lower is not None and len(from_lower) < len(keys):
                self._lower.offer_reuse([k for k in keys if k not in from_lower] if from_lower else keys)
        else:
            c.loads_cpu += len(keys)
            if self._lower is not None:
                self._lower.offer_reuse(keys)
        st = self._request_keys(req_context)
        st.record(keys)
        # Reading back a chunk this request stored (after a preemption) is not a reuse.
        st.reused.update(k for k in keys if k not in st.inserted)
        return self._spec(slots, keys)

    def _spec(self, slots: list[int], keys: list[OffloadKey]) -> CPULoadStoreSpec:
        if self._seals is None:
            return CPULoadStoreSpec(slots)
        return KvtierHostSpec(slots, seals_of(keys))

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._dirty = True
        self._cpu.touch(list(keys))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._dirty = True
        keys = list(keys)
        if keys:
            self._flush_pending = False  # a job issued after any reset: see reset_cache
        if self._loading_from_lower:
            self._loading_from_lower.difference_update(keys)
        self._cpu.unpin(keys)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        keys = list(keys)
        self._dirty |= bool(keys)
        # One call into the core, which never evicts a key of its own batch (vLLM's "never
        # evict an input key") and is all-or-nothing.
        try:
            out = self._cpu.prepare_store(keys)
        except NoSpaceError:
            self.counters.store_no_space += 1
            return None
        except IndexFailedError:
            # The tier disabled itself (an internal error; its `failed` gauge says so): it
            # stores nothing any more, and its lookups miss. That is "nothing to store", not
            # None: vLLM takes None as "cannot store now" and would count an allocation
            # failure and offer the same chunks again on every step, for good.
            return PrepareStoreOutput(keys_to_store=[], store_spec=CPULoadStoreSpec([]), evicted_keys=[])
        # The index hands back the keys it was given, vLLM's OffloadKeys.
        to_store = cast("list[OffloadKey]", out.keys)
        evicted = cast("list[OffloadKey]", out.evicted)
        if evicted:
            if self._from_lower:
                self._from_lower.discard(evicted)
            if self._events is not None:
                # Removal events go before the store event, as in vLLM's own manager.
                self._emit(OffloadingEvent(keys=list(evicted), medium=Medium.CPU, removed=True))
        st = self._request_keys(req_context)
        # Recorded as vLLM's manager does: the chunks placed now (stored only, unless the
        # request reuses them later) and those offered again while ready (a reuse). Chunks still
        # being written for another request, or refused by admission, are not this one's.
        skipped = cast("list[OffloadKey]", out.skipped)
        if skipped:
            ready = [k for k, ok in zip(skipped, self._cpu.contains(skipped), strict=True) if ok]
            mine = set(to_store).union(ready)
            st.record(k for k in keys if k in mine)
            st.reused.update(k for k in ready if k not in st.inserted)
        else:
            st.record(to_store)
        st.inserted.update(to_store)
        if to_store:
            self._alloc_sizes.append(len(to_store))
            if self._seals is not None:
                # The slots held other chunks: unsealed until the workers seal the new ones.
                self._seals.clear(out.slots)
        return PrepareStoreOutput(
            keys_to_store=to_store, store_spec=self._spec(out.slots, to_store), evicted_keys=evicted
        )

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        keys = list(keys)
        if keys:
            self._dirty = True
            self._flush_pending = False  # a job issued after any reset: see reset_cache
        lower = self._lower
        if self._events is None and lower is None:
            self._cpu.complete_store(keys, success)
            return
        # Only keys still being written change state (a key may have been completed already).
        writing = [k for k in keys if (s := self._state(k)) is not None and s[0] == "writing"]
        self._cpu.complete_store(writing, success)
        if not success or not writing:
            return
        if self._events is not None:
            self._emit(OffloadingEvent(keys=writing, medium=Medium.CPU, removed=False))
        if lower is not None:
            lower.write_through(writing)

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._dirty = True
        if self._lower is not None:
            self._lower.release(None, req_context)
        st = req_context.get_state(_RequestKeys)
        if st is None or st.owner is not self or st.generation != self._generation or not st.groups:
            return
        keys = st.prefix_order(req_context)
        # Passed head first: the index applies touches and refreshes tail-first, so each
        # prefix's head ends up the most recent and is evicted last.
        if self._touch_stored:
            if keys:
                self._cpu.touch(keys)
        else:
            # A chunk the request only stored is refreshed, not touched: a touch would count it
            # as reused (ARC's T1 -> T2), a refresh only restores its place in prefix order.
            reused = st.reused
            stored_only = [k for k in keys if k not in reused]
            if stored_only:
                self._cpu.refresh(stored_only)
            if len(stored_only) < len(keys):
                self._cpu.touch([k for k in keys if k in reused])
        st.clear()

    def _emit(self, event: OffloadingEvent) -> None:
        """Queue one of the manager's own events (events on). The lower tier's events so far go
        first: they happened earlier (a promotion that landed before this eviction, say), and a
        consumer replaying stored/removed must see them in that order."""
        assert self._events is not None
        if self._lower is not None:
            self._events.extend(self._lower.take_events())
        self._events.append(event)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._lower is not None:
            self._lower.poll()
            if self._events is not None:
                self._events.extend(self._lower.take_events())
        if self._events:
            events, self._events = self._events, []
            yield from events

    def on_schedule_end(self, context: Any) -> None:
        self._end_lookups()
        if self._lower is not None:
            self._lower.poll()

    def has_pending_work(self) -> bool:
        # Promotions and write-throughs complete in the background; keep the engine stepping
        # so that their completions are collected and deferred requests are retried.
        return self._lower is not None and self._lower.has_pending_work()

    def reset_cache(self) -> None:
        self._dirty = True
        self._end_lookups()
        # vLLM has flushed in-flight GPU jobs and drops their completions, so chunks still
        # pinned or being written will never be completed: release them, then clear all.
        if self._lower is not None:
            self._lower.reset()
        cpu = self._cpu
        in_flight = False
        for key, state, pins, _slot in cpu.entries():
            # The lower tier has drained its I/O: a pin or a write left is a GPU job's (or the
            # reservation of a promoted chunk, counted too: it cannot be told apart).
            in_flight |= bool(pins) or state == "writing"
            if pins:
                cpu.unpin([key] * pins)
            if state == "writing":
                cpu.complete_store([key], False)
        cpu.clear()
        # vLLM has the worker finish those jobs (its "flush") at the start of the next step it
        # executes, after that step's scheduling: until then a flushed store may still write,
        # and a flushed load read, a slot freed here. Jobs issued from now on are run after the
        # flush, but a promotion's disk read is not: it could land in such a slot before the
        # flushed store, pass its checksum, and then be served with the store's bytes. So no
        # promotion starts until a job issued after this reset completes, which proves the
        # flush over (vLLM drops the completions of the flushed jobs themselves).
        self._flush_pending = in_flight
        self._from_lower.clear()
        self._loading_from_lower.clear()
        self._generation += 1

    def get_stats(self) -> OffloadingConnectorStats | None:
        now_t = time.monotonic()
        pending = (self._lower is not None and self._lower.has_pending_work()) or self._guard_news()
        if not (self._dirty or pending) and now_t - self._last_report < STATS_INTERVAL_S:
            return None
        self._dirty = False
        self._last_report = now_t
        stats = OffloadingConnectorStats()
        if not self._reported:
            self._reported = True
            m.emit_zeros(stats, ("cpu", *self._lower.tiers) if self._lower is not None else ("cpu",))
        now = dict(self._cpu.stats())
        m.emit_index_stats(stats, "cpu", now, self._last_index_stats)
        self._last_index_stats = now
        m.emit_manager_counters(stats, self.counters)
        for n in self._alloc_sizes:
            stats.observe_histogram(m.ALLOCATION_SIZE, n)
        self._alloc_sizes.clear()
        if self._lower is not None:
            self._lower.emit_stats(stats)
        if self.request_guard is not None and not self.request_timings and not self._said_untimed:
            self._said_untimed = True
            logging.getLogger(__name__).error(
                "kvtier: slo_guard is set, but the connector is not KvtierConnector: nothing measures "
                "requests' TTFT and ITL, so the request SLO rule never trips. Use "
                '"kv_connector":"KvtierConnector","kv_connector_module_path":"kvtier_rs.integrations.vllm"'
            )
        if self._guard_gate is not None:
            m.emit_guards(stats, self._guard_gate.state(), self._guard_trips)
            self._guard_gate.changed = False
        return stats

    def _guard_news(self) -> bool:
        """Whether a guard tripped or a tier returned to service since the last report."""
        gate = self._guard_gate
        if gate is None:
            return False
        gate.notice()
        return gate.changed

    def shutdown(self) -> None:
        if self._lower is not None:
            self._lower.shutdown()
        cb, self.on_shutdown = self.on_shutdown, None
        if cb is not None:
            cb()

    # ---- introspection (tests, status) ---------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """kvtier's view: index stats of each tier and the manager's counters."""
        d: dict[str, Any] = {
            "cpu": dict(self._cpu.stats()),
            "counters": self.counters.as_dict(),
            "time": time.monotonic(),
        }
        if self._lower is not None:
            d.update(self._lower.stats())
        return d
