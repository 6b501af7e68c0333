"""The planner's advice: the policy, the size at the knee of the miss-ratio curve, the admission
rule, and the verdict on whether tiering pays, from the replays `run_plan` made."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtier_rs.planner.checks import ONLINE_POLICIES

if TYPE_CHECKING:
    from kvtier_rs.planner.plan import PlanOptions


def choose_policy(results: list[dict], ceiling_rate: float) -> str | None:
    """The one online policy the whole plan uses: the admission sweep, the tier replay (unless
    --tier-policy), the sizing and the verdict, so every figure quoted for it is the same row of
    the sweep. It is the policy that reaches the knee with the least capacity (then the higher
    hit rate there); with no knee, the one with the most hit tokens."""
    knees = {}
    for pol in dict.fromkeys(r["policy"] for r in results if r["policy"] != "opt"):
        k = find_knee(results, pol, ceiling_rate)
        if k is not None:
            knees[pol] = k
    if knees:
        return min(knees, key=lambda p: (knees[p]["capacity_blocks"], -(knees[p]["hit_rate"] or 0.0)))
    return best_online(results)


def best_online(results: list[dict]) -> str | None:
    """The online policy with the most hit tokens summed over the filled capacities."""
    score: dict[str, int] = {}
    for r in results:
        if r["policy"] != "opt" and not r["underfilled"]:
            score[r["policy"]] = score.get(r["policy"], 0) + r["hit_tokens"]
    if not score:
        online = [r["policy"] for r in results if r["policy"] != "opt"]
        return online[0] if online else None
    # Ties go to the simpler policy (order of ONLINE_POLICIES: fifo, lru, ...).
    return max(score, key=lambda p: (score[p], -ONLINE_POLICIES.index(p)))


def find_knee(results: list[dict], policy: str, ceiling_rate: float) -> dict | None:
    """Smallest swept capacity whose hit rate is within 10% of the ceiling's."""
    rows = sorted((r for r in results if r["policy"] == policy), key=lambda r: r["capacity_blocks"])
    filled = [r for r in rows if not r["underfilled"] and r["hit_rate"] is not None]
    for r in filled:
        if r["hit_rate"] >= 0.9 * ceiling_rate:
            return r
    for r in rows:
        # Past the filled capacities the cache never filled: it already holds the working set.
        if r["underfilled"]:
            return r
    return filled[-1] if filled else None


def recommend(report: dict, opts: PlanOptions) -> dict[str, Any]:
    ceiling_rate = report["ceiling"]["hit_rate"] or 0.0
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
    if transfer and not transfer["tiers"][0]["worth_loading"]:
        t = transfer["tiers"][0]
        rec["verdict"] = "no_tiering"
        rec["summary"] = (
            f"Tiering will not pay: loading a {transfer['block_bytes'] / 2**20:.1f} MiB block over "
            "the CPU link takes "
            f"{t['load_s_per_block'] * 1e3:.2f} ms, recomputing it "
            f"{transfer['recompute_s_per_block'] * 1e3:.2f} ms."
        )
        rec["reasons"] = ["raise --pcie-gbps or lower --prefill-tps if these figures do not match your hardware"]
        return rec
    best = q["admission"]["policy"]  # `choose_policy`'s, as everywhere in the plan
    if best is None:
        rec["verdict"] = "unknown"
        rec["summary"] = "No online policy was replayed; add one to --policies for a recommendation."
        rec["reasons"] = []
        return rec
    knee = find_knee(results, best, ceiling_rate)
    rec["policy"] = best
    if knee:
        rec["capacity_blocks"] = knee["capacity_blocks"]
        rec["capacity_bytes"] = knee["capacity_bytes"]
        if knee["underfilled"]:
            reasons.append(
                f"a cache of {knee['capacity_blocks']} blocks never fills: it holds the whole reusable working set"
            )
        else:
            reasons.append(
                f"{best} at {knee['capacity_blocks']} blocks hits {knee['hit_rate']:.1%} of tokens "
                f"against a ceiling of {ceiling_rate:.1%}"
            )
            if knee["filled_late"]:
                reasons.append(
                    f"caution: that cache filled only after {knee['unfilled_share']:.0%} of the measured "
                    "requests, so its rate is partly warm-up; raise --warmup or replay a longer trace"
                )
    opt_rows = {r["capacity_blocks"]: r for r in results if r["policy"] == "opt"}
    if knee and knee["capacity_blocks"] in opt_rows and opt_rows[knee["capacity_blocks"]]["hit_rate"] is not None:
        reasons.append(f"opt (Belady) reaches {opt_rows[knee['capacity_blocks']]['hit_rate']:.1%} at that size")
    # Admission: recommend the smallest threshold that costs under half a point of hit rate.
    if knee and not knee["underfilled"]:
        for t in q["admission"]["threshold_effect"]:
            if (
                t["policy"] == best
                and t["capacity_blocks"] == knee["capacity_blocks"]
                and t["hit_rate"] is not None
                and knee["hit_rate"] is not None
            ):
                if t["hit_rate"] >= knee["hit_rate"] - 0.005:
                    saved = 1 - t["insertions"] / max(knee["insertions"], 1)
                    rec["admission"] = t["admission"]
                    reasons.append(
                        f"admission {t['admission']} keeps the hit rate ({t['hit_rate']:.1%}) and "
                        f"cuts tier writes by {saved:.0%}"
                    )
                    break
    gpu_tier = report["tiers"] and next((t for t in report["tiers"]["tiers"] if t["name"] == "gpu"), None)
    if gpu_tier:
        total = report["tiers"]["total_tokens"] or 1
        gpu_rate = gpu_tier["served_tokens"] / total
        lower = sum(t["served_tokens"] for t in report["tiers"]["tiers"] if t["name"] != "gpu") / total
        if lower < 0.02:
            rec["verdict"] = "no_tiering"
            rec["summary"] = (
                f"Tiering will not pay: the GPU prefix cache alone hits {gpu_rate:.1%} of tokens "
                "and the CPU/disk tiers "
                f"would add only {lower:.1%}."
            )
            rec["reasons"] = reasons
            return rec
        tier_policy = gpu_tier["policy"]
        replayed = "" if tier_policy == best else f" (tiers replayed with --tier-policy {tier_policy})"
        reasons.append(
            f"GPU alone hits {gpu_rate:.1%}; the lower tiers add {lower:.1%} of tokens as promotions{replayed}"
        )
    size = f"{rec['capacity_blocks']} blocks" if rec["capacity_blocks"] else "?"
    if rec["capacity_bytes"]:
        from kvtier_rs.planner.model import fmt_bytes

        size += f" ({fmt_bytes(rec['capacity_bytes'])})"
    rec["summary"] = f"Tier it: a CPU tier of {size} with policy {best} and admission {rec['admission']}."
    rec["reasons"] = reasons
    return rec
