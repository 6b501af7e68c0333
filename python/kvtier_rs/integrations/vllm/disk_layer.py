"""The disk tier behind kvtier's CPU tier, driven from vLLM's scheduler thread.

The data path is the orchestrator's engine-agnostic ``DiskStager`` (shared with the other
adapters); this module only maps it onto vLLM's contract:

* Write-through: a chunk that becomes ready in the CPU tier is queued for a disk write from its
  host slot, which stays pinned (so neither evicted nor rewritten) until the write is done; a
  slow disk's backlog is bounded (``DiskStager.max_write_backlog``: excess writes are dropped
  and counted, never queued without bound).
* Promotion: a CPU miss that the disk tier holds gets a CPU slot in the "writing" state and a
  disk read into it; vLLM sees HIT_PENDING and asks again on a later step, when the read has
  been verified (HIT) or has failed (the slot is dropped, the chunk is a MISS and is recomputed).
* vLLM specifics: the LookupResult answers, per-request reservations of promoted chunks, the
  protection of the chunks a request's lookups already answered HIT from the evictions of its
  own promotions, the cost rule (``cost_model``), OffloadingEvents for the disk (STORAGE) and
  for promotions into the CPU tier.

Nothing here blocks: the disk tier's I/O runs on its own threads (io_uring or a thread pool),
with the GIL released, and completions are collected by ``poll`` once per scheduler step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

from vllm.v1.kv_offload.base import Locality, LookupResult, Medium, OffloadingEvent, OffloadKey

from kvtier_rs._core import BlockIndex, DiskTier, HostPool, IndexFailedError, KvTierError
from kvtier_rs.integrations.vllm import metrics as m
from kvtier_rs.integrations.vllm.options import KvtierOptions
from kvtier_rs.integrations.vllm.tier_identity import log_earlier_formats, tier_dir
from kvtier_rs.orchestrator.disk_contract import StagingDisk
from kvtier_rs.orchestrator.disk_stager import DiskStager
from kvtier_rs.orchestrator.gate import LoadGate
from kvtier_rs.orchestrator.request_guard import RequestGuard
from kvtier_rs.tiers.disk import open_disk_tier
from kvtier_rs.tiers.events import EventStream
from kvtier_rs.tiers.shared_region import SlotSeals

# Under vLLM's logger, so that the lines reach vLLM's own log handler and format.
log = logging.getLogger("vllm." + __name__)

_PENDING = LookupResult.HIT_PENDING
_MISS = LookupResult.MISS


class _Refused:
    """The chunks of a request that the load gate already sent to recomputation, by reason:
    vLLM asks about a waiting request's chunks again on every step it is not scheduled, and each
    chunk counts once per reason, not once a step."""

    __slots__ = ("seen",)

    def __init__(self) -> None:
        self.seen: set[tuple[str, bytes]] = set()


class _Reserved:
    """Promoted chunks held (pinned) for the request whose lookup promoted them.

    Without this, a small CPU tier can evict a promoted chunk before its request is scheduled
    (other promotions of the same request need slots too), and the request would promote the
    same chunks again and again. The pin is dropped when the request loads the chunk (its own
    load pin takes over) or finishes.
    """

    __slots__ = ("keys", "finished", "generation")

    def __init__(self, generation: int) -> None:
        self.keys: set[bytes] = set()
        self.finished = False
        self.generation = generation


class _Read(NamedTuple):
    """A promotion in flight: the reservation of the request whose lookup started it, and when."""

    reserved: _Reserved
    started: float


@dataclass(frozen=True)
class _HostSide:
    """The CPU tier as ``DiskStager`` sees it (what a ``HostTier`` offers): vLLM's manager owns
    a bare index and pool, not a HostTier."""

    index: BlockIndex
    pool: HostPool
    block_bytes: int


_MEDIUM = {"cpu": Medium.CPU, "disk": Medium.STORAGE, "remote": Medium.STORAGE}


class PromotedChunks(dict[OffloadKey, str]):
    """Chunks in the CPU tier because a lower tier's read put them there, and which tier: their
    next load is counted as served by it (and reported to vLLM as a DISK cache hit). Shared by
    the manager (loads and evictions end the entry) and the lower tiers (promotions add one)."""

    def add(self, keys: Sequence[OffloadKey], tier: str) -> None:
        self.update(dict.fromkeys(keys, tier))

    def discard(self, keys: Sequence[OffloadKey] | set[OffloadKey]) -> None:
        for k in keys:
            self.pop(k, None)


def build_gate(
    options: KvtierOptions,
    tiers: tuple[str, ...],
    tokens_per_chunk: int,
    chunk_bytes: int,
    *,
    clock: Callable[[], float] = time.monotonic,
    request_guard: RequestGuard | None = None,
) -> LoadGate:
    """Load or recompute a lower tier's hit: the SLO guards, back-pressure on promotions in
    flight, the cost rule; the same gate as every adapter's, one for all lower tiers."""
    guards = {}
    if "disk" in tiers and options.disk_slo_guard is not None:
        guards["disk"] = options.disk_slo_guard
    # vLLM counts promotions in chunks; the remote tier's bound is the disk's.
    limits = dict.fromkeys(tiers, options.disk_max_promotions_in_flight)
    return LoadGate(
        guards=guards or None,
        max_in_flight=limits,
        cost=options.cost_model.build(tokens_per_chunk, chunk_bytes),
        tiers=tiers,
        log=log,
        clock=clock,
        request_guard=request_guard,
    )


