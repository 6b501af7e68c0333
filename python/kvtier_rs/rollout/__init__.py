"""`kvtier rollout`: a controlled rollout of tiers measured against a live engine. A GPU-only
baseline, then one tier more per step (+CPU, +disk), each replaying the same trace against an
OpenAI-compatible endpoint (one the user started, or a `vllm serve` started here per step), with
latency percentiles per concurrency level, hit quality by tier from the engine's own counters,
the planner's prediction beside it, and a keep-or-roll-back verdict per step.

Nothing in kvtier's core imports this package; it needs the `rollout` extra (openai, httpx,
prometheus-client, matplotlib, tqdm).
"""

from kvtier_rs.rollout.errors import RolloutError
from kvtier_rs.rollout.report import SCHEMA_VERSION
from kvtier_rs.rollout.run import RolloutOptions, run_rollout

__all__ = ["SCHEMA_VERSION", "RolloutError", "RolloutOptions", "run_rollout"]
