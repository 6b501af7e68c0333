"""Planning a load: how many leading blocks of a chain each tier holds, and how many of them are
worth loading now (the load gate's decision), counted once per plan.

The planner only reads: it looks the chain up in the CPU index and the disk tier and asks the
gate. It pins nothing and starts nothing; the loads part (`loads.LoadJobs`) does that with the
plan it is given.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvtier_rs._core import ClosedError
from kvtier_rs.checks import invalid_argument, show
from kvtier_rs.orchestrator.counters import DataPathCounters
from kvtier_rs.orchestrator.gate import LoadGate
from kvtier_rs.tiers.keys import Key, key_list


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


class PrefixIndex(Protocol):
    """What the planner asks of a tier: how many leading blocks of a chain it holds."""

    def lookup_prefix(self, keys: Sequence[Key], /) -> int: ...


class DiskHolder(Protocol):
    """Where the planner finds the disk tier (`DiskStager`): looked up at each plan, because
    the stager's disk tier can be replaced (reopened) after the planner was made."""

    @property
    def disk(self) -> PrefixIndex: ...


class LoadPlanner:
    """Makes and counts plans (see the module docstring).

    `cpu` is the CPU tier's index; `stager` holds the disk tier (None: there is none, and its
    blocks are neither looked up nor counted). `in_flight(tier)` is the number of promotions from
    `tier` in flight now, the gate's back-pressure input; `counts` receives every counted plan.
    """

    def __init__(
        self,
        cpu: PrefixIndex,
        stager: DiskHolder | None,
        gate: LoadGate,
        in_flight: Callable[[str], int],
        counts: DataPathCounters,
    ) -> None:
        self.cpu = cpu
        self.stager = stager
        self.gate = gate
        self.in_flight = in_flight
        self.counts = counts

    def plan(self, keys: Sequence[Key], gpu_hit_blocks: int = 0, *, count: bool = True) -> LoadPlan:
        """How many leading blocks of `keys` after the first `gpu_hit_blocks` each tier holds,
        and how many of them to load (`TierOrchestrator.plan`); counted unless `count` is False."""
        keys = key_list(keys)
        if not 0 <= gpu_hit_blocks <= len(keys):
            raise invalid_argument("gpu_hit_blocks", f"{gpu_hit_blocks} not in 0..{len(keys)}")
        rest = keys[gpu_hit_blocks:]
        cpu_hits = self.cpu.lookup_prefix(rest)
        disk_hits = self._disk_hits(rest[cpu_hits:]) if cpu_hits < len(rest) else 0
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
            self.count(plan)
        return plan

    def plan_for(self, keys: list[Key], gpu_hit_blocks: int, plan: LoadPlan | None) -> tuple[LoadPlan, bool]:
        """The caller's plan (counted when it was made), or a new one, not counted yet: the
        caller counts it once the load is registered, so a call refused before that leaves no
        count behind. Returns (plan, whether the caller still has to count it)."""
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

    def count(self, plan: LoadPlan) -> None:
        """One lookup: its blocks asked of each tier, its hits, misses and refusals."""
        self.counts.count_plan(plan, has_disk=self.stager is not None)

    def _disk_hits(self, keys: list[Key]) -> int:
        """Leading blocks of `keys` the disk tier holds; none without one, or once it is closed
        (shut down, or closed by another component): the CPU tier serves on and the rest are
        misses."""
        if self.stager is None:
            return 0
        try:
            return self.stager.disk.lookup_prefix(keys)
        except ClosedError:
            return 0

    def _admit(self, tier: str, n: int, refused: dict[str, dict[str, int]]) -> int:
        """`n` if the gate lets the tier's `n` hits load, else 0 with the reason in `refused`."""
        reason = self.gate.refusal(tier, n, self.in_flight(tier)) if n else None
        if reason is None:
            return n
        refused.setdefault(tier, {})[reason] = n
        return 0
