"""The planner's prediction for a step: the requests the step sent, replayed through the planner's
multi-tier model (`kvtier_rs.planner.run_plan`) with the step's tier sizes as the engine reports
them, so that measured hit shares stand beside predicted ones.

The planner reads what was sent, not the trace file: a Mooncake-format copy of the requests
(their block ids, cut where a prompt was cut to fit the model, and their prompt lengths, in
blocks of `block_tokens` tokens). Sizes go to it in those blocks: the GPU cache as vLLM sizes it
(num_gpu_blocks x block_size tokens, from its cache_config_info series), kvtier's tiers from their
capacity_blocks series (chunks of the engine's block size, or of the extra config's block_size).
Every request is measured (warmup 0): each level of the rollout starts cold.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from kvtier_rs.planner.errors import PlanError
from kvtier_rs.planner.options import PlanOptions
from kvtier_rs.planner.units import Size
from kvtier_rs.rollout.workload import Request


def tier_tokens(engine: dict[str, Any], extra: dict[str, Any]) -> dict[str, int]:
    """Capacity of each tier in tokens, from the engine's own series."""
    out: dict[str, int] = {}
    cc = engine.get("cache_config") or {}
    try:
        block = int(cc["block_size"])
        out["gpu"] = int(cc["num_gpu_blocks"]) * block
    except (KeyError, ValueError):
        return out
    chunk = int(extra.get("block_size") or block)
    for tier, blocks in (engine.get("kvtier_capacity_blocks") or {}).items():
        if tier in ("cpu", "disk") and blocks > 0:
            out[tier] = int(blocks) * chunk
    return out


def _write_sent(reqs: list[Request], block_tokens: int, path: Path) -> None:
    with open(path, "w") as f:
        for r in reqs:
            rec = {"timestamp": r.arrival_s * 1000.0, "input_length": len(r.prompt), "output_length": r.max_tokens}
            f.write(json.dumps({**rec, "hash_ids": r.chain, "block_size": block_tokens}) + "\n")


def predict(
    reqs: list[Request], block_tokens: int, engine: dict[str, Any], transfer_config: dict[str, Any] | None
) -> dict[str, Any]:
    """Predicted shares of prompt tokens by tier ({gpu, cpu, disk, recomputed}), the sizes used,
    or a note saying why there is no prediction."""
    extra = (transfer_config or {}).get("kv_connector_extra_config") or {}
    tokens = tier_tokens(engine, extra)
    if "gpu" not in tokens:
        return {"shares": None, "note": "the endpoint exports no vllm:cache_config_info: GPU cache size unknown"}
    blocks = {t: n // block_tokens for t, n in tokens.items()}
    if any(b == 0 for b in blocks.values()):
        return {"shares": None, "note": f"a tier holds less than one trace block of {block_tokens} tokens"}
    with tempfile.TemporaryDirectory(prefix="kvtier-rollout-") as tmp:
        sent = Path(tmp) / "sent.jsonl"
        _write_sent(reqs, block_tokens, sent)
        return _plan(sent, block_tokens, blocks, extra)


def _plan(sent: Path, block_tokens: int, blocks: dict[str, int], extra: dict[str, Any]) -> dict[str, Any]:
    from kvtier_rs.planner.plan import run_plan

    policy = str(extra.get("eviction_policy") or "lru")
    opts = PlanOptions(
        trace=str(sent),
        trace_format="mooncake",
        block_size=block_tokens,
        gpu=Size(blocks["gpu"], True),
        cpu=Size(blocks["cpu"], True) if "cpu" in blocks else None,
        disk=Size(blocks["disk"], True) if "disk" in blocks else None,
        capacities=[blocks["gpu"]],
        policies=(policy,),
        warmup=0.0,
        admission_thresholds=(),
        tier_policy=policy,
        cpu_admission=str(extra.get("cpu_admission") or "always"),
        disk_admission=str(extra.get("disk_admission") or "always"),
        progress=False,
    )
    try:
        plan = run_plan(opts)
    except PlanError as e:
        return {"shares": None, "note": f"the planner refused the step's sizes: {e}"}
    tiers = plan["tiers"]
    total = tiers["total_tokens"] or 0
    shares: dict[str, float | None] = {"gpu": 0.0, "cpu": 0.0, "disk": 0.0}
    for t in tiers["tiers"]:
        shares[t["name"]] = t["served_tokens"] / total if total else None
    shares["recomputed"] = tiers["miss_tokens"] / total if total else None
    return {"shares": shares, "capacity_blocks": blocks, "block_tokens": block_tokens, "policy": policy, "note": None}
