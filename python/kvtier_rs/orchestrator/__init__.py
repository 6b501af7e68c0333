"""The engine-agnostic data path over GPU blocks, the CPU tier and the disk tier.

Names are imported on first use (PEP 562), so that `kvtier_rs.orchestrator.cost` alone (the
load-or-recompute rule the planner shares) does not pull in the transfer engines and torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier_rs.orchestrator.cost import CostModel
    from kvtier_rs.orchestrator.disk_stager import DiskStager, PromotionDone
    from kvtier_rs.orchestrator.guard import GuardRule, SloGuard
    from kvtier_rs.orchestrator.latency import BUCKETS, LatencyRecorder
    from kvtier_rs.orchestrator.loads import LoadResult, Reservation
    from kvtier_rs.orchestrator.orchestrator import TierOrchestrator
    from kvtier_rs.orchestrator.plans import LoadPlan
    from kvtier_rs.orchestrator.request_guard import RequestGuard, RequestRule
    from kvtier_rs.orchestrator.stats import DataPathSnapshot
    from kvtier_rs.orchestrator.stores import OffloadTicket

# Each public name and the submodule that defines it.
_WHERE = {
    "BUCKETS": "latency",
    "CostModel": "cost",
    "DataPathSnapshot": "stats",
    "DiskStager": "disk_stager",
    "GuardRule": "guard",
    "LatencyRecorder": "latency",
    "LoadPlan": "plans",
    "LoadResult": "loads",
    "OffloadTicket": "stores",
    "PromotionDone": "disk_stager",
    "RequestGuard": "request_guard",
    "RequestRule": "request_guard",
    "Reservation": "loads",
    "SloGuard": "guard",
    "TierOrchestrator": "orchestrator",
}

__all__ = [
    "BUCKETS",
    "CostModel",
    "DataPathSnapshot",
    "DiskStager",
    "GuardRule",
    "LatencyRecorder",
    "LoadPlan",
    "LoadResult",
    "OffloadTicket",
    "PromotionDone",
    "RequestGuard",
    "RequestRule",
    "Reservation",
    "SloGuard",
    "TierOrchestrator",
]
assert sorted(_WHERE) == __all__


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value  # later lookups skip this function
    return value
