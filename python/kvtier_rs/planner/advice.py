"""The planner's advice: the policy, the size at the knee of the miss-ratio curve, the admission
rule, and the verdict on whether tiering pays, from the replays `run_plan` made.

Every choice weighs gains, not raw hits: a row's `gain_rate` counts only the hits whose load
beats recomputing them under the orchestrator's cost model (planner/gains.py); without model
bytes the two are the same."""

from __future__ import annotations

from typing import Any

from kvtier_rs.planner.checks import ONLINE_POLICIES
from kvtier_rs.planner.units import MAX_BLOCKS, fmt_blocks, fmt_bytes

# The knee: the smallest capacity whose gain is within a tenth of the infinite cache's.
KNEE_SHARE = 0.9
# Below this share of tokens saved, tiering is not worth running.
MIN_GAIN = 0.02
# An admission threshold may cost at most this much gain (half a point) to be recommended.
ADMISSION_SLACK = 0.005


def choose_policy(results: list[dict], ceiling_gain: float) -> str | None:
    """The one online policy the whole plan uses: the admission sweep, the tier replay (unless
    --tier-policy), the sizing and the verdict, so every figure quoted for it is the same row of
    the sweep. It is the policy that reaches the knee with the least capacity (then the higher
    gain there); with no knee, the one with the most gain."""
    knees = {}
    for pol in dict.fromkeys(r["policy"] for r in results if r["policy"] != "opt"):
        k = find_knee(results, pol, ceiling_gain)
        if k is not None:
            knees[pol] = k
    if knees:
        return min(knees, key=lambda p: (knees[p]["capacity_blocks"], -(knees[p]["gain_rate"] or 0.0)))
    return best_online(results)


def best_online(results: list[dict]) -> str | None:
    """The online policy with the most gain (tokens) summed over the filled capacities."""
    score: dict[str, int] = {}
    for r in results:
        if r["policy"] != "opt" and not r["underfilled"]:
            score[r["policy"]] = score.get(r["policy"], 0) + r["gain_tokens"]
    if not score:
        online = [r["policy"] for r in results if r["policy"] != "opt"]
        return online[0] if online else None
    # Ties go to the simpler policy (order of ONLINE_POLICIES: fifo, lru, ...).
    return max(score, key=lambda p: (score[p], -ONLINE_POLICIES.index(p)))


def _rows(results: list[dict], policy: str) -> list[dict]:
    return sorted((r for r in results if r["policy"] == policy), key=lambda r: r["capacity_blocks"])


def find_knee(results: list[dict], policy: str, ceiling_gain: float) -> dict | None:
    """The knee of `policy`'s miss-ratio curve: the smallest swept capacity whose gain rate is
    within a tenth of the ceiling's (KNEE_SHARE), so that no capacity at all could win more
    than another tenth of the reuse worth loading. None when no swept capacity gets there: the
    curve is still rising, or flat below the ceiling, at the largest one, and its knee lies
    beyond the sweep (never the largest swept capacity by default). A knee at the smallest
    swept capacity is only a bound: the curve may have bent below it."""
    for r in _rows(results, policy):
        if r["gain_rate"] is not None and r["gain_rate"] >= KNEE_SHARE * ceiling_gain:
            return r
    return None


def _hits(row: dict, weighted: bool) -> str:
    """`row`'s hit rate as the advice quotes it, with the part worth loading when that differs."""
    text = f"{row['hit_rate']:.1%} of tokens"
    if weighted and row["gain_tokens"] != row["hit_tokens"]:
        text += f" ({row['gain_rate']:.1%} worth loading)"
    return text


def _no_knee(results: list[dict], policy: str, ceiling: dict, weighted: bool) -> tuple[str, list[str]]:
    """Summary and reasons when the sweep holds no knee: sweep larger capacities."""
    rows = _rows(results, policy)
    lo, hi = rows[0]["capacity_blocks"], rows[-1]["capacity_blocks"]
    larger = [c for c in (2 * hi, 4 * hi, 8 * hi) if c <= MAX_BLOCKS]
    summary = (
        f"Tier it, but size it from a larger sweep: there is no knee within the swept capacities ({lo} to "
        f"{fmt_blocks(hi)}); {policy} hits {_hits(rows[-1], weighted)} at {fmt_blocks(hi)} against "
        f"{_hits(ceiling, weighted)} for an infinite cache."
    )
    reasons = [f"the curve is still short of the ceiling at {fmt_blocks(hi)} (the knee is within a tenth of it)"]
    if larger:
        reasons.append(f"sweep larger capacities: rerun with --capacities {','.join(map(str, larger))}")
    return summary, reasons


