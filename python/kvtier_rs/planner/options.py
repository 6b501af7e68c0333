"""What `kvtier plan` is asked: its options as one value, at the bottom of the planner's imports
(the checks, the plan and the CLI all read it; it reads none of them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier_rs import defaults as D
from kvtier_rs.planner.units import Size

DEFAULT_POLICIES = ("fifo", "lru", "arc", "opt")


@dataclass
class PlanOptions:
    trace: str
    trace_format: str = "auto"
    block_size: int | None = None
    skip_bad: bool = False
    limit: int | None = None
    bytes_per_token: int | None = None
    model_config: str | None = None
    kv_dtype: str | None = None
    gpu: Size | None = None
    cpu: Size | None = None
    disk: Size | None = None
    remote: Size | None = None
    capacities: list[int] | None = None
    policies: tuple[str, ...] = DEFAULT_POLICIES
    warmup: float = 0.5
    mode: str = "tree"
    admission_thresholds: tuple[int, ...] = (2, 3)
    cpu_admission: str = D.CPU_ADMISSION
    disk_admission: str = D.DISK_ADMISSION
    tier_policy: str | None = None
    pcie_gbps: float = 25.0
    disk_gbps: float = 6.0
    # A remote store over a 10 Gb/s link, one pipelined round trip per load.
    remote_gbps: float = 1.25
    remote_latency_ms: float = 0.5
    replicas: int = 1
    split: str = "round-robin"
    prefill_tps: float = 10_000.0
    top: int = 10
    threads: int = 0
    progress: bool | None = None  # None: only when stderr is a terminal
    notes: list[str] = field(default_factory=list)
