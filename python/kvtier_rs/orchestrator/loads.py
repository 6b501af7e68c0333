"""The load jobs: bringing a plan's CPU, disk and remote hits onto the device, from reservation
to result.

A load runs in two steps (`TierOrchestrator.load` runs both at once):

    reserve   pin the CPU hits; start the reads of the staged parts (the disk hits, then the
              remote hits after them) into reserved CPU slots
    bind      take the destinations and submit the host -> device copies of what is in the CPU
              tier; a staged part's copies follow once its read has landed and been verified

and finishes when every copy of every part has landed (or failed): its `LoadResult` is then
final and handed out by `take_finished`. `release` gives back a reservation never bound.

Every load and every staged read no load owns any more is a promotion in flight (`InFlight`):
the planner's back-pressure and the stall detector (`stalls.StallDetector`) read them there.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvtier_rs._core import BlockIndex, IndexFailedError, KvTierError, NotReadyError
from kvtier_rs.checks import invalid_argument
from kvtier_rs.orchestrator.cost import CostModel
from kvtier_rs.orchestrator.counters import DataPathCounters
from kvtier_rs.orchestrator.disk_stager import DiskStager, PromotionDone
from kvtier_rs.orchestrator.guard import SloGuard
from kvtier_rs.orchestrator.latency import LatencyRecorder
from kvtier_rs.orchestrator.plans import LoadPlan
from kvtier_rs.tiers.events import EventStream
from kvtier_rs.tiers.keys import Key
from kvtier_rs.transfer import TransferEngine, TransferResult

#: The tiers staged through the CPU tier, in chain order: a load's disk part follows its CPU
#: part, and its remote part follows the disk part.
STAGED_TIERS = ("disk", "remote")


@dataclass(frozen=True)
class Reservation:
    """What a reserved load holds (`TierOrchestrator.reserve`): the first `cpu` blocks after
    the GPU hits are pinned in the CPU tier, and the `disk` blocks after them, then the `remote`
    blocks after those, have CPU slots reserved and their reads started. Nothing can evict or
    take these; only a staged block that fails verification (or, for the remote tier, is gone
    from the store) can still make the load shorter."""

    request_id: Any
    plan: LoadPlan
    cpu: int
    disk: int
    remote: int = 0

    @property
    def blocks(self) -> int:
        return self.cpu + self.disk + self.remote


@dataclass
class LoadResult:
    """Per-request accounting of one load."""

    request_id: Any
    plan: LoadPlan
    loaded_cpu: int = 0  # blocks now on the device that came from the CPU tier
    loaded_disk: int = 0  # ... from the disk tier (through the CPU tier)
    failed: int = 0  # planned blocks that could not be loaded (the engine recomputes them)
    # Planned staged hits with no CPU slot free to stage through when the load started (and
    # the blocks after them): never attempted (nor promised, by a caller that promises
    # `Reservation.blocks`), recomputed.
    unreserved: int = 0
    seconds: float = 0.0
    bytes: int = 0
    loaded_remote: int = 0  # ... from the remote tier (through the CPU tier)

    @property
    def loaded(self) -> int:
        return self.loaded_cpu + self.loaded_disk + self.loaded_remote

    def loaded_from(self, tier: str) -> int:
        return {"cpu": self.loaded_cpu, "disk": self.loaded_disk, "remote": self.loaded_remote}[tier]

    def set_loaded(self, tier: str, n: int) -> None:
        setattr(self, f"loaded_{tier}", n)


@dataclass
class Copies:
    """The host -> device copies of one part of a load (the CPU hits, or a staged tier's hits
    once promoted): one engine job per region group, so a per-layer wait can return early.

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
    # (`stalls.StallDetector`); its completion is not recorded again.
    stall_recorded: bool = False


class OrphanRead(NamedTuple):
    """A staged read still in flight that no load owns any more (see `InFlight.orphan_reads`)."""

    job: int
    started: float  # when the read started (perf_counter)
    tier: str = "disk"


@dataclass
class StagedPart:
    """The part of a load that comes from one tier staged through the CPU tier: its read into
    reserved CPU slots, then its copies."""

    tier: str
    copies: Copies = field(default_factory=Copies)
    read: int | None = None  # the read job in flight
    # When its read started: at reserve, or earlier for a read taken over from a released
    # reservation; kept if the read is orphaned again, so stall detection sees its true age.
    read_started: float = 0.0
    slots: list[int] | None = None  # read, verified and pinned before the destinations were known

    @property
    def busy(self) -> bool:
        return self.read is not None or bool(self.copies.jobs)