def recommend(report: dict) -> dict[str, Any]:
    ceiling = report["ceiling"]
    ceiling_rate = ceiling["hit_rate"] or 0.0
    ceiling_gain = ceiling["gain_rate"] or 0.0
    weighted = report["cost_weighted"]
    results = report["results"]
    q = report["questions"]
    reasons: list[str] = []
    rec: dict[str, Any] = {
        "verdict": "tier",
        "policy": None,
        "capacity_blocks": None,
        "capacity_bytes": None,
        "admission": "always",
    }
    if ceiling_rate < 0.05:
        rec["verdict"] = "no_tiering"
        rec["summary"] = (
            "Tiering will not pay for this workload: even an infinite cache would hit only "
            f"{ceiling_rate:.1%} of input "
            "tokens. Tiering cannot create reuse."
        )
        rec["reasons"] = [
            f"{q['admission']['one_hit_token_fraction']:.0%} of block tokens belong to blocks used only once"
        ]
        return rec
    transfer = q.get("transfer")
    if transfer and ceiling_gain < MIN_GAIN:
        # Reuse there is, but loading it does not beat recomputing it.
        t = transfer["tiers"][0]
        rec["verdict"] = "no_tiering"
        rec["summary"] = (
            f"Tiering will not pay: loading a {transfer['block_bytes'] / 2**20:.1f} MiB block over "
            "the CPU link takes "
            f"{t['load_s_per_block'] * 1e3:.2f} ms, recomputing it "
            f"{transfer['recompute_s_per_block'] * 1e3:.2f} ms; even an infinite cache's hits "
            f"({ceiling_rate:.1%} of tokens) are only {ceiling_gain:.1%} worth loading."
        )
        rec["reasons"] = ["raise --pcie-gbps or lower --prefill-tps if these figures do not match your hardware"]
        return rec
    best = q["admission"]["policy"]  # `choose_policy`'s, as everywhere in the plan
    if best is None:
        rec["verdict"] = "unknown"
        rec["summary"] = "No online policy was replayed; add one to --policies for a recommendation."
        rec["reasons"] = []
        return rec
    knee = find_knee(results, best, ceiling_gain)
    rec["policy"] = best
    rec["knee"] = None
    no_knee_summary = None
    if knee is None:
        no_knee_summary, no_knee_reasons = _no_knee(results, best, ceiling, weighted)
        reasons += no_knee_reasons
    else:
        rec["capacity_blocks"] = knee["capacity_blocks"]
        rec["capacity_bytes"] = knee["capacity_bytes"]
        at_smallest = knee["capacity_blocks"] == _rows(results, best)[0]["capacity_blocks"]
        rec["knee"] = {
            "policy": best,
            "capacity_blocks": knee["capacity_blocks"],
            "hit_rate": knee["hit_rate"],
            "gain_rate": knee["gain_rate"],
            "at_smallest_swept": at_smallest,
        }
        if knee["underfilled"]:
            reasons.append(
                f"a cache of {fmt_blocks(knee['capacity_blocks'])} never fills: it holds the whole reusable working set"
            )
        else:
            reasons.append(
                f"{best} at {fmt_blocks(knee['capacity_blocks'])} hits {_hits(knee, weighted)} "
                f"against a ceiling of {_hits(ceiling, weighted)}"
            )
            if knee["filled_late"]:
                reasons.append(
                    f"caution: that cache filled only after {knee['unfilled_share']:.0%} of the measured "
                    "requests, so its rate is partly warm-up; raise --warmup or replay a longer trace"
                )
        if at_smallest:
            reasons.append(
                f"the knee is at or below {fmt_blocks(knee['capacity_blocks'])}, the smallest swept capacity: "
                "sweep smaller capacities to size the tier tighter"
            )
    opt = next(
        (r for r in results if r["policy"] == "opt" and knee and r["capacity_blocks"] == knee["capacity_blocks"]), None
    )
    if knee and opt:
        # Compared in the one metric Belady bounds (see BOUNDS in plan.py).
        reasons.append(
            f"opt (Belady) hits {opt['all_block_hit_rate']:.1%} of all block references over the whole replay "
            f"at that size, the most any eviction order can ({best}: {knee['all_block_hit_rate']:.1%}); it "
            "bounds that, not the measured token-weighted rates"
        )
    if knee and not knee["underfilled"]:
        _choose_admission(rec, reasons, q["admission"]["threshold_effect"], knee, best)
    rec["reasons"] = reasons
    asked = report["tiers"]
    if asked and any(t["name"] != "gpu" for t in asked["tiers"]):
        return _judge_asked(rec, asked, report["cost"], best, report.get("replicas"))
    if knee is None:  # `_no_knee` wrote the summary
        rec["summary"] = no_knee_summary
        return rec
    if asked:  # a GPU prefix cache only: a CPU tier pays only for what it adds to it
        return _judge_knee_over_gpu(rec, knee, asked)
    size = fmt_blocks(rec["capacity_blocks"])
    if rec["capacity_bytes"]:
        size += f" ({fmt_bytes(rec['capacity_bytes'])})"
    rec["summary"] = f"Tier it: a CPU tier of {size} with policy {best} and admission {rec['admission']}."
    return rec


