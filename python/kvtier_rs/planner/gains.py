"""Which replayed hits are gains: a hit saves prefill only when loading its blocks beats
recomputing them. The rule is the live orchestrator's own `CostModel`
(kvtier_rs/orchestrator/cost.py), applied as `TierOrchestrator.plan` applies it: per request
and tier, `worth_loading(tier, n)` for the n blocks that tier serves the request, and a CPU part
refused for cost cuts the chain before the disk part (a disk part, before the remote one). The
replays report how many blocks each measured request got from each tier (`hit_histogram`,
`served_histogram`), so the planner and the running tiers decide the same way, with the same
bandwidths and fixed latencies.

Without the model's bytes (--model-config / --bytes-per-token) there is no cost model and every
hit counts, as in the orchestrator without one. In the single-cache sweep every hit is a CPU
promotion (the cache stands for the CPU tier); in the multi-tier replay GPU hits cost nothing.
"""

from __future__ import annotations

from typing import Any

from kvtier_rs.orchestrator.cost import PATHS, CostModel


def cost_model(
    block_bytes: int | None,
    block_size: int,
    prefill_tps: float,
    pcie_gbps: float,
    disk_gbps: float,
    remote: tuple[float, float] | None = None,
):
    """The orchestrator's cost model for the planner's rates (latencies: its defaults; a remote
    store's, `remote` = (GB/s, latency in seconds), only with a remote tier), or None without
    model bytes."""
    if block_bytes is None:
        return None
    model = CostModel(prefill_tokens_per_s=prefill_tps, tokens_per_block=block_size, block_bytes=block_bytes)
    bandwidth = {"cpu": pcie_gbps * 1e9, "disk": disk_gbps * 1e9}
    latency = dict(model.latency_s)
    if remote is not None:
        bandwidth["remote"], latency["remote"] = remote[0] * 1e9, remote[1]
    return CostModel(
        prefill_tokens_per_s=prefill_tps,
        tokens_per_block=block_size,
        block_bytes=block_bytes,
        bandwidth=bandwidth,
        latency_s=latency,
    )


def sweep_gain(row: dict[str, Any], cost: CostModel | None) -> dict[str, Any]:
    """Gain of one sweep replay: the hit tokens of requests whose CPU load is worth it, and
    the time those loads take."""
    gain, load_s = 0, 0.0
    for n, requests, tokens in row["hit_histogram"]:
        if cost is None or cost.worth_loading("cpu", n):
            gain += tokens
            load_s += requests * cost.load_seconds("cpu", n) if cost else 0.0
    total = row["total_tokens"]
    return {"gain_tokens": gain, "gain_rate": gain / total if total else None, "load_s": load_s}


def tiers_gain(mt: dict[str, Any], cost: CostModel | None) -> dict[str, Any]:
    """Gains of the multi-tier replay, per tier: GPU hits are free; a lower tier's promotions
    count when the orchestrator would load them. Returns {"gain_tokens": {tier: tokens},
    "refused_tokens": {tier: tokens} (promotions not worth loading: recomputed),
    "refused_blocks" (their blocks, all tiers), "loaded_blocks", "load_s"}."""
    names = [t["name"] for t in mt["tiers"]]
    gain = dict.fromkeys(names, 0)
    refused = dict.fromkeys(names, 0)
    loaded_blocks, refused_blocks, load_s = 0, 0, 0.0
    for blocks, requests, tokens in mt["served_histogram"]:
        # The counts say how many blocks each tier served, not where in the chain: GPU blocks are
        # taken as the leading part (the engine's own prefix hit), as they usually are.
        loading = True  # a refused tier cuts the chain: the tiers after it are recomputed too
        for name, n, toks in zip(names, blocks, tokens, strict=True):
            if n == 0:
                continue
            if name not in PATHS:  # the GPU's own prefix cache: nothing to move
                gain[name] += toks
            elif loading and (cost is None or cost.worth_loading(name, n)):
                gain[name] += toks
                loaded_blocks += requests * n
                load_s += requests * cost.load_seconds(name, n) if cost else 0.0
            else:
                loading = False
                refused[name] += toks
                refused_blocks += requests * n
    return {
        "gain_tokens": gain,
        "refused_tokens": refused,
        "refused_blocks": refused_blocks,
        "loaded_blocks": loaded_blocks,
        "load_s": load_s,
    }


def tiers_cost(mt: dict[str, Any], cost: CostModel | None, prefill_tps: float) -> dict[str, Any]:
    """Prefill saved by the lower tiers of the multi-tier replay and, with a cost model, the
    mean TTFT estimate: missed and refused tokens at the prefill rate plus the loads' time
    (linear prefill, loads not overlapped with compute)."""
    g = tiers_gain(mt, cost)
    served = {t["name"]: t["served_tokens"] for t in mt["tiers"]}
    gpu = served.get("gpu", 0)
    saved = sum(v for k, v in g["gain_tokens"].items() if k in PATHS)
    total = mt["total_tokens"]
    out: dict[str, Any] = {
        "prefill_tokens_per_s": prefill_tps,
        "total_tokens": total,
        "gpu_hit_tokens": gpu,
        "cpu_promoted_tokens": served.get("cpu", 0),
        "disk_promoted_tokens": served.get("disk", 0),
        "remote_promoted_tokens": served.get("remote", 0),
        "miss_tokens": mt["miss_tokens"],
        # Promotions whose load would not beat recomputing them: the orchestrator recomputes.
        "not_worth_loading_tokens": sum(g["refused_tokens"].values()),
        # What is prefilled after all: misses and promotions not worth loading.
        "recomputed_tokens": mt["miss_tokens"] + sum(g["refused_tokens"].values()),
        "recomputed_blocks": mt["miss_blocks"] + g["refused_blocks"],
        "saved_tokens_by_tier": {k: v for k, v in g["gain_tokens"].items() if k in PATHS},
        "prefill_tokens_saved_by_lower_tiers": saved,
        "prefill_compute_saved_s": saved / prefill_tps,
        "prefill_compute_saved_share": saved / total if total else 0.0,
    }
    if cost is not None:
        n = mt["measured_requests"] or 1
        ttft_gpu_only = (total - gpu) / prefill_tps / n
        ttft_tiered = ((total - gpu - saved) / prefill_tps + g["load_s"]) / n
        out.update(
            {
                "bandwidth_bytes_per_s": dict(cost.bandwidth),
                "latency_s": dict(cost.latency_s),
                "transfer_bytes": g["loaded_blocks"] * cost.block_bytes,
                "transfer_s": g["load_s"],
                "mean_ttft_gpu_only_s": ttft_gpu_only,
                "mean_ttft_tiered_s": ttft_tiered,
                "mean_ttft_change_s": ttft_tiered - ttft_gpu_only,
            }
        )
    return out


def transfer(cost: CostModel) -> dict[str, Any]:
    """Question 3, per block: load time from each tier against recompute time."""
    recompute = cost.recompute_seconds(1)
    return {
        "block_bytes": cost.block_bytes,
        "recompute_s_per_block": recompute,
        "latency_s": dict(cost.latency_s),
        "tiers": [
            {
                "name": hop,
                "bandwidth_bytes_per_s": cost.bandwidth[hop],
                "load_s_per_block": cost.load_seconds(hop, 1),
                "worth_loading": cost.worth_loading(hop, 1),
                "load_to_recompute": cost.load_seconds(hop, 1) / recompute,
            }
            for hop in PATHS
            if hop in cost.bandwidth
        ],
    }