def _staged_parts() -> dict[str, StagedPart]:
    return {t: StagedPart(t) for t in STAGED_TIERS}


@dataclass
class LoadJob:
    """One request's load, from its reservation until it finishes."""

    result: LoadResult
    keys: list[Key]  # blocks after the GPU hits
    started: float  # when it was reserved (the staged reads start then)
    cpu: Copies = field(default_factory=Copies)
    #: The staged parts, by tier, in chain order.
    staged: dict[str, StagedPart] = field(default_factory=_staged_parts)
    cpu_slots: list[int] = field(default_factory=list)  # of the CPU part, pinned at reserve
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
    def disk(self) -> Copies:
        """The disk part's copies."""
        return self.staged["disk"].copies

    @property
    def reserved(self) -> int:
        return len(self.cpu.keys) + sum(len(p.copies.keys) for p in self.staged.values())

    def open_jobs(self) -> bool:
        return bool(self.cpu.jobs) or any(p.busy for p in self.staged.values())

    def held_blocks(self) -> int | None:
        """Of an unbound load: None while a staged read is in flight; then its blocks held in
        the CPU tier (pinned), which bind will copy."""
        if any(part.read is not None for part in self.staged.values()):
            return None
        cpu = 0 if self.cpu.failed else len(self.cpu.keys)
        return cpu + sum(len(part.copies.keys) for part in self.staged.values())

    def first_block(self, tier: str) -> int:
        """Where a staged part's blocks start among the destinations: after the planned blocks
        of every part before it."""
        plan = self.result.plan
        at = plan.load_cpu
        for t in self.staged:
            if t == tier:
                return at
            at += plan.load_of(t)
        raise KeyError(tier)

    def groups_ready(self) -> int:
        """Leading region groups in place on the device for every part of this load."""
        if not self.bound:
            return 0
        n = len(self.groups) if self.groups else 1
        ready = n
        parts = [(self.cpu, False)] + [(p.copies, p.read is not None) for p in self.staged.values()]
        for part, pending in parts:
            if pending:
                return 0
            if part.keys and (part.jobs or part.failed):
                g = 0
                while g < n and g in part.done_groups:
                    g += 1
                ready = min(ready, g)
        return ready


class InFlight:
    """The promotions in flight: every load not finished yet (reserved or bound), by request
    id, and the staged reads still running that no load owns any more (their reservation was
    released, or their load gave up on them), by chain. An orphaned read still holds CPU
    staging slots and a place in the disk's queue, so back-pressure and stall detection count
    it like a load's.

    Read from a metrics scrape's thread (`stats()`) while the engine thread adds and retires
    loads: readers take a snapshot of a dict before iterating it."""

    def __init__(self) -> None:
        self.loads: dict[Any, LoadJob] = {}
        # By (tier, chain): a reservation of the same chain from the same tier takes it over.
        self.orphan_reads: dict[tuple[str, tuple[Key, ...]], OrphanRead] = {}

    def promotions(self, tier: str) -> int:
        """Promotions from `tier` in flight now (the gate's back-pressure input)."""
        loads = list(self.loads.values())
        if tier == "cpu":
            return sum(1 for ld in loads if ld.cpu.jobs)
        orphans = sum(1 for o in list(self.orphan_reads.values()) if o.tier == tier)
        return sum(1 for ld in loads if ld.staged[tier].busy) + orphans

    def bound(self) -> int:
        """Loads past bind: jobs the engine waits for (a reservation alone is none)."""
        return sum(1 for ld in self.loads.values() if ld.bound)