def _choose_admission(rec: dict, reasons: list[str], threshold_effect: list[dict], knee: dict, best: str) -> None:
    """Recommend the smallest admission threshold that costs under half a point of gain."""
    for t in threshold_effect:
        if (
            t["policy"] == best
            and t["capacity_blocks"] == knee["capacity_blocks"]
            and t["gain_rate"] is not None
            and knee["gain_rate"] is not None
        ):
            if t["gain_rate"] >= knee["gain_rate"] - ADMISSION_SLACK:
                saved = 1 - t["insertions"] / max(knee["insertions"], 1)
                rec["admission"] = t["admission"]
                reasons.append(
                    f"admission {t['admission']} keeps the hit rate ({t['hit_rate']:.1%}) and "
                    f"cuts tier writes by {saved:.0%}"
                )
                break


def _tier_name(t: dict) -> str:
    return "GPU cache" if t["name"] == "gpu" else f"{t['name'].upper()} tier"


def _judge_asked(rec: dict, mt: dict, cost: dict, policy: str, split: dict | None) -> dict:
    """The verdict on the tiers asked for (--cpu, with --disk, --remote and --gpu if given),
    from their multi-tier replay: they pay when their promotions worth loading save MIN_GAIN of
    the tokens. The knee and admission advice stay as reasons (sizing), and with --replicas what
    the shared remote tier saves the replicas, judged by the same MIN_GAIN."""
    total = mt["total_tokens"] or 1
    lower = [t for t in mt["tiers"] if t["name"] != "gpu"]
    gpu = next((t for t in mt["tiers"] if t["name"] == "gpu"), None)
    added = sum(t["saved_tokens"] for t in lower) / total
    parts = []
    for t in lower:
        share = f"{t['saved_tokens'] / total:.1%} of tokens"
        if t["saved_tokens"] != t["served_tokens"]:
            share += f" (of {t['served_tokens'] / total:.1%} promoted; the rest is not worth loading)"
        parts.append(f"the {_tier_name(t)} of {fmt_blocks(t['capacity_blocks'])} saves {share}")
    config = "; ".join(parts)
    tier_policy = lower[0]["policy"]
    if tier_policy != policy:
        config += f" (replayed with --tier-policy {tier_policy})"
    base = f" over the GPU cache's {gpu['served_tokens'] / total:.1%}" if gpu else ""
    extra = [] if gpu else ["no --gpu: every hit of the CPU tier counts as a promotion (no GPU prefix cache in front)"]
    if split is not None:
        saves = split["remote_saves"]
        pays = "it pays" if saves["token_share"] >= MIN_GAIN else "too little to pay"
        extra.append(
            f"split across {split['replicas']} replicas ({split['split']}), each with its own tiers, the shared "
            f"remote tier saves {saves['token_share']:.1%} of prefill tokens ({saves['recomputed_blocks']} block "
            f"recomputes): {pays}"
        )
    if added < MIN_GAIN:
        rec["verdict"] = "no_tiering"
        rec["summary"] = (
            f"Tiering will not pay with the tiers asked for: together they save only {added:.1%} of prefill "
            f"tokens{base} ({config})."
        )
    else:
        rec["verdict"] = "tier"
        ttft = ""
        if "mean_ttft_change_s" in cost:
            ttft = f", mean TTFT {cost['mean_ttft_change_s'] * 1e3:+.0f} ms"
        rec["summary"] = f"Tier it as asked: the tiers save {added:.1%} of prefill tokens{base}{ttft} ({config})."
    rec["reasons"] = extra + rec["reasons"]
    return rec


def _judge_knee_over_gpu(rec: dict, knee: dict, mt: dict) -> dict:
    """Only a GPU prefix cache was given: a CPU tier at the knee would add about its gain less
    what the GPU cache already hits (tiers are inclusive); no CPU tier was replayed."""
    gpu = mt["tiers"][0]
    gpu_rate = gpu["served_tokens"] / (mt["total_tokens"] or 1)
    added = (knee["gain_rate"] or 0.0) - gpu_rate
    if added < MIN_GAIN:
        rec["verdict"] = "no_tiering"
        rec["summary"] = (
            f"Tiering will not pay: the GPU prefix cache alone ({fmt_blocks(gpu['capacity_blocks'])}) hits "
            f"{gpu_rate:.1%} of tokens, and a CPU tier of {fmt_blocks(knee['capacity_blocks'])} (the knee) would add "
            f"about {max(added, 0.0):.1%}."
        )
    else:
        rec["summary"] = (
            f"Tier it: a CPU tier of {fmt_blocks(knee['capacity_blocks'])} with policy {rec['policy']} and admission "
            f"{rec['admission']} would add about {added:.1%} of tokens to the GPU cache's {gpu_rate:.1%}."
        )
    rec["reasons"].append("give --cpu (and --disk) to replay that configuration exactly")
    return rec
