"""TierOrchestrator: one engine-agnostic object over the engine's device blocks, the CPU tier,
the disk tier and the shared remote tier (both optional, both staged through the CPU tier).
Engine adapters call it; it never imports an engine.

    offload(keys, gpu_block_ids)      device -> CPU now, CPU -> disk and remote (write-through,
                                      by each tier's admission rule) once the CPU copy is done
    plan(keys, gpu_hit_blocks)        per tier, how many leading blocks hit, and how many of them
                                      are worth loading (cost model, back-pressure, SLO guard);
                                      counted: one lookup, its hits, misses and refusals
    load(keys, gpu_block_ids, ...)    CPU hits -> device; disk, then remote hits -> CPU -> device
                                      (staged); plans (and counts) first unless given the plan
    probe(keys, ..., wait_s)          ask the remote tier which blocks after the local hits it
                                      holds, waiting at most wait_s for the answer
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

The class is a facade: it checks the public arguments and routes each call to the part that
does the job, each in its own module and usable on its own:

    plans.LoadPlanner        lookups and the load gate's decision; counts plans
    loads.LoadJobs           reserve, bind, release; the copies; the loads' results
    stores.StoreJobs         offloads and their write-through to the disk tier
    stalls.StallDetector     promotions in flight too long: guard samples, hung tiers, timeouts
    stats.DataPathStats      the stats: a typed snapshot, and the mapping of it
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import Any

from kvtier_rs import defaults as D
from kvtier_rs.checks import check_count, check_number, invalid_argument
from kvtier_rs.orchestrator.completions import handle_each
from kvtier_rs.orchestrator.cost import CostModel
from kvtier_rs.orchestrator.counters import DataPathCounters
from kvtier_rs.orchestrator.disk_contract import StagingDisk
from kvtier_rs.orchestrator.disk_stager import DiskStager
from kvtier_rs.orchestrator.gate import LoadGate
from kvtier_rs.orchestrator.guard import GuardRule
from kvtier_rs.orchestrator.latency import LatencyRecorder
from kvtier_rs.orchestrator.loads import STAGED_TIERS, InFlight, LoadJob, LoadJobs, LoadResult, Reservation
from kvtier_rs.orchestrator.plans import LoadPlan, LoadPlanner, past_gpu_hits
from kvtier_rs.orchestrator.stalls import StallDetector
from kvtier_rs.orchestrator.stats import DataPathSnapshot, DataPathStats, occupancy
from kvtier_rs.orchestrator.stores import OffloadTicket, StoreJobs
from kvtier_rs.tiers.events import EventStream
from kvtier_rs.tiers.host import HostTier
from kvtier_rs.tiers.keys import Key, index_list, key_list
from kvtier_rs.transfer import TransferEngine, TransferResult

# The names this module has always exported, now defined by the parts.
__all__ = ["LoadPlan", "LoadResult", "OffloadTicket", "Reservation", "TierOrchestrator", "occupancy"]


class TierOrchestrator:  # noqa: PLR0904 - the public API, one delegating method per call
    def __init__(
        self,
        host: HostTier,
        engine: TransferEngine,
        *,
        disk: StagingDisk | None = None,
        remote: StagingDisk | None = None,
        cost: CostModel | None = None,
        guards: dict[str, GuardRule] | None = None,
        max_promotions_in_flight: dict[str, int] | None = None,
        max_disk_write_backlog: int = D.DISK_MAX_WRITE_BACKLOG,
        disk_read_timeout_s: float = 10.0,
        events: EventStream | None = None,
    ) -> None:
        if engine.pool is not host.pool:
            raise invalid_argument("engine", "it must copy into this host tier's pool")
        # Checked here (naming the argument), not on the engine thread at the first plan().
        gate = LoadGate(
            guards=guards,
            max_in_flight=max_promotions_in_flight,
            cost=cost,
            tiers=("cpu", *STAGED_TIERS),
            on_change=self._tier_event,
        )
        max_disk_write_backlog = check_count("max_disk_write_backlog", max_disk_write_backlog)
        disk_read_timeout_s = check_number("disk_read_timeout_s", disk_read_timeout_s, inf_ok=True)
        self.host = host
        self.engine = engine
        #: Block stored/removed/promoted events for external indexes; None publishes nothing.
        self.events = events
        self.stager = (
            DiskStager(host, disk, max_write_backlog=max_disk_write_backlog, events=events)
            if disk is not None
            else None
        )
        #: The remote tier's stager (None: no remote tier); it writes through and promotes
        #: like the disk's, after it in the chain. Its backlog keeps the default: the tier
        #: bounds its writes in flight by bytes itself (``remote_max_write_bytes``).
        self.remote_stager = (
            DiskStager(host, remote, max_write_backlog=D.DISK_MAX_WRITE_BACKLOG, events=events, tier="remote")
            if remote is not None
            else None
        )
        #: Every staged tier's stager, by tier, in chain order.
        self.stagers: dict[str, DiskStager] = {
            tier: st for tier, st in (("disk", self.stager), ("remote", self.remote_stager)) if st is not None
        }
        #: Load or recompute, per tier: SLO guard, back-pressure, cost rule.
        self.gate = gate
        self.cost = cost
        self.guards = gate.guards
        self.max_in_flight = gate.max_in_flight
        self.counts = DataPathCounters()
        self.latency = {
            "cpu_load": LatencyRecorder(),
            "disk_load": LatencyRecorder(),
            "cpu_store": LatencyRecorder(),
            "remote_load": LatencyRecorder(),
        }
        # The parts share the promotions in flight, the counters and the recorders above.
        in_flight = InFlight()
        self._planner = LoadPlanner(host.index, self.stagers, gate, in_flight.promotions, self.counts)
        self._load_jobs = LoadJobs(
            in_flight,
            index=host.index,
            engine=engine,
            stagers=self.stagers,
            counts=self.counts,
            latency={tier: self.latency[f"{tier}_load"] for tier in ("cpu", *STAGED_TIERS)},
            guards=self.guards,
            cost=cost,
            events=events,
            reused=self._offer_reuse if self.remote_stager is not None else None,
        )
        self._store_jobs = StoreJobs(
            index=host.index,
            engine=engine,
            stagers=self.stagers,
            counts=self.counts,
            latency=self.latency["cpu_store"],
            events=events,
        )
        self._stalls = StallDetector(
            in_flight, gate, give_up=self._load_jobs.give_up_read, disk_read_timeout_s=disk_read_timeout_s
        )
        self._stats = DataPathStats(
            counts=self.counts,
            latency=self.latency,
            host=host,
            stagers=self.stagers,
            in_flight=in_flight,
            gate=gate,
            cost=cost,
            events=events,
        )
        self._in_flight = in_flight

    @property
    def disk_read_timeout_s(self) -> float:
        """A bound load whose disk (or remote) read is still in flight this long after bind
        gives up that part (recomputed; the read lands in the CPU tier, owned by no load)."""
        return self._stalls.disk_read_timeout_s

    @disk_read_timeout_s.setter
    def disk_read_timeout_s(self, seconds: float) -> None:
        self._stalls.disk_read_timeout_s = seconds

    def _offer_reuse(self, keys: list[Key]) -> None:
        """Blocks served from the CPU tier, offered again to the remote tier: its admission
        (``uses:K``) stores a block once it has been reused, not merely stored."""
        assert self.remote_stager is not None
        self.remote_stager.write_through(keys)

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
        return self._store_jobs.offload(
            keys, gpu_ids, priority=priority, duration_s=duration_s, after_stream=after_stream
        )

    def store_finished(self, job_id: int | None) -> bool:
        """Whether an offload's device -> host copy job (`OffloadTicket.job_id`) is over, finished
        or failed, as of the last `poll()`: the engine may then free the blocks it copied from.
        A ticket without a job (nothing was copied) is over."""
        return self._store_jobs.finished(job_id)

    def renew(self, keys: Sequence[Key], *, priority: int = 35, duration_s: float | None = None) -> None:
        """Give the blocks of `keys` that a tier already holds (CPU or disk) this priority and
        duration, as if just stored with them: a later claim overrides an earlier one
        (TensorRT-LLM's retention rule). Blocks no tier holds are ignored."""
        self._store_jobs.renew(key_list(keys), priority=priority, duration_s=duration_s)

    # ---- plan ----------------------------------------------------------------------------
    def plan(self, keys: Sequence[Key], gpu_hit_blocks: int = 0, *, count: bool = True) -> LoadPlan:
        """How many leading blocks of `keys` each tier holds and how many are worth loading.

        A plan is a scheduling decision and is counted here, once: one lookup, its hits and
        misses per tier and every refusal by tier and reason, whether or not the caller then
        loads (a caller that finds nothing worth loading never calls `load`). `load(plan=p)`
        does not count `p` again. Planning the same request again later is a new lookup and is
        counted again. `count=False` is for a caller that re-plans a decision already counted
        (e.g. only to route blocks to the tier that holds them now).

        The remote tier answers from what this process has learned (its writes, and probes that
        expire): a plan asks it about the blocks after the hits, without waiting, and the
        answer serves the next plan. `probe` waits for the answer."""
        return self._planner.plan(keys, gpu_hit_blocks, count=count)

    def probe(self, keys: Sequence[Key], gpu_hit_blocks: int = 0, *, wait_s: float = 0.0) -> bool:
        """Ask the remote tier, in one batched round trip, which blocks of `keys` after the first
        `gpu_hit_blocks` and the local tiers' hits it holds, and wait up to `wait_s` seconds for
        the answer, so that a `plan` right after can count them. For an engine that asks once
        per request and cannot be asked again (TensorRT-LLM). Returns whether every block
        asked about is answered (True too without a remote tier, or with nothing to ask)."""
        wait_s = check_number("wait_s", wait_s, zero_ok=True)
        if self.remote_stager is None:
            past_gpu_hits(key_list(keys), gpu_hit_blocks)  # bad arguments are refused all the same
            return True
        ask = self._planner.asked_of("remote", keys, gpu_hit_blocks)
        remote = self.remote_stager.disk
        probe, wait = getattr(remote, "probe", None), getattr(remote, "wait_answered", None)
        if not ask or probe is None or wait is None:
            return True  # a tier that owns its index answers lookups itself
        probe(ask)
        return bool(wait(ask, wait_s))

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
        plan, planned_here = self._planner.plan_for(keys, gpu_hit_blocks, plan)
        if len(gpu_ids) < plan.loaded:
            raise invalid_argument("gpu_block_ids", f"{len(gpu_ids)} ids for {plan.loaded} blocks to load")
        ld = self._reserve(keys, request_id, plan, planned_here)
        return self._load_jobs.bind(ld, gpu_ids, groups, after_stream)

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
        plan, planned_here = self._planner.plan_for(keys, gpu_hit_blocks, plan)
        ld = self._reserve(keys, request_id, plan, planned_here)
        staged = {tier: len(part.copies.keys) for tier, part in ld.staged.items()}
        return Reservation(ld.result.request_id, plan, len(ld.cpu.keys), staged["disk"], staged["remote"])

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
        ld = self._load_jobs.unbound(request_id, "bind")
        gpu_ids = self._gpu_block_ids(gpu_block_ids, distinct=True)
        groups = self._region_groups(region_groups)
        if len(gpu_ids) < ld.reserved:
            raise invalid_argument("gpu_block_ids", f"{len(gpu_ids)} ids for {ld.reserved} reserved blocks")
        return self._load_jobs.bind(ld, gpu_ids, groups, after_stream)

    def release(self, request_id: Any) -> None:
        """Give back a reservation that was never bound (its request was cancelled, or asked
        again). The pins go; a disk read still in flight finishes into the CPU tier as an
        ordinary promotion, owned by no load. No result is reported for it."""
        self._load_jobs.release(request_id)

    def is_reserved(self, request_id: Any) -> bool:
        """Whether `request_id` names a reservation not bound yet."""
        return self._load_jobs.is_reserved(request_id)

    def staged(self, request_id: Any) -> int | None:
        """For a reservation not bound yet: None while a read of a staged tier (disk, remote)
        is in flight; then how many of its blocks are held in the CPU tier for `bind` to copy.
        Fewer than `Reservation.blocks` means a read came back short (a block that failed its
        check, evicted since the probe) or could not be pinned: the reservation can no longer
        load all it promised. Refused for a request with no unbound reservation."""
        return self._load_jobs.unbound(request_id, "query").held_blocks()

    def groups_ready(self, request_id: Any) -> int | None:
        """How many leading region groups of a load in flight are on the device (all parts).
        None when the request has no load in flight (finished, or never started)."""
        return self._load_jobs.groups_ready(request_id)

    def _reserve(self, keys: list[Key], request_id: Any, plan: LoadPlan, count: bool) -> LoadJob:
        """Register a load under `request_id` (None: a new id) and hold its parts; count its
        plan first if it was made here (`LoadPlanner.plan_for`)."""
        request_id = self._load_jobs.new_request_id(request_id)
        if count:
            self._planner.count(plan)
        return self._load_jobs.reserve(keys, request_id, plan)

    def _gpu_block_ids(self, gpu_block_ids: Sequence[int], *, distinct: bool = False) -> list[int]:
        """Device block ids as ints in the layout's range; `distinct` for a load, where two
        blocks copied to one destination would leave one of them silently lost."""
        ids = index_list(gpu_block_ids, "gpu_block_ids")
        self.engine.layout.check_block_ids(ids, "gpu_block_ids", distinct=distinct)
        return ids

    def _region_groups(self, region_groups: Sequence[Sequence[int]] | None) -> list[list[int]] | None:
        if region_groups is None:
            return None
        groups = [self.engine.layout.check_regions(g) for g in region_groups]
        if not groups:
            raise invalid_argument("region_groups", "give at least one group, or None")
        return groups

    # ---- completion ----------------------------------------------------------------------
    def poll(self) -> list[LoadResult]:
        """Progress all jobs; return the loads that finished since the last call.

        Every completion is handled even if one of them raises (an internal error): the error
        is raised once the batch is done, and the loads that finished meanwhile are returned by
        the next call."""
        error = handle_each(self.engine.poll(), self._on_transfer)
        for tier, stager in self.stagers.items():
            try:
                promotions = stager.poll()
            except Exception as e:  # the stager handled its whole batch and keeps its results
                promotions, error = [], error or e
            error = error or handle_each(promotions, functools.partial(self._load_jobs.on_promotion, tier=tier))
        self._stalls.check()
        if error is not None:
            raise error
        return self._load_jobs.take_finished()

    def _on_transfer(self, r: TransferResult) -> None:
        """One engine completion, to the part whose job it was: device -> host copies are
        stores, host -> device copies are loads."""
        if r.direction == "d2h":
            self._store_jobs.on_transfer(r)
        else:
            self._load_jobs.on_transfer(r)

    def pending(self) -> int:
        """Jobs in flight. A reservation not bound yet is not a job: only its read (counted by
        the stager) is."""
        return (
            self._in_flight.bound()
            + self._store_jobs.in_flight
            + sum(st.write_backlog + st.reads_in_flight for st in self.stagers.values())
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
    def snapshot(self, *, histograms: bool = False) -> DataPathSnapshot:
        """Counters of the whole data path as frozen dataclasses, reading each tier's core stats
        once. With `histograms`, each latency also comes as cumulative Prometheus buckets (for
        the metrics collector)."""
        return self._stats.snapshot(histograms=histograms)

    def stats(self, *, histograms: bool = False) -> dict[str, Any]:
        """`snapshot()` as a mapping of plain values: its fields' names are the keys. Keys are
        only ever added, never renamed (dashboards and scripts read them)."""
        return self.snapshot(histograms=histograms).as_dict()