class LoadJobs:
    """Runs the loads (see the module docstring): pins, staged reads, copies, results.

    Dependencies, each for one thing: `index` (the CPU tier's: pins and unpins), `engine` (the
    host -> device copies), `stagers` (the staged tiers' reads, by tier; a tier not configured
    is not there), `counts` (the load counters), `latency` (a recorder per tier, of what the
    engine waited for a part),
    `guards` (a sample per finished part), `cost` (the measured hops), `events` (promotions).
    """

    def __init__(
        self,
        in_flight: InFlight,
        *,
        index: BlockIndex,
        engine: TransferEngine,
        stagers: Mapping[str, DiskStager],
        counts: DataPathCounters,
        latency: Mapping[str, LatencyRecorder],
        guards: Mapping[str, SloGuard],
        cost: CostModel | None,
        events: EventStream | None,
        reused: Callable[[list[Key]], None] | None = None,
    ) -> None:
        self.in_flight = in_flight
        #: Called with the blocks of each load served from the CPU tier: a use that a staged
        #: tier's admission may count (the remote tier's uses:K wants reuse evidence).
        self.reused = reused
        self.index = index
        self.engine = engine
        self.stagers = dict(stagers)
        self.counts = counts
        self.latency = latency
        self.guards = guards
        self.cost = cost
        self.events = events
        self._ids = itertools.count(1)
        self._job_owner: dict[int, Any] = {}  # engine h2d job -> request id
        self._read_owner: dict[tuple[str, int], Any] = {}  # (tier, read job) -> request id
        self._done: list[LoadResult] = []

    # ---- reserve, bind, release ----------------------------------------------------------
    def new_request_id(self, request_id: Any) -> Any:
        """`request_id`, or a fresh one for None; refused while it names a load in flight."""
        request_id = next(self._ids) if request_id is None else request_id
        if request_id in self.in_flight.loads:
            raise invalid_argument("request_id", f"{request_id!r} already has a load in flight")
        return request_id

    def reserve(self, keys: list[Key], request_id: Any, plan: LoadPlan) -> LoadJob:
        """Register a load and hold its parts: pin the CPU part, start the staged parts' reads."""
        rest = keys[plan.gpu_hits :]
        ld = LoadJob(LoadResult(request_id, plan), rest, time.perf_counter())
        self.in_flight.loads[request_id] = ld
        if plan.load_cpu:
            ld.cpu.keys = rest[: plan.load_cpu]
            try:
                ld.cpu_slots = self.index.pin_for_load(ld.cpu.keys)
            except (NotReadyError, IndexFailedError):
                # Evicted (or the index failed) since the plan: everything is recomputed.
                ld.cpu.failed = True
                ld.cpu.keys = []
        cut = ld.cpu.failed  # a part that cannot start cuts the chain: the parts after it are useless
        for part in ld.staged.values():
            n = plan.load_of(part.tier)
            if not n or ld.cpu.failed:
                continue
            if cut:
                ld.result.unreserved += n  # after a part with no CPU slot: recomputed as well
                continue
            first = ld.first_block(part.tier)
            part.copies.keys = rest[first : first + n]
            if not self._start_read(ld, part):
                ld.result.unreserved += n  # no CPU slot to stage through: recomputed
                part.copies.keys = []
                cut = True
        return ld

    def _start_read(self, ld: LoadJob, part: StagedPart) -> bool:
        """Start a staged part's read into reserved CPU slots; False when there is no room."""
        chain = (part.tier, tuple(part.copies.keys))
        # The same chain's read, started for a reservation that was given back and still in
        # flight (a request asked again), is taken over: its slots are held, its read runs on.
        orphan = self.in_flight.orphan_reads.pop(chain, None)
        job = self.stagers[part.tier].promote(part.copies.keys) if orphan is None else orphan.job
        if job is None:
            return False
        part.read_started = ld.started if orphan is None else orphan.started
        part.read = job
        self._read_owner[(part.tier, job)] = ld.result.request_id
        return True

    def bind(self, ld: LoadJob, gpu_ids: list[int], groups: list[list[int]] | None, after_stream: object) -> LoadResult:
        """Set a reserved load's destinations and submit the copies of what is in the CPU tier."""
        ld.gpu_ids, ld.groups, ld.bound_at = gpu_ids, groups, time.perf_counter()
        ld.after_stream = after_stream
        if ld.cpu.keys and not self._submit_copies(ld, ld.cpu, ld.cpu_slots, gpu_ids[: len(ld.cpu.keys)]):
            ld.cpu.failed = True
            ld.cpu.keys = []
        for part in ld.staged.values():
            if part.slots is not None:  # read and pinned before the destinations were known
                slots, part.slots = part.slots, None
                self._copy_promoted(ld, part, slots)
        self._maybe_finish(ld)
        return ld.result

    def unbound(self, request_id: Any, where: str) -> LoadJob:
        """The reservation of `request_id` not bound yet; refused (naming `where`) otherwise."""
        ld = self.in_flight.loads.get(request_id)
        if ld is None or ld.bound:
            raise invalid_argument(
                "request_id",
                f"{request_id!r} has no unbound reservation to {where} "
                f"({'already bound' if ld is not None else 'never reserved, or finished or released'})",
            )
        return ld

    def release(self, request_id: Any) -> None:
        """Give back an unbound reservation (`TierOrchestrator.release`)."""
        ld = self.unbound(request_id, "release")
        if ld.cpu.keys:
            self.index.unpin(ld.cpu.keys)
        for part in ld.staged.values():
            if part.slots is not None and part.copies.keys:
                self.index.unpin(part.copies.keys)
            if part.read is not None:
                # The read runs on; a reservation of the same chain before it lands takes it over.
                self._orphan_read(part)
        self.counts.load_released_blocks += ld.reserved
        del self.in_flight.loads[request_id]

    def give_up_read(self, ld: LoadJob, tier: str) -> None:
        """Drop a bound load's staged part whose read takes too long: its blocks are recomputed
        (the destinations were never written: the copies start only once the read has landed),
        and the read lands in the CPU tier owned by no load, as one released unbound would."""
        part = ld.staged[tier]
        assert part.read is not None
        self._orphan_read(part)
        self.counts.disk_read_timeout_blocks += len(part.copies.keys)
        part.copies.keys = []
        self._maybe_finish(ld)

    def _orphan_read(self, part: StagedPart) -> None:
        """Hand a part's read, still in flight, over to no load (see `InFlight`)."""
        assert part.read is not None
        job, part.read = part.read, None
        self._read_owner.pop((part.tier, job), None)
        self.in_flight.orphan_reads[(part.tier, tuple(part.copies.keys))] = OrphanRead(
            job, part.read_started, part.tier
        )

    # ---- queries -------------------------------------------------------------------------
    def is_reserved(self, request_id: Any) -> bool:
        """Whether `request_id` names a reservation not bound yet."""
        ld = self.in_flight.loads.get(request_id)
        return ld is not None and not ld.bound

    def groups_ready(self, request_id: Any) -> int | None:
        """Leading region groups of a load in flight on the device; None without one."""
        ld = self.in_flight.loads.get(request_id)
        return None if ld is None else ld.groups_ready()

    def take_finished(self) -> list[LoadResult]:
        """The loads that finished since the last call."""
        out, self._done = self._done, []
        return out

    # ---- copies --------------------------------------------------------------------------
    def _copy_promoted(self, ld: LoadJob, part: StagedPart, slots: list[int]) -> None:
        """Submit the copies of a staged part (read, verified and pinned in the CPU tier)."""
        keys = part.copies.keys
        if ld.cpu.failed:
            # The chain broke at its first CPU block: nothing after it is usable either.
            self.index.unpin(keys)
            part.copies.keys = []
            return
        assert ld.gpu_ids is not None
        first = ld.first_block(part.tier)
        if not self._submit_copies(ld, part.copies, slots, ld.gpu_ids[first : first + len(keys)]):
            part.copies.keys = []

    def _submit_copies(self, ld: LoadJob, part: Copies, slots: list[int], gpu_ids: list[int]) -> bool:
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
                self.index.unpin(part.keys)
                return False
            part.jobs[job] = gi
            self._job_owner[job] = ld.result.request_id
        return True

    # ---- completions ---------------------------------------------------------------------
    def on_transfer(self, r: TransferResult) -> None:
        """A host -> device copy job landed (or failed)."""
        request_id = self._job_owner.pop(r.job_id, None)
        ld = self.in_flight.loads.get(request_id)
        if ld is None:
            return
        self.counts.h2d_bytes += r.bytes
        part, tier = ld.cpu, "cpu"
        if r.job_id not in ld.cpu.jobs:
            tier = next(t for t, p in ld.staged.items() if r.job_id in p.copies.jobs)
            part = ld.staged[tier].copies
        group = part.jobs.pop(r.job_id)
        part.finished = max(part.finished, r.finished_at)
        part.copies_started = min(part.copies_started, r.started_at)
        if r.success:
            part.done_groups.add(group)
            part.bytes += r.bytes
        else:
            part.failed = True
        if not part.jobs:  # every group of this part has landed (or failed)
            self.index.unpin(part.keys)
            # What the engine waited for: from the destinations on to the last copy's
            # completion, for either part (a disk read started at reserve time only shortens
            # the wait; scheduling time between reserve and bind is not the tier's). The
            # completion time is the engine's, not when this poll noticed it: otherwise an
            # engine polling once a step would time its own step.
            elapsed = part.finished - ld.bound_at
            if not part.failed:
                if self.cost is not None:
                    # One host -> device transfer: all its bytes over first copy start to last
                    # completion (see Copies). A failed part measures nothing.
                    self.cost.observe("cpu", part.bytes, max(0.0, part.finished - part.copies_started))
                ld.result.set_loaded(tier, len(part.keys))
                self.latency[tier].observe(elapsed)
            # A failed load cost the engine its wait too: the guard sees it (the histogram
            # is of loads that landed; failures are counted in load_failed).
            self._guard_sample(tier, ld, part, elapsed)
        self._maybe_finish(ld)

    def on_promotion(self, p: PromotionDone, tier: str = "disk") -> None:
        """A read of staged tier `tier` landed in the CPU tier (its verified prefix is
        `p.ok_prefix` blocks)."""
        # Every read measures the tier's hop, also one no load waits for any more (released, or
        # given up after disk_read_timeout_s): those are the slowest reads, and a tier whose
        # reads all outlast the timeout would otherwise never be measured at all.
        if self.cost is not None:
            self.cost.observe(tier, p.bytes, p.seconds)
        request_id = self._read_owner.pop((tier, p.job_id), None)
        orphans = self.in_flight.orphan_reads
        chain = (tier, tuple(p.keys))
        orphan = orphans.get(chain)
        if request_id is None and orphan is not None and orphan.job == p.job_id:
            del orphans[chain]  # landed in the CPU tier, owned by no load
        ld = self.in_flight.loads.get(request_id)
        if ld is None:
            return
        part = ld.staged[tier]
        part.read = None
        if p.ok_prefix == 0 and ld.bound:
            # The read failed while the engine waited on it: a sample for the guard, from the
            # destinations on to the read's end (it started at reserve time).
            self._guard_sample(tier, ld, part.copies, max(0.0, ld.started + p.seconds - ld.bound_at))
        keys = part.copies.keys = part.copies.keys[: p.ok_prefix]
        if not keys or ld.cpu.failed:
            part.copies.keys = []
            self._maybe_finish(ld)
            return
        try:
            slots = self.index.pin_for_load(keys)
        except (NotReadyError, IndexFailedError):
            part.copies.keys = []
            self._maybe_finish(ld)
            return
        if not ld.bound:
            part.slots = slots  # pinned until bind gives the destinations
            return
        self._copy_promoted(ld, part, slots)
        self._maybe_finish(ld)

    def _guard_sample(self, tier: str, ld: LoadJob, part: Copies, waited: float) -> None:
        """A finished promotion's wait, for the tier's guard, unless it was taken already while
        the promotion was stalled. With its age (since bind, now): `waited` ends at the copy's
        completion, maybe long before this poll, and the guard tells a load that was in flight
        at a trip by when it started."""
        guard = self.guards.get(tier)
        if guard is not None and not part.stall_recorded:
            guard.record(waited, started_s_ago=time.perf_counter() - ld.bound_at)

    def _maybe_finish(self, ld: LoadJob) -> None:
        """Retire a bound load once no job of it is open: its result is final."""
        if ld.open_jobs() or not ld.bound:
            return
        res = ld.result
        # A chain with a hole cannot be used past the hole: a part counts only while every part
        # before it loaded all it planned (the CPU part broken at its first block: none counts).
        whole = not ld.cpu.failed
        for tier in ld.staged:
            if not whole:
                res.set_loaded(tier, 0)
            whole = whole and res.loaded_from(tier) == res.plan.load_of(tier)
        if ld.cpu.failed:
            res.loaded_cpu = 0
        res.failed = res.plan.loaded - res.unreserved - res.loaded
        # What the engine waited for: from the destinations on (a read started at reserve time
        # only shortens it).
        res.seconds = time.perf_counter() - ld.bound_at
        res.bytes = res.loaded * self.engine.layout.bytes_per_block
        c = self.counts
        c.cpu.promoted_blocks += res.loaded_cpu
        for tier in ld.staged:
            c.tier(tier).promoted_blocks += res.loaded_from(tier)
        c.load_failed_blocks += res.failed
        c.load_unreserved_blocks += res.unreserved
        if self.reused is not None and res.loaded_cpu:
            self.reused(ld.cpu.keys[: res.loaded_cpu])
        if self.events is not None:
            self.events.publish("promoted", "cpu", ld.cpu.keys[: res.loaded_cpu])
            for tier, part in ld.staged.items():
                self.events.publish("promoted", tier, part.copies.keys[: res.loaded_from(tier)])
        del self.in_flight.loads[res.request_id]
        self._done.append(res)
