"""The data path's counters, as typed fields: what each plan, load and store did, per tier.

Blocks unless the name says bytes. ``TierOrchestrator.stats()`` reports them (with the tiers'
own index stats and the stager's counters); the metrics exporter turns them into series.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Protocol

from kvtier_rs.orchestrator.gate import REFUSAL_REASONS


class PlannedLookup(Protocol):
    """What a plan says of one lookup (``LoadPlan``), as far as counting goes."""

    @property
    def total(self) -> int: ...
    @property
    def gpu_hits(self) -> int: ...
    @property
    def cpu_hits(self) -> int: ...
    @property
    def disk_hits(self) -> int: ...
    @property
    def remote_hits(self) -> int: ...
    @property
    def misses(self) -> int: ...
    @property
    def refused(self) -> Mapping[str, Mapping[str, int]]: ...


def _no_refusals() -> dict[str, int]:
    return dict.fromkeys(REFUSAL_REASONS, 0)


@dataclass
class TierCounters:
    """One tier's side of the lookups."""

    #: Blocks asked of the tier: the GPU sees a whole chain, the CPU tier what the GPU missed,
    #: the disk tier what the CPU tier missed.
    lookup_blocks: int = 0
    #: Leading blocks it held.
    hit_blocks: int = 0
    #: Hits loaded onto the device (from the CPU tier, or from disk staged through it).
    promoted_blocks: int = 0
    #: Hits recomputed instead of loaded, by the load gate's reason.
    refused: dict[str, int] = field(default_factory=_no_refusals)


@dataclass
class DataPathCounters:
    lookups: int = 0
    miss_blocks: int = 0
    gpu: TierCounters = field(default_factory=TierCounters)
    cpu: TierCounters = field(default_factory=TierCounters)
    disk: TierCounters = field(default_factory=TierCounters)
    remote: TierCounters = field(default_factory=TierCounters)
    # Device -> CPU stores.
    cpu_stored_blocks: int = 0
    cpu_store_failed_blocks: int = 0
    #: Blocks an offload would have added when every CPU slot was pinned or being written.
    cpu_store_no_space_blocks: int = 0
    #: Blocks not stored because the CPU index disabled itself (an internal error).
    cpu_store_index_failed_blocks: int = 0
    #: Blocks the CPU tier's admission rule turned away.
    cpu_store_refused: int = 0
    # Loads.
    load_failed_blocks: int = 0
    load_released_blocks: int = 0
    load_unreserved_blocks: int = 0
    #: Disk (and remote) parts of loads given up because their read took longer than
    #: disk_read_timeout_s.
    disk_read_timeout_blocks: int = 0
    d2h_bytes: int = 0
    h2d_bytes: int = 0

    def tier(self, name: str) -> TierCounters:
        """The counters of tier `name` ("gpu", "cpu", "disk" or "remote")."""
        tiers = {"gpu": self.gpu, "cpu": self.cpu, "disk": self.disk, "remote": self.remote}
        return tiers[name]

    def count_plan(self, plan: PlannedLookup, *, staged: tuple[str, ...]) -> None:
        """One lookup: its blocks asked of each tier, its hits and misses, every refusal.
        `staged`: the tiers behind the CPU tier that were asked, in chain order."""
        self.lookups += 1
        self.gpu.lookup_blocks += plan.total
        self.cpu.lookup_blocks += plan.total - plan.gpu_hits
        asked = plan.total - plan.gpu_hits - plan.cpu_hits
        for tier in staged:
            self.tier(tier).lookup_blocks += asked
            asked -= plan.disk_hits if tier == "disk" else plan.remote_hits
        self.gpu.hit_blocks += plan.gpu_hits
        self.cpu.hit_blocks += plan.cpu_hits
        self.disk.hit_blocks += plan.disk_hits
        self.remote.hit_blocks += plan.remote_hits
        self.miss_blocks += plan.misses
        for tier, reasons in plan.refused.items():
            refused = self.tier(tier).refused
            for reason, n in reasons.items():
                refused[reason] += n

    def as_dict(self) -> dict[str, object]:
        return asdict(self)
