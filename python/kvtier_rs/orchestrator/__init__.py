"""The engine-agnostic data path over GPU blocks, the CPU tier and the disk tier."""

from kvtier_rs.orchestrator.cost import CostModel
from kvtier_rs.orchestrator.disk_stager import DiskStager, PromotionDone
from kvtier_rs.orchestrator.guard import GuardRule, SloGuard
from kvtier_rs.orchestrator.latency import BUCKETS, LatencyRecorder
from kvtier_rs.orchestrator.orchestrator import (
    LoadPlan,
    LoadResult,
    OffloadTicket,
    Reservation,
    TierOrchestrator,
)

__all__ = [
    "BUCKETS",
    "CostModel",
    "DiskStager",
    "GuardRule",
    "LatencyRecorder",
    "LoadPlan",
    "LoadResult",
    "OffloadTicket",
    "PromotionDone",
    "Reservation",
    "SloGuard",
    "TierOrchestrator",
]
