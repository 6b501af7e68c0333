"""TierOrchestrator: one engine-agnostic object over the engine's device blocks, the CPU tier
and the disk tier. Engine adapters call it; it never imports an engine.

    offload(keys, gpu_block_ids)      device -> CPU now, CPU -> disk (write-through, by the disk
                                      tier's admission rule) once the CPU copy is done
    plan(keys, gpu_hit_blocks)        per tier, how many leading blocks hit, and how many of them
                                      are worth loading (cost model, back-pressure, SLO guard);
                                      counted: one lookup, its hits, misses and refusals
    load(keys, gpu_block_ids, ...)    CPU hits -> device; disk hits -> CPU -> device (staged);
                                      plans (and counts) first unless given the plan
    reserve(keys, ...) / bind(...)    the same load in two steps, for an engine that must promise
                                      its hits before it allocates their destinations: reserve
                                      pins the CPU hits and starts the disk reads into reserved
                                      CPU slots; bind gives the destinations; release gives
                                      an unbound reservation back
    poll()                            progress every job; returns requests whose load finished

Everything is asynchronous: calls submit copies and return; `poll` (once per engine step)
collects completions. A block that fails anywhere (copy error, corrupt or missing disk block)
is a miss: the load stops before it and the engine recomputes it. Nothing is ever served from
a slot that was not verified.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvtier_rs._core import (
    ClosedError,
    IndexFailedError,
    KvTierError,
    NoSpaceError,
    NotReadyError,
)
from kvtier_rs.checks import check_count, check_number, invalid_argument, show
from kvtier_rs.orchestrator.completions import handle_each
from kvtier_rs.orchestrator.cost import CostModel
from kvtier_rs.orchestrator.counters import DataPathCounters
from kvtier_rs.orchestrator.disk_contract import StagingDisk
from kvtier_rs.orchestrator.disk_stager import DiskStager
from kvtier_rs.orchestrator.gate import TIERS, LoadGate
from kvtier_rs.orchestrator.guard import GuardRule
from kvtier_rs.orchestrator.latency import LatencyRecorder
from kvtier_rs.tiers.events import EventStream
from kvtier_rs.tiers.host import HostTier
from kvtier_rs.tiers.keys import Key, index_list, key_list
from kvtier_rs.transfer import TransferEngine, TransferResult


@dataclass(frozen=True)
class LoadPlan:
    total: int
    gpu_hits: int
    cpu_hits: int
    disk_hits: int
    load_cpu: int  # leading CPU hits to load
    load_disk: int  # disk hits after them to stage and load
    refused: dict[str, dict[str, int]]  # tier -> reason -> blocks

    @property
    def misses(self) -> int:
        return self.total - self.gpu_hits - self.cpu_hits - self.disk_hits

    @property
    def loaded(self) -> int:
        return self.load_cpu + self.load_disk


@dataclass(frozen=True)
class Reservation:
    """What a reserved load holds (`TierOrchestrator.reserve`): the first `cpu` blocks after
    the GPU hits are pinned in the CPU tier, and the `disk` blocks after them have CPU slots
    reserved and their reads started. Nothing can evict or take these; only a disk block that
    fails verification can still make the load shorter."""

    request_id: Any
    plan: LoadPlan
    cpu: int
    disk: int

    @property
    def blocks(self) -> int:
        return self.cpu + self.disk


@dataclass
class OffloadTicket:
    job_id: int | None
    stored: list[Key]
    skipped: list[Key]
    refused: list[Key]
    evicted: list[Key]
    no_space: bool = False


@dataclass
class LoadResult:
    """Per-request accounting of one load."""

    request_id: Any
    plan: LoadPlan
    loaded_cpu: int = 0  # blocks now on the device that came from the CPU tier
    loaded_disk: int = 0  # ... from the disk tier (through the CPU tier)
    failed: int = 0  # planned blocks that could not be loaded (the engine recomputes them)
    # Planned disk hits with no CPU slot free to stage through when the load started: never
    # attempted (nor promised, by a caller that promises `Reservation.blocks`), recomputed.
    unreserved: int = 0
    seconds: float = 0.0
    bytes: int = 0

    @property
    def loaded(self) -> int:
        return self.loaded_cpu + self.loaded_disk


@dataclass
class _Copies:
    """The host -> device copies of one part of a load (the CPU hits, or the disk hits once
    promoted): one engine job per region group, so a per-layer wait can return early.

    The part is one transfer for the cost model: its bytes over the time from when its first
    job's copies started to its last job's completion. Each job's own `seconds` runs from its
    submission, so a later group's includes the time it queued behind the earlier ones; folding
    jobs in one by one would read 32 layers copied back to back as 32 slow copies. And the
    copies start only once the compute stream they were ordered after is done with the step in
    flight: counted from the submission, a busy step read as a slow hop, and the cost model
    refused loads that would have paid."""

    keys: list[Key] = field(default_factory=list)
    jobs: dict[int, int] = field(default_factory=dict)  # job id -> its region group
    done_groups: set[int] = field(default_factory=set)
    failed: bool = False
    copies_started: float = math.inf  # earliest start of the jobs' copies (TransferResult.started_at)
    finished: float = 0.0  # latest completion among the jobs that landed (or failed)
    bytes: int = 0  # copied by the jobs that landed
    # The SLO guard already took this part as a slow sample while it was still in flight
    # (`TierOrchestrator._record_stalls`); its completion is not recorded again.
    stall_recorded: bool = False


class _OrphanRead(NamedTuple):
    """A disk read still in flight that no load owns any more (see `_orphan_reads`)."""

    job: int
    started: float  # when the read started (perf_counter)


@dataclass
class _Load:
    result: LoadResult
    keys: list[Key]  # blocks after the GPU hits
    started: float  # when it was reserved (the disk read starts then)
    # When its disk read started: at reserve, or earlier for a read taken over from a released
    # reservation; kept if the read is orphaned again, so stall detection sees its true age.
    read_started: float = 0.0
    cpu: _Copies = field(default_factory=_Copies)
    disk: _Copies = field(default_factory=_Copies)
    disk_read: int | None = None
    cpu_slots: list[int] = field(default_factory=list)  # of the CPU part, pinned at reserve
    disk_slots: list[int] | None = None  # of the disk part once read and pinned, before bind
    # Set by bind: the destinations (for keys, in order), the region groups in the order they
    # are needed, and when.
    gpu_ids: list[int] | None = None
    groups: list[list[int]] | None = None
    bound_at: float = 0.0
    # The engine's compute stream (CUDA): the copies into the destinations wait for the work
    # queued there, which may still read those blocks for the requests that held them before.
    after_stream: object = None

    @property
    def bound(self) -> bool:
        return self.gpu_ids is not None

    @property
    def reserved(self) -> int:
        return len(self.cpu.keys) + len(self.disk.keys)

    def open_jobs(self) -> bool:
        return bool(self.cpu.jobs or self.disk.jobs or self.disk_read is not None)

    def groups_ready(self) -> int:
        """Leading region groups in place on the device for every part of this load."""
        if not self.bound:
            return 0
        n = len(self.groups) if self.groups else 1
        ready = n
        for part, pending in ((self.cpu, False), (self.disk, self.disk_read is not None)):
            if pending:
                return 0
            if part.keys and (part.jobs or part.failed):
                g = 0
                while g < n and g in part.done_groups:
                    g += 1
                ready = min(ready, g)
        return ready


class TierOrchestrator:  # noqa: PLR0904 - split by job in the data-path refactor
    def __init__(
        self,
        host: HostTier,
        engine: TransferEngine,
        *,
        disk: StagingDisk | None = None,
        cost: CostModel | None = None,
        guards: dict[str, GuardRule] | None = None,
        max_promotions_in_flight: dict[str, int] | None = None,
        max_disk_write_backlog: int = 1024,
        disk_read_timeout_s: float = 10.0,
        events: EventStream | None = None,
    ) -> None:
        if engine.pool is not host.pool:
            raise invalid_argument("engine", "it must copy into this host tier's pool")
        # Checked here (naming the argument), not on the engine thread at the first plan().
        gate = LoadGate(guards=guards, max_in_flight=max_promotions_in_flight, cost=cost, on_change=self._tier_event)
        max_disk_write_backlog = check_count("max_disk_write_backlog", max_disk_write_backlog)
        #: A bound load whose disk read is still in flight this long after bind gives up its
        #: disk part (recomputed; the read lands in the CPU tier, owned by no load).
        self.disk_read_timeout_s = check_number("disk_read_timeout_s", disk_read_timeout_s, inf_ok=True)
        self.host = host
        self.engine = engine
        #: Block stored/removed/promoted events for external indexes; None publishes nothing.
        self.events = events
        self.stager = (
            DiskStager(host, disk, max_write_backlog=max_disk_write_backlog, events=events)
            if disk is not None
            else None
        )
        #: Load or recompute, per tier: SLO guard, back-pressure, cost rule.
        self.gate = gate
        self.cost = cost
        self.guards = gate.guards
        self.max_in_flight = gate.max_in_flight
        self._ids = itertools.count(1)
        self._stores: dict[int, tuple[list[Key], float, dict[str, Any]]] = {}
        self._loads: dict[Any, _Load] = {}
        self._job_owner: dict[int, Any] = {}  # engine h2d job -> request id
        self._read_owner: dict[int, Any] = {}  # disk read job -> request id
        # Reads still in flight that no load owns (its reservation was released, or its load gave
        # up on it): chain -> (job, when the read started). Still promotions in flight: each
        # holds CPU staging slots and the disk's queue (back-pressure and stalls count them).
        self._orphan_reads: dict[tuple[Key, ...], _OrphanRead] = {}
        self._done: list[LoadResult] = []
        self.counts = DataPathCounters()
        self.latency = {
            "cpu_load": LatencyRecorder(),
            "disk_load": LatencyRecorder(),
            "cpu_store": LatencyRecorder(),
        }

    def _tier_event(self, tier: str, bypassed: bool, why: str) -> None:
        """A guard trip or recovery, as an event for external routers (see tiers.events)."""
        if self.events is not None:
            self.events.publish("bypassed" if bypassed else "restored", tier, (), reason=why)

    # ---- offload -------------------------------------------------------------------------
    def offload(
        self,
        keys: Sequence[Key],
        gpu_block_ids: Sequence[int],
        *,
        priority: int = 35,
        duration_s: float | None = None,
        after_stream: object = None,
    ) -> OffloadTicket:
        """Copy the new blocks among `keys` (a chain, head first) from the device to the CPU
        tier. Never blocks on the copy. When the CPU tier cannot take the blocks now (every slot
        pinned or being written), no block is stored and the ticket says `no_space`. Blocks of
        `keys` that a tier already holds are renewed with `priority` and `duration_s` either way
        (the claim happened)."""
        keys = key_list(keys)
        gpu_ids = self._gpu_block_ids(gpu_block_ids)
        if len(keys) != len(gpu_ids):
            raise invalid_argument("gpu_block_ids", f"{len(gpu_ids)} ids for {len(keys)} keys")
        where = dict(zip(keys, gpu_ids, strict=True))
        # The blocks the tiers hold already take this offload's hint; the store gives it to the
        # rest (and the write-through to their disk copies).
        self.renew(keys, priority=priority, duration_s=duration_s)
        try:
            out = self.host.index.prepare_store(keys, priority=priority, duration_s=duration_s)
        except NoSpaceError:
            # The blocks it would have added: a chain's blocks the tier already holds (ready or
            # being written) were not refused, and counting them overstated the refusals.
            index = self.host.index
            self.counts.cpu_store_no_space_blocks += sum(1 for k in dict.fromkeys(keys) if index.state(k) is None)
            return OffloadTicket(None, [], [], [], [], no_space=True)
        except IndexFailedError:
            # The CPU index disabled itself (an internal error): it stores nothing any more and
            # its lookups miss, so the engine keeps serving by recomputing.
            self.counts.cpu_store_index_failed_blocks += len(keys)
            return OffloadTicket(None, [], [], [], [])
        ticket = OffloadTicket(None, list(out.keys), list(out.skipped), list(out.refused), list(out.evicted))
        self.counts.cpu_store_refused += len(out.refused)
        if self.events is not None:
            self.events.publish("removed", "cpu", out.evicted, reason="evicted")
        if not out.keys:
            return ticket
        try:
            job = self.engine.store([where[k] for k in out.keys], out.slots, after_stream=after_stream)
        except BaseException:
            # The engine refused the copy: give the reserved slots back, never leave them writing.
            self.host.index.complete_store(out.keys, False)
            raise
        self._stores[job] = (list(out.keys), time.perf_counter(), {"priority": priority, "duration_s": duration_s})
        ticket.job_id = job
        return ticket

    def store_finished(self, job_id: int | None) -> bool:
        """Whether an offload's device -> host copy job (`OffloadTicket.job_id`) is over, finished
        or failed, as of the last `poll()`: the engine may then free the blocks it copied from.
        A ticket without a job (nothing was copied) is over."""
        return job_id is None or job_id not in self._stores

    def renew(self, keys: Sequence[Key], *, priority: int = 35, duration_s: float | None = None) -> None:
        """Give the blocks of `keys` that a tier already holds (CPU or disk) this priority and
        duration, as if just stored with them: a later claim overrides an earlier one
        (TensorRT-LLM's retention rule). Blocks no tier holds are ignored."""
        keys = key_list(keys)
        self.host.index.renew(keys, priority=priority, duration_s=duration_s)
        if self.stager is not None:
            with contextlib.suppress(ClosedError):  # a closed disk tier holds nothing to renew
                self.stager.disk.renew(keys, priority=priority, duration_s=duration_s)

    # ---- plan ----------------------------------------------------------------------------
    def plan(self, keys: Sequence[Key], gpu_hit_blocks: int = 0, *, count: bool = True) -> LoadPlan:
        """How many leading blocks of `keys` each tier holds and how many are worth loading.

        A plan is a scheduling decision and is counted here, once: one lookup, its hits and
        misses per tier and every refusal by tier and reason, whether or not the caller then
        loads (a caller that finds nothing worth loading never calls `load`). `load(plan=p)`
        does not count `p` again. Planning the same request again later is a new lookup and is
        counted again. `count=False` is for a caller that re-plans a decision already counted
        (e.g. only to route blocks to the tier that holds them now)."""
        keys = key_list(keys)
        if not 0 <= gpu_hit_blocks <= len(keys):
            raise invalid_argument("gpu_hit_blocks", f"{gpu_hit_blocks} not in 0..{len(keys)}")
        rest = keys[gpu_hit_blocks:]
        cpu_hits = self.host.index.lookup_prefix(rest)
        disk_hits = self._disk_hits(rest[cpu_hits:]) if self.stager and cpu_hits < len(rest) else 0
        refused: dict[str, dict[str, int]] = {}
        load_cpu = self._admit("cpu", cpu_hits, refused)
        if load_cpu == cpu_hits:
            load_disk = self._admit("disk", disk_hits, refused)
        else:
            # The chain is cut before the disk hits: they are refused for the CPU part's reason.
            load_disk = 0
            if disk_hits:
                (reason,) = refused["cpu"]
                refused.setdefault("disk", {})[reason] = disk_hits
        plan = LoadPlan(len(keys), gpu_hit_blocks, cpu_hits, disk_hits, load_cpu, load_disk, refused)
        if count:
            self._count_plan(plan)
        return plan

    def _disk_hits(self, keys: list[Key]) -> int:
        """Leading blocks of `keys` the disk tier holds; none once it is closed (shut down, or
        closed by another component): the CPU tier serves on and the rest are misses."""
        assert self.stager is not None
        try:
            return self.stager.disk.lookup_prefix(keys)
        except ClosedError:
            return 0

    def _admit(self, tier: str, n: int, refused: dict[str, dict[str, int]]) -> int:
        reason = self.gate.refusal(tier, n, self._promotions_in_flight(tier)) if n else None
        if reason is None:
            return n
        refused.setdefault(tier, {})[reason] = n
        return 0

    def _promotions_in_flight(self, tier: str) -> int:
        # A snapshot first: stats() runs on a metrics scrape's thread while the engine thread
        # adds and retires loads, and iterating the live dict could fail midway.
        loads = list(self._loads.values())
        if tier == "cpu":
            return sum(1 for ld in loads if ld.cpu.jobs)
        return sum(1 for ld in loads if ld.disk_read is not None or ld.disk.jobs) + len(self._orphan_reads)

    # ---- load ----------------------------------------------------------------------------
    def load(
        self,
        keys: Sequence[Key],
        gpu_block_ids: Sequence[int],
        *,
        request_id: Any = None,
        gpu_hit_blocks: int = 0,
        plan: LoadPlan | None = None,
        region_groups: Sequence[Sequence[int]] | None = None,
        after_stream: object = None,
    ) -> LoadResult:
        """Start loading the planned hits of `keys` after the first `gpu_hit_blocks` into
        `gpu_block_ids` (destinations for keys[gpu_hit_blocks:], in order). Returns the request's
        accounting; its load counts are final once `poll` reports it.

        `after_stream` (CUDA: the engine's compute stream) orders the copies after the work
        queued there so far: the destinations were just given to this request, and a forward
        pass still running may read them for the request that held them before.

        `region_groups` (e.g. one group of region indices per layer, in layer order) splits the
        copies into one job per group, submitted in order, so `groups_ready(request_id)` can say
        that the first layers are in place while later ones are still copying.

        Given a `plan` (from `plan()`, which counted it), the load counts no lookup; without
        one it plans and counts one, once the arguments are checked. `reserve` + `bind` is the
        same load in two steps."""
        # Every argument is checked before the load is registered, a block pinned or the plan
        # counted, so a bad call leaves no trace (the engine's own checks would only run after
        # the pins).
        keys = key_list(keys)
        gpu_ids = self._gpu_block_ids(gpu_block_ids, distinct=True)
        groups = self._region_groups(region_groups)
        plan, planned_here = self._plan_for(keys, gpu_hit_blocks, plan)
        if len(gpu_ids) < plan.loaded:
            raise invalid_argument("gpu_block_ids", f"{len(gpu_ids)} ids for {plan.loaded} blocks to load")
        ld = self._reserve(keys, self._new_request_id(request_id), plan, planned_here)
        return self._bind(ld, gpu_ids, groups, after_stream)

    def reserve(
        self,
        keys: Sequence[Key],
        *,
        request_id: Any = None,
        gpu_hit_blocks: int = 0,
        plan: LoadPlan | None = None,
    ) -> Reservation:
        """The first step of a load: hold what it needs before the engine is told how many
        blocks it will get. The CPU hits are pinned; the disk hits get CPU slots, unreadable
        and unevictable until their reads (started now) are verified. An engine that promises
        its hits before it allocates their destinations (TensorRT-LLM) promises
        `Reservation.blocks`: what a plan alone says can be evicted, or find no CPU slot to
        stage through, before the load starts.

        `bind(request_id, gpu_block_ids)` then starts the copies; `release(request_id)` gives
        an unbound reservation back. Plans and counts like `load`."""
        keys = key_list(keys)
        plan, planned_here = self._plan_for(keys, gpu_hit_blocks, plan)
        ld = self._reserve(keys, self._new_request_id(request_id), plan, planned_here)
        return Reservation(ld.result.request_id, plan, len(ld.cpu.keys), len(ld.disk.keys))

    def bind(
        self,
        request_id: Any,
        gpu_block_ids: Sequence[int],
        *,
        region_groups: Sequence[Sequence[int]] | None = None,
        after_stream: object = None,
    ) -> LoadResult:
        """Give a reservation its destinations (for its blocks, in order: at least
        `Reservation.blocks` ids) and start its copies; the rest (`after_stream` too) is as for
        `load`."""
        ld = self._unbound(request_id, "bind")
        gpu_ids = self._gpu_block_ids(gpu_block_ids, distinct=True)
        groups = self._region_groups(region_groups)
        if len(gpu_ids) < ld.reserved:
            raise invalid_argument("gpu_block_ids", f"{len(gpu_ids)} ids for {ld.reserved} reserved blocks")
        return self._bind(ld, gpu_ids, groups, after_stream)

    def release(self, request_id: Any) -> None:
        """Give back a reservation that was never bound (its request was cancelled, or asked
        again). The pins go; a disk read still in flight finishes into the CPU tier as an
        ordinary promotion, owned by no load. No result is reported for it."""
        ld = self._unbound(request_id, "release")
        if ld.cpu.keys:
            self.host.index.unpin(ld.cpu.keys)
        if ld.disk_slots is not None and ld.disk.keys:
            self.host.index.unpin(ld.disk.keys)
        if ld.disk_read is not None:
            # The read runs on; a reservation of the same chain before it lands takes it over.
            self._read_owner.pop(ld.disk_read, None)
            self._orphan_reads[tuple(ld.disk.keys)] = _OrphanRead(ld.disk_read, ld.read_started)
        self.counts.load_released_blocks += ld.reserved
        del self._loads[request_id]

    def is_reserved(self, request_id: Any) -> bool:
        """Whether `request_id` names a reservation not bound yet."""
        ld = self._loads.get(request_id)
        return ld is not None and not ld.bound

    def _unbound(self, request_id: Any, where: str) -> _Load:
        ld = self._loads.get(request_id)
        if ld is None or ld.bound:
            raise invalid_argument(
                "request_id",
                f"{request_id!r} has no unbound reservation to {where} "
                f"({'already bound' if ld is not None else 'never reserved, or finished or released'})",
            )
        return ld

    def _plan_for(self, keys: list[Key], gpu_hit_blocks: int, plan: LoadPlan | None) -> tuple[LoadPlan, bool]:
        """The caller's plan (counted when it was made), or a new one (counted once the load
        is registered): (plan, whether to count it)."""
        if plan is not None:
            # A plan made for other keys would copy other blocks into the destinations.
            if not isinstance(plan, LoadPlan):
                raise invalid_argument("plan", f"expected a LoadPlan, got {show(plan)}")
            if plan.total != len(keys) or plan.gpu_hits != gpu_hit_blocks:
                raise invalid_argument(
                    "plan",
                    f"made for {plan.total} keys with {plan.gpu_hits} GPU hits, "
                    f"given {len(keys)} keys with gpu_hit_blocks={gpu_hit_blocks}",
                )
            return plan, False
        return self.plan(keys, gpu_hit_blocks, count=False), True

    def _new_request_id(self, request_id: Any) -> Any:
        request_id = next(self._ids) if request_id is None else request_id
        if request_id in self._loads:
            raise invalid_argument("request_id", f"{request_id!r} already has a load in flight")
        return request_id

    def _region_groups(self, region_groups: Sequence[Sequence[int]] | None) -> list[list[int]] | None:
        if region_groups is None:
            return None
        groups = [self.engine.layout.check_regions(g) for g in region_groups]
        if not groups:
            raise invalid_argument("region_groups", "give at least one group, or None")
        return groups

    def _reserve(self, keys: list[Key], request_id: Any, plan: LoadPlan, count: bool) -> _Load:
        """Register a load and hold its parts: pin the CPU part, start the disk part's read."""
        if count:
            self._count_plan(plan)
        rest = keys[plan.gpu_hits :]
        ld = _Load(LoadResult(request_id, plan), rest, time.perf_counter())
        self._loads[request_id] = ld
        if plan.load_cpu:
            ld.cpu.keys = rest[: plan.load_cpu]
            try:
                ld.cpu_slots = self.host.index.pin_for_load(ld.cpu.keys)
            except (NotReadyError, IndexFailedError):
                # Evicted (or the index failed) since the plan: everything is recomputed.
                ld.cpu.failed = True
                ld.cpu.keys = []
        if plan.load_disk and not ld.cpu.failed:
            ld.disk.keys = rest[plan.load_cpu : plan.load_cpu + plan.load_disk]
            # The same chain's read, started for a reservation that was given back and still in
            # flight (a request asked again), is taken over: its slots are held, its read runs on.
            orphan = self._orphan_reads.pop(tuple(ld.disk.keys), None)
            assert self.stager is not None  # a plan loads from disk only with a disk tier
            job = self.stager.promote(ld.disk.keys) if orphan is None else orphan.job
            ld.read_started = ld.started if orphan is None else orphan.started
            if job is None:
                ld.result.unreserved = len(ld.disk.keys)  # no CPU slot to stage through: recomputed
                ld.disk.keys = []
            else:
                ld.disk_read = job
                self._read_owner[job] = request_id
        return ld

    def _bind(self, ld: _Load, gpu_ids: list[int], groups: list[list[int]] | None, after_stream: object) -> LoadResult:
        """Set a reserved load's destinations and submit the copies of what is in the CPU tier."""
        ld.gpu_ids, ld.groups, ld.bound_at = gpu_ids, groups, time.perf_counter()
        ld.after_stream = after_stream
        if ld.cpu.keys and not self._submit_copies(ld, ld.cpu, ld.cpu_slots, gpu_ids[: len(ld.cpu.keys)]):
            ld.cpu.failed = True
            ld.cpu.keys = []
        if ld.disk_slots is not None:  # read and pinned before the destinations were known
            slots, ld.disk_slots = ld.disk_slots, None
            self._copy_promoted(ld, slots)
        self._maybe_finish(ld)
        return ld.result

    def _copy_promoted(self, ld: _Load, slots: list[int]) -> None:
        """Submit the copies of the disk part (read, verified and pinned in the CPU tier)."""
        if ld.cpu.failed:
            # The chain broke at its first CPU block: nothing after it is usable either.
            self.host.index.unpin(ld.disk.keys)
            ld.disk.keys = []
            return
        assert ld.gpu_ids is not None
        first = ld.result.plan.load_cpu
        if not self._submit_copies(ld, ld.disk, slots, ld.gpu_ids[first : first + len(ld.disk.keys)]):
            ld.disk.keys = []

    def _gpu_block_ids(self, gpu_block_ids: Sequence[int], *, distinct: bool = False) -> list[int]:
        """Device block ids as ints in the layout's range; `distinct` for a load, where two
        blocks copied to one destination would leave one of them silently lost."""
        ids = index_list(gpu_block_ids, "gpu_block_ids")
        self.engine.layout.check_block_ids(ids, "gpu_block_ids", distinct=distinct)
        return ids

    def _submit_copies(self, ld: _Load, part: _Copies, slots: list[int], gpu_ids: list[int]) -> bool:
        """Submit a part's copies (its keys pinned). False when the engine refused the first one
        (closed, say): the pins are dropped and the part's blocks are recomputed."""
        for gi, group in enumerate(ld.groups or [None]):
            try:
                # The disk part's copies start later (when its read lands), ordered after the
                # compute stream as it is then: later work, so still after the earlier readers.
                job = self.engine.load(slots, gpu_ids, regions=group, after_stream=ld.after_stream)
            except KvTierError:
                if part.jobs:
                    # Earlier groups are copying: the part fails (its blocks are recomputed)
                    # and is unpinned when they land, like a copy that failed. It must never
                    # count as loaded: the refused groups' layers were not copied.
                    part.failed = True
                    return True
                self.host.index.unpin(part.keys)
                return False
            part.jobs[job] = gi
            self._job_owner[job] = ld.result.request_id
        return True

    def groups_ready(self, request_id: Any) -> int | None:
        """How many leading region groups of a load in flight are on the device (all parts).
        None when the request has no load in flight (finished, or never started)."""
        ld = self._loads.get(request_id)
        return None if ld is None else ld.groups_ready()

    def _count_plan(self, plan: LoadPlan) -> None:
        self.counts.count_plan(plan, has_disk=self.stager is not None)

    # ---- completion ----------------------------------------------------------------------
    def poll(self) -> list[LoadResult]:
        """Progress all jobs; return the loads that finished since the last call.

        Every completion is handled even if one of them raises (an internal error): the error
        is raised once the batch is done, and the loads that finished meanwhile are returned by
        the next call."""
        error = handle_each(self.engine.poll(), self._on_transfer)
        if self.stager is not None:
            try:
                promotions = self.stager.poll()
            except Exception as e:  # the stager handled its whole batch and keeps its results
                promotions, error = [], error or e
            error = error or handle_each(promotions, self._on_promotion)
        self._record_stalls()
        if error is not None:
            raise error
        out, self._done = self._done, []
        return out

    def _record_stalls(self) -> None:
        """Give each guard a slow sample for every promotion of its tier that the engine has
        waited on for longer than the threshold and that is still in flight: a tier whose loads
        hang produces no completions, and without this the guard would never see it (only
        back-pressure would stop new loads, with the guard reporting the tier healthy).

        One sample per stalled promotion is not always enough: back-pressure caps promotions in
        flight (16 from disk by default) below the samples a guard needs (20 by default), and a
        hung tier fills the cap and gets no more. So a tier whose promotions in flight have
        reached the cap and have all stalled past the threshold trips its guard outright: it is
        serving nothing, and every new hit of it is refused anyway.

        Then, a bound load whose disk read is still in flight `disk_read_timeout_s` after bind
        gives up its disk part: the engine recomputes those blocks instead of waiting for good.
        Its destinations were never written (the copies start only once the read has landed),
        and the read lands in the CPU tier, as one released unbound would."""
        now = time.perf_counter()
        stalled: dict[str, list[float]] = {tier: [] for tier in TIERS}
        in_flight: dict[str, int] = dict.fromkeys(TIERS, 0)
        # Reads no load waits for any more are no samples (nobody waited on them), but they are
        # promotions in flight: on a hung disk at a modest request rate, the reads given up on
        # are what fill the cap (one load at a time never would).
        # Counted before the loads below, whose reads given up on here are counted as theirs.
        disk_guard = self.guards.get("disk")
        for orphan in list(self._orphan_reads.values()):
            in_flight["disk"] += 1
            if disk_guard is not None and now - orphan.started > disk_guard.threshold_s:
                stalled["disk"].append(now - orphan.started)
        for ld in list(self._loads.values()):
            waited = now - (ld.bound_at if ld.bound else ld.started)
            for tier, part, busy in (
                ("cpu", ld.cpu, bool(ld.cpu.jobs)),
                ("disk", ld.disk, ld.disk_read is not None or bool(ld.disk.jobs)),
            ):
                if not busy:
                    continue
                in_flight[tier] += 1
                guard = self.guards.get(tier)
                if guard is None or waited <= guard.threshold_s:
                    continue
                stalled[tier].append(waited)
                if ld.bound and not part.stall_recorded:
                    guard.record(waited)
                    part.stall_recorded = True
            if ld.bound and ld.disk_read is not None and waited > self.disk_read_timeout_s:
                self._give_up_disk_read(ld)
        for tier, guard in self.guards.items():
            if in_flight[tier] >= self.max_in_flight[tier] and len(stalled[tier]) == in_flight[tier]:
                guard.trip_hung(max(stalled[tier]))
        self.gate.notice()  # log (and publish) a trip the samples above caused

    def _give_up_disk_read(self, ld: _Load) -> None:
        """Drop a load's disk part whose read takes too long (see `_record_stalls`)."""
        assert ld.disk_read is not None
        job, ld.disk_read = ld.disk_read, None
        self._read_owner.pop(job, None)
        self._orphan_reads[tuple(ld.disk.keys)] = _OrphanRead(job, ld.read_started)
        self.counts.disk_read_timeout_blocks += len(ld.disk.keys)
        ld.disk.keys = []
        self._maybe_finish(ld)

    def _guard_sample(self, tier: str, ld: _Load, part: _Copies, waited: float) -> None:
        """A finished promotion's wait, for the tier's guard, unless it was taken already while
        the promotion was stalled. With its age (since bind, now): `waited` ends at the copy's
        completion, maybe long before this poll, and the guard tells a load that was in flight
        at a trip by when it started."""
        guard = self.guards.get(tier)
        if guard is not None and not part.stall_recorded:
            guard.record(waited, started_s_ago=time.perf_counter() - ld.bound_at)

    def _on_transfer(self, r: TransferResult) -> None:
        if r.direction == "d2h":
            keys, t0, hint = self._stores.pop(r.job_id, (None, 0.0, {}))
            if keys is None:
                return
            self.host.index.complete_store(keys, r.success)
            if not r.success:
                self.counts.cpu_store_failed_blocks += len(keys)
                return
            if self.host.index.failure is not None:
                # The index failed while the copy ran: the blocks never became readable.
                self.counts.cpu_store_index_failed_blocks += len(keys)
                return
            self.counts.cpu_stored_blocks += len(keys)
            if self.events is not None:
                self.events.publish("stored", "cpu", keys)
            self.counts.d2h_bytes += r.bytes
            self.latency["cpu_store"].observe(r.seconds)
            if self.stager is not None:
                self.stager.write_through(keys, **hint)
            return
        request_id = self._job_owner.pop(r.job_id, None)
        ld = self._loads.get(request_id)
        if ld is None:
            return
        self.counts.h2d_bytes += r.bytes
        part, tier = (ld.cpu, "cpu") if r.job_id in ld.cpu.jobs else (ld.disk, "disk")
        group = part.jobs.pop(r.job_id)
        part.finished = max(part.finished, r.finished_at)
        part.copies_started = min(part.copies_started, r.started_at)
        if r.success:
            part.done_groups.add(group)
            part.bytes += r.bytes
        else:
            part.failed = True
        if not part.jobs:  # every group of this part has landed (or failed)
            self.host.index.unpin(part.keys)
            # What the engine waited for: from the destinations on to the last copy's
            # completion, for either part (a disk read started at reserve time only shortens
            # the wait; scheduling time between reserve and bind is not the tier's). The
            # completion time is the engine's, not when this poll noticed it: otherwise an
            # engine polling once a step would time its own step.
            elapsed = part.finished - ld.bound_at
            if not part.failed:
                if self.cost is not None:
                    # One host -> device transfer: all its bytes over first copy start to last
                    # completion (see _Copies). A failed part measures nothing.
                    self.cost.observe("cpu", part.bytes, max(0.0, part.finished - part.copies_started))
                if tier == "cpu":
                    ld.result.loaded_cpu = len(part.keys)
                else:
                    ld.result.loaded_disk = len(part.keys)
                self.latency[f"{tier}_load"].observe(elapsed)
            # A failed load cost the engine its wait too: the guard sees it (the histogram
            # is of loads that landed; failures are counted in load_failed).
            self._guard_sample(tier, ld, part, elapsed)
        self._maybe_finish(ld)

    def _on_promotion(self, p: Any) -> None:
        # Every read measures the disk hop, also one no load waits for any more (released, or
        # given up after disk_read_timeout_s): those are the slowest reads, and a disk whose
        # reads all outlast the timeout would otherwise never be measured at all.
        if self.cost is not None:
            self.cost.observe("disk", p.bytes, p.seconds)
        request_id = self._read_owner.pop(p.job_id, None)
        orphan = self._orphan_reads.get(tuple(p.keys))
        if request_id is None and orphan is not None and orphan.job == p.job_id:
            del self._orphan_reads[tuple(p.keys)]  # landed in the CPU tier, owned by no load
        ld = self._loads.get(request_id)
        if ld is None:
            return
        ld.disk_read = None
        if p.ok_prefix == 0 and ld.bound:
            # The read failed while the engine waited on it: a sample for the guard, from the
            # destinations on to the read's end (it started at reserve time).
            self._guard_sample("disk", ld, ld.disk, max(0.0, ld.started + p.seconds - ld.bound_at))
        ld.disk.keys = ld.disk.keys[: p.ok_prefix]
        if not ld.disk.keys or ld.cpu.failed:
            ld.disk.keys = []
            self._maybe_finish(ld)
            return
        try:
            slots = self.host.index.pin_for_load(ld.disk.keys)
        except (NotReadyError, IndexFailedError):
            ld.disk.keys = []
            self._maybe_finish(ld)
            return
        if not ld.bound:
            ld.disk_slots = slots  # pinned until bind gives the destinations
            return
        self._copy_promoted(ld, slots)
        self._maybe_finish(ld)

    def _maybe_finish(self, ld: _Load) -> None:
        if ld.open_jobs() or not ld.bound:
            return
        res = ld.result
        if ld.cpu.failed:
            # The chain broke at its first CPU block: nothing after it is usable either.
            res.loaded_cpu = res.loaded_disk = 0
        res.failed = res.plan.loaded - res.unreserved - res.loaded
        # What the engine waited for: from the destinations on (a read started at reserve time
        # only shortens it).
        res.seconds = time.perf_counter() - ld.bound_at
        res.bytes = res.loaded * self.engine.layout.bytes_per_block
        c = self.counts
        c.cpu.promoted_blocks += res.loaded_cpu
        c.disk.promoted_blocks += res.loaded_disk
        c.load_failed_blocks += res.failed
        c.load_unreserved_blocks += res.unreserved
        if self.events is not None:
            self.events.publish("promoted", "cpu", ld.cpu.keys[: res.loaded_cpu])
            self.events.publish("promoted", "disk", ld.disk.keys[: res.loaded_disk])
        del self._loads[res.request_id]
        self._done.append(res)

    def pending(self) -> int:
        """Jobs in flight. A reservation not bound yet is not a job: only its read (counted by
        the stager) is."""
        return (
            sum(1 for ld in self._loads.values() if ld.bound)
            + len(self._stores)
            + (self.stager.write_backlog + self.stager.reads_in_flight if self.stager else 0)
        )

    def drain(self, timeout: float = 30.0) -> list[LoadResult]:
        """Poll until every job (stores, loads, write-throughs) has finished."""
        deadline = time.monotonic() + timeout
        out: list[LoadResult] = []
        while True:
            out += self.poll()
            if not self.pending():
                return out
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.pending()} kvtier jobs still running after {timeout} s")
            time.sleep(0.001)

    # ---- stats ---------------------------------------------------------------------------
    def _recorders(self) -> dict[str, LatencyRecorder]:
        """Every latency recorder of the data path by name, the disk stager's included."""
        out = dict(self.latency)
        if self.stager is not None:
            out["disk_read"] = self.stager.counters.read_latency
            out["disk_write"] = self.stager.counters.write_latency
        return out

    def stats(self, *, histograms: bool = False) -> dict[str, Any]:
        """Counters of the whole data path, reading each tier's core stats once. Keys are only
        ever added, never renamed (dashboards and adapters read them). With `histograms`, each
        latency also comes as cumulative Prometheus buckets (for the metrics collector)."""
        c = self.counts
        cpu_index = self.host.stats()
        tiers: dict[str, Any] = {
            "gpu": {"hits": c.gpu.hit_blocks, "lookup_blocks": c.gpu.lookup_blocks},
            "cpu": {
                "hits": c.cpu.hit_blocks,
                "promotions": c.cpu.promoted_blocks,
                "stored": c.cpu_stored_blocks,
                "store_failed": c.cpu_store_failed_blocks,
                "store_no_space": c.cpu_store_no_space_blocks,
                "store_index_failed": c.cpu_store_index_failed_blocks,
                "refused": dict(c.cpu.refused),
                "load_latency": self.latency["cpu_load"].percentiles(),
                "store_latency": self.latency["cpu_store"].percentiles(),
                "index": cpu_index,
                "lookup_blocks": c.cpu.lookup_blocks,
                "evictions": cpu_index["evictions"],
                "store_refused": {
                    "admission": cpu_index["store_refused"],
                    "no_space": c.cpu_store_no_space_blocks,
                },
                "promotions_in_flight": self._promotions_in_flight("cpu"),
                **occupancy(cpu_index, self.host.block_bytes),
            },
        }
        if histograms:
            tiers["cpu"]["load_histogram"] = self.latency["cpu_load"].histogram()
            tiers["cpu"]["store_histogram"] = self.latency["cpu_store"].histogram()
        if self.stager is not None:
            sc = self.stager.counters
            disk_index = dict(self.stager.disk.stats())
            tiers["disk"] = {
                "hits": c.disk.hit_blocks,
                "promotions": c.disk.promoted_blocks,
                "refused": dict(c.disk.refused),
                "load_latency": self.latency["disk_load"].percentiles(),
                "read_latency": sc.read_latency.percentiles(),
                "write_latency": sc.write_latency.percentiles(),
                "writes": {
                    "submitted": sc.writes_submitted,
                    "completed": sc.writes_completed,
                    "failed": sc.writes_failed,
                    "refused": sc.writes_refused,
                    "no_space": sc.writes_no_space,
                    "dropped_backlog": sc.writes_dropped_backlog,
                    "dropped_evicted": sc.writes_dropped_evicted,
                    "dropped_index_failed": sc.writes_dropped_index_failed,
                    "not_started": sc.writes_not_started,
                },
                "promotion_blocks_failed": sc.promotion_blocks_failed,
                "index": disk_index,
                "lookup_blocks": c.disk.lookup_blocks,
                "evictions": disk_index["evictions"],
                # The stager's `writes.refused` lumps admission, a full device and no slot free
                # or evictable; split here.
                "store_refused": {
                    "admission": disk_index["store_refused"],
                    "no_space": int(disk_index["refused_disk_full"]) + sc.writes_no_space,
                    "backpressure": sc.writes_dropped_backlog,
                    "unavailable": sc.writes_not_started,
                },
                "promotions_in_flight": self._promotions_in_flight("disk"),
                "write_backlog": self.stager.write_backlog,
                **occupancy(disk_index, self.stager.disk.block_bytes),
            }
            if histograms:
                tiers["disk"]["load_histogram"] = self.latency["disk_load"].histogram()
                tiers["disk"]["store_histogram"] = sc.write_latency.histogram()
                tiers["disk"]["read_histogram"] = sc.read_latency.histogram()
        return {
            "lookups": c.lookups,
            "misses": c.miss_blocks,
            "load_failed": c.load_failed_blocks,
            "load_released": c.load_released_blocks,
            "load_unreserved": c.load_unreserved_blocks,
            # Planned disk blocks given up after disk_read_timeout_s (recomputed; in load_failed).
            "load_timed_out": c.disk_read_timeout_blocks,
            "bytes": {"d2h": c.d2h_bytes, "h2d": c.h2d_bytes},
            "tiers": tiers,
            "guards": {t: g.state() for t, g in self.guards.items()},
            "cost_model": None
            if self.cost is None
            else {
                "bandwidth": dict(self.cost.bandwidth),
                "observations_dropped": self.cost.observations_dropped,
                "observations_skipped": self.cost.observations_skipped,
                "probes": self.cost.probes,
            },
            # Latency samples refused as NaN, inf or negative (LatencyRecorder), per recorder.
            "latency_samples_dropped": {name: rec.dropped for name, rec in self._recorders().items()},
            "events": None if self.events is None else self.events.stats(),
        }


def occupancy(index_stats: Any, block_bytes: int) -> dict[str, int]:
    """Capacity and occupancy of a tier in payload bytes. `usage_bytes` counts every block that
    holds a slot (ready, being written, being evicted), pinned or not: what the tier occupies.
    `pinned_bytes` is the part of it that cannot be evicted right now."""
    return {
        "block_bytes": int(block_bytes),
        "capacity_bytes": int(index_stats["capacity_blocks"]) * int(block_bytes),
        "usage_bytes": int(index_stats["resident_blocks"]) * int(block_bytes),
        "pinned_bytes": int(index_stats["pinned_blocks"]) * int(block_bytes),
    }