class DiskLayer:  # noqa: PLR0904 - the manager's whole interface to a lower tier
    """One lower tier staged through the CPU tier: the disk tier, or (``RemoteLayer``) the
    shared remote tier, which keeps the disk tier's staging contract."""

    #: The tier's name in metrics, events, the gate and the cost model.
    tier = "disk"
    #: Where vLLM's ``kv_load_tiers`` filter places it.
    locality = Locality.LOCAL
    #: Whether loads from the CPU tier are offered to it (``LowerTiers.offer_reuse``).
    counts_reuse = False

    def __init__(
        self,
        disk: StagingDisk,
        host: HostPool,
        cpu_index: BlockIndex,
        options: KvtierOptions,
        tokens_per_chunk: int,
        *,
        max_write_backlog: int | None = None,
        seals: SlotSeals | None = None,
        clock: Callable[[], float] = time.monotonic,
        request_guard: RequestGuard | None = None,
        gate: LoadGate | None = None,
    ) -> None:
        self.disk = disk
        self.host = host
        self.cpu = cpu_index
        self.options = options
        self.tokens_per_chunk = tokens_per_chunk
        self._contains = disk.contains
        # The stager publishes every tier change here; poll() turns them into vLLM events and
        # into the bookkeeping of promoted chunks. Drained every poll, so it never fills.
        self._stream = EventStream()
        if max_write_backlog is None:
            max_write_backlog = options.disk_max_write_backlog
        self.stager = DiskStager(
            _HostSide(cpu_index, host, host.slot_bytes),
            disk,
            max_write_backlog=max_write_backlog,
            events=self._stream,
            seals=seals,
            tier=self.tier,
        )
        #: Load or recompute a hit of this tier (see ``build_gate``); shared by the lower tiers.
        self.gate = gate or build_gate(
            options, (self.tier,), tokens_per_chunk, host.slot_bytes, clock=clock, request_guard=request_guard
        )
        self.cost = self.gate.cost
        self._clock = clock
        # promotion job id -> the request whose lookup started it, and when
        self._reads: dict[int, _Read] = {}
        #: Chunks promoted from a lower tier and not yet loaded; the manager reads and updates it.
        self.promoted: PromotedChunks = PromotedChunks()
        self.counters: m.ManagerCounters = m.ManagerCounters()
        self._events: list[OffloadingEvent] = []
        self.events_enabled = False  # set by the manager from the engine's kv_events_config
        # Bumped by a cache reset, which drops every pin: older reservations are void.
        self.generation = 0
        #: Why the tier serves and stores nothing any more (see `reset`); None while it does.
        self.off_reason: str | None = None
        self._last_stats: dict[str, int] = {}
        self._last_drops: dict[str, int] = {}

    @classmethod
    def open(
        cls,
        options: KvtierOptions,
        config: Any,
        *,
        host: HostPool,
        cpu_index: BlockIndex,
        tokens_per_chunk: int,
        seals: SlotSeals | None = None,
        request_guard: RequestGuard | None = None,
        gate: LoadGate | None = None,
    ) -> DiskLayer:
        from kvtier_rs.integrations.vllm.options import READER, disk_tier_names

        assert options.disk_root is not None and options.disk_bytes is not None  # opened only with a disk tier
        path = tier_dir(options.disk_root, config, host.slot_bytes)
        log_earlier_formats(path)
        # What only the tier can check (a capacity holding no slot of this chunk size, a
        # directory it cannot open) is reported under the key the user wrote.
        args, root_name = disk_tier_names(options.written)
        with READER.naming(args, path_key=root_name):
            disk = open_disk_tier(
                path,
                options.disk_bytes,
                host.slot_bytes,
                policy=options.disk_policy,
                admission=options.disk_admission,
                engine=options.disk_io_engine,
                queue_depth=options.disk_queue_depth,
            )
        layer = cls(
            disk, host, cpu_index, options, tokens_per_chunk, seals=seals, request_guard=request_guard, gate=gate
        )
        log.info(
            "kvtier: disk tier: %s, %d blocks of %d bytes, policy %s, I/O engine %s (%s), %d block(s) recovered",
            path,
            disk.capacity_blocks,
            disk.block_bytes,
            disk.policy,
            disk.engine,
            disk.io_mode,
            disk.stats().get("resident_blocks", 0),
        )
        return layer

    # ---- called by the manager ------------------------------------------------------------------

    def write_through(self, keys: Sequence[bytes]) -> None:
        if self.off_reason is not None:
            return
        self.stager.write_through(keys)
        self._take_stream()

    def lookup_and_promote(
        self, key: OffloadKey, req_context: Any, protect: Callable[[], None] | None = None
    ) -> LookupResult:
        """Promote `key` if the disk tier holds it (HIT_PENDING), else MISS. `protect`: called
        before a promotion takes a CPU slot, to pin what it must not evict (the manager's: the
        chunks that already answered HIT to this request's lookups)."""
        if self.off_reason is not None or not self._contains([key])[0]:
            return _MISS
        reason = self.gate.refusal(self.tier, 1, len(self._reads))
        if reason is not None:
            refused = req_context.get_state(_Refused)
            if refused is None:
                refused = _Refused()
                req_context.set_state(refused)
            if (reason, key) not in refused.seen:
                refused.seen.add((reason, key))
                self.counters.count_refusal(reason, self.tier)
            return _MISS
        if protect is not None:
            protect()
        # None: every CPU slot is pinned or being written, or the CPU tier's admission refused
        # the chunk. Recompute rather than wait.
        job = self.stager.promote([key])
        if job is None and self.stager.write_backlog:
            # The pins may be those of write-throughs that finished while the engine was idle:
            # lookups run before the step's first poll, so collect them and try once more.
            self.poll()
            job = self.stager.promote([key])
        self._take_stream()
        if job is None:
            return _MISS
        res = req_context.get_state(_Reserved)
        if res is None or res.generation != self.generation:
            res = _Reserved(self.generation)
            req_context.set_state(res)
        self._reads[job] = _Read(res, self._clock())
        self.counters.promotions += 1
        return _PENDING

    def flush_probes(self) -> None:
        """The request's lookups ended: nothing to ask a local disk (see ``RemoteLayer``)."""

    def poll(self) -> None:
        if not self.stager.write_backlog and not self.stager.reads_in_flight:
            return
        for done in self.stager.poll():
            read = self._reads.pop(done.job_id, None)
            res = None if read is None else read.reserved
            if read is not None and not self.gate.forget_stall(self.tier, done.job_id):
                # What the request waited on this chunk: from the lookup that started the read to
                # this poll, after which its next lookup answers HIT (or MISS).
                self.gate.record(self.tier, self._clock() - read.started)
            ok = cast("list[OffloadKey]", done.keys[: done.ok_prefix])  # the keys promoted: vLLM's
            if ok:
                self.promoted.add(ok, self.tier)
                if self.cost is not None:
                    self.cost.observe(self.tier, done.bytes, done.seconds)
                if res is not None and not res.finished and res.generation == self.generation:
                    try:
                        self.cpu.pin_for_load(ok)
                    except IndexFailedError:
                        # The CPU index disabled itself: the chunk is a miss, recomputed.
                        self.promoted.discard(ok)
                    else:
                        res.keys.update(ok)
            # Checksum mismatch, short read, I/O error: never served. The stager dropped the CPU
            # slot; the next lookup is a MISS and the engine recomputes the chunk.
            self.counters.promotion_failures += len(done.keys) - done.ok_prefix
        # A hung disk produces no completions: its reads in flight are the guard's samples.
        now = self._clock()
        self.gate.stalled(self.tier, {job: now - r.started for job, r in self._reads.items()})
        self._take_stream()

    def _take_stream(self) -> None:
        """Apply the stager's tier changes: CPU evictions end a promoted chunk's "from disk"
        status; with KV events on, every change becomes an OffloadingEvent."""
        for ev in self._stream.drain():
            if ev.kind == "removed" and ev.tier == "cpu":
                self.promoted.discard(cast("list[OffloadKey]", list(ev.keys)))
            if self.events_enabled and ev.kind in ("stored", "removed"):
                keys = cast("list[OffloadKey]", list(ev.keys))  # the keys the manager gave: vLLM's
                self._events.append(OffloadingEvent(keys=keys, medium=_MEDIUM[ev.tier], removed=ev.kind == "removed"))

    def release(self, keys: Sequence[bytes] | None, req_context: Any) -> None:
        """Drop the request's reservation pins: on ``keys`` (it loads them now) or on all of them
        (``None``: the request finished)."""
        res = req_context.get_state(_Reserved)
        if res is None or res.generation != self.generation:
            return  # none, or pins already dropped by a cache reset
        if keys is None:
            res.finished = True
            held = list(res.keys)
            res.keys.clear()
        else:
            held = [k for k in keys if k in res.keys]
            res.keys.difference_update(held)
        if held:
            self.cpu.unpin(held)

    def has_pending_work(self) -> bool:
        return bool(self.stager.write_backlog or self.stager.reads_in_flight)

    def drain(self) -> None:
        self.disk.wait_idle()
        self.poll()

    def reset(self) -> None:
        """After a cache reset: every job is drained and the CPU tier drops all pins. The disk
        tier forgets every block too (`disk_on_reset="clear"`): vLLM resets the cache after a
        weight update, and a block written under the old weights must never be promoted. If it
        cannot forget them durably (its metadata can be neither rewritten nor unlinked: a
        read-only or failing device), it is switched off for the rest of this process instead,
        so no old block is served here either."""
        self.drain()
        self.generation += 1
        if self.options.disk_on_reset != "clear" or self.off_reason is not None:
            return
        try:
            cast(DiskTier, self.disk).clear()  # a RemoteLayer overrides reset
        except KvTierError as e:
            self.off_reason = f"a cache reset could not clear the disk tier ({e})"
            log.error("kvtier: disk tier switched off: %s; restarting may bring back its old blocks", self.off_reason)

    def take_events(self) -> list[OffloadingEvent]:
        ev, self._events = self._events, []
        return ev

    def stats(self) -> dict[str, Any]:
        d: dict[str, Any] = dict(self.disk.stats())
        c = self.stager.counters
        d["writes_dropped_backlog"] = c.writes_dropped_backlog
        d["writes_dropped_evicted"] = c.writes_dropped_evicted
        d["promotions_in_flight"] = len(self._reads)
        d["guards"] = self.gate.state()
        return d

    def emit_stats(self, stats: Any) -> None:
        now = {k: v for k, v in self.disk.stats().items() if isinstance(v, int)}
        now["switched_off"] = int(self.off_reason is not None)
        m.emit_index_stats(stats, self.tier, now, self._last_stats)
        self._last_stats = now
        m.emit_write_drops(stats, self.tier, self.stager.counters, self._last_drops)

    def shutdown(self) -> None:
        self.drain()
        self.disk.close()
