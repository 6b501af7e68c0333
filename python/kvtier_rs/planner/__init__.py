"""The planner behind `kvtier plan`: trace readers, model byte accounting, a synthetic workload
generator, the replay orchestration over the Rust core, the report and its figures."""

from kvtier_rs.planner.errors import PlanError, TraceError
from kvtier_rs.planner.model import bytes_per_token_from_config
from kvtier_rs.planner.plan import PlanOptions, run_plan
from kvtier_rs.planner.synth import SynthConfig, synthesize, write_trace
from kvtier_rs.planner.traces import TraceData, read_trace
from kvtier_rs.planner.units import parse_size

__all__ = [
    "PlanError",
    "PlanOptions",
    "SynthConfig",
    "TraceData",
    "TraceError",
    "bytes_per_token_from_config",
    "parse_size",
    "read_trace",
    "run_plan",
    "synthesize",
    "write_trace",
]
