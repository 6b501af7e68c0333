"""Planning a load: how many leading blocks of a chain each tier holds, and how many of them are
worth loading now (the load gate's decision), counted once per plan.

The planner only reads: it looks the chain up in the CPU index, then in each tier staged
through it (the disk tier, then the shared remote tier: a chain continues where the tier before
it stops) and asks the gate. It pins nothing and starts nothing; the loads part
(`loads.LoadJobs`) does that with the plan it is given. For a tier that learns presence by
asking (the remote tier) it sends one batched probe of the blocks after the hits, without
waiting: the answer serves the next lookup.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
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
    remote_hits: int = 0  # blocks after the disk hits the remote tier is known to hold
    load_remote: int = 0  # of those, to stage and load

    @property
    def misses(self) -> int:
        return self.total - self.gpu_hits - self.cpu_hits - self.disk_hits - self.remote_hits

    @property
    def loaded(self) -> int:
        return self.load_cpu + self.load_disk + self.load_remote

    def hits_of(self, tier: str) -> int:
        """Hits of `tier` ("cpu", "disk" or "remote")."""
        return {"cpu": self.cpu_hits, "disk": self.disk_hits, "remote": self.remote_hits}[tier]

    def load_of(self, tier: str) -> int:
        """Blocks of `tier` to load."""
        return {"cpu": self.load_cpu, "disk": self.load_disk, "remote": self.load_remote}[tier]


class PrefixIndex(Protocol):
    """What the planner asks of a tier: how many leading blocks of a chain it holds."""

    def lookup_prefix(self, keys: Sequence[Key], /) -> int: ...


class DiskHolder(Protocol):
    """Where the planner finds a staged tier (`DiskStager`): looked up at each plan, because
    the stager's tier can be replaced (reopened) after the planner was made."""

    @property
    def disk(self) -> PrefixIndex: ...


class LoadPlanner:
    """Makes and counts plans (see the module docstring).

    `cpu` is the CPU tier's index; `stagers` hold the tiers staged through it, by name, in chain
    order ("disk", then "remote"; a tier not there is neither looked up nor counted).
    `in_flight(tier)` is the number of promotions from `tier` in flight now, the gate's
    back-pressure input; `counts` receives every counted plan.
    """

    def __init__(
        self,
        cpu: PrefixIndex,
        stagers: Mapping[str, DiskHolder],
        gate: LoadGate,
        in_flight: Callable[[str], int],
        counts: DataPathCounters,
    ) -> None:
        self.cpu = cpu
        self.stagers = dict(stagers)
        self.gate = gate
        self.in_flight = in_flight
        self.counts = counts

    def plan(self, keys: Sequence[Key], gpu_hit_blocks: int = 0, *, count: bool = True) -> LoadPlan:
        """How many leading blocks of `keys` after the first `gpu_hit_blocks` each tier holds,
        and how many of them to load (`TierOrchestrator.plan`); counted unless `count` is False."""
        keys = key_list(keys)
        rest = past_gpu_hits(keys, gpu_hit_blocks)
        hits = {"cpu": self.cpu.lookup_prefix(rest)}
        refused: dict[str, dict[str, int]] = {}
        loads = {"cpu": self._admit("cpu", hits["cpu"], refused)}
        # Why the chain is cut, once a tier's hits are refused: every later tier's hits are
        # refused for the same reason (a chain with a hole cannot be used past the hole).
        cut = next(iter(refused["cpu"])) if loads["cpu"] < hits["cpu"] else None
        at = hits["cpu"]
        for tier in self.stagers:
            hits[tier] = self._hits(tier, rest[at:]) if at < len(rest) else 0
            if cut is None:
                loads[tier] = self._admit(tier, hits[tier], refused)
                if loads[tier] < hits[tier]:
                    cut = next(iter(refused[tier]))
            else:
                loads[tier] = 0
                if hits[tier]:
                    refused.setdefault(tier, {})[cut] = hits[tier]
            at += hits[tier]
            self._ask(tier, rest[at:])
        plan = LoadPlan(
            len(keys),
            gpu_hit_blocks,
            hits["cpu"],
            hits.get("disk", 0),
            loads["cpu"],
            loads.get("disk", 0),
            refused,
            remote_hits=hits.get("remote", 0),
            load_remote=loads.get("remote", 0),
        )
        if count:
            self.count(plan)
        return plan

    def asked_of(self, tier: str, keys: Sequence[Key], gpu_hit_blocks: int = 0) -> list[Key]:
        """The blocks of `keys` after the first `gpu_hit_blocks` and past the leading hits of
        every tier before staged `tier` in the chain: what `tier` is asked about. Unlike `plan`,
        it consults no gate (whose refusals start cost-probe clocks) and counts nothing."""
        if tier not in self.stagers:
            raise invalid_argument("tier", f"{tier!r} is not a staged tier here; staged: {', '.join(self.stagers)}")
        rest = past_gpu_hits(key_list(keys), gpu_hit_blocks)
        at = self.cpu.lookup_prefix(rest)
        for before in self.stagers:
            if before == tier or at == len(rest):
                break
            at += self._hits(before, rest[at:])
        return rest[at:]

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
        self.counts.count_plan(plan, staged=tuple(self.stagers))

    def _hits(self, tier: str, keys: list[Key]) -> int:
        """Leading blocks of `keys` a staged tier holds; none once it is closed (shut down, or
        closed by another component): the tiers before it serve on and the rest are misses."""
        try:
            return self.stagers[tier].disk.lookup_prefix(keys)
        except ClosedError:
            return 0

    def _ask(self, tier: str, keys: list[Key]) -> None:
        """Ask a tier that learns presence by probing (the remote tier) about `keys`, without
        waiting: a tier that owns its index (the disk tier) has no `probe`."""
        probe = getattr(self.stagers[tier].disk, "probe", None)
        if keys and probe is not None:
            probe(keys)

    def _admit(self, tier: str, n: int, refused: dict[str, dict[str, int]]) -> int:
        """`n` if the gate lets the tier's `n` hits load, else 0 with the reason in `refused`."""
        reason = self.gate.refusal(tier, n, self.in_flight(tier)) if n else None
        if reason is None:
            return n
        refused.setdefault(tier, {})[reason] = n
        return 0


def past_gpu_hits(keys: list[Key], gpu_hit_blocks: int) -> list[Key]:
    """`keys` after the first `gpu_hit_blocks`, which must be within them."""
    if not 0 <= gpu_hit_blocks <= len(keys):
        raise invalid_argument("gpu_hit_blocks", f"{gpu_hit_blocks} not in 0..{len(keys)}")
    return keys[gpu_hit_blocks:]
