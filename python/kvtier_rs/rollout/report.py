"""A step's measurements as the report holds them (latency percentiles, throughput, hit quality
per concurrency level), the rollback verdict, and the terminal table."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtier_rs.rollout.client import Result
from kvtier_rs.rollout.units import fmt_duration

SCHEMA_VERSION = "kvtier.rollout/1"
PERCENTILES = (50, 95, 99)
KEEP, ROLL_BACK, OVER_BUDGET = "keep", "roll_back", "over_budget"


def stats(values: list[float]) -> dict[str, float | int] | None:
    if not values:
        return None
    a = np.asarray(values, dtype=float)
    q = np.percentile(a, PERCENTILES)
    return {
        "count": int(a.size),
        "mean": float(a.mean()),
        **{f"p{p}": float(v) for p, v in zip(PERCENTILES, q, strict=True)},
        "max": float(a.max()),
    }


def level_report(
    level: str, concurrency: int | None, results: list[Result], wall_s: float, engine: dict[str, Any]
) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    failed = [r for r in results if r.error is not None]
    cached = [r.cached_tokens for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "level": level,
        "concurrency": concurrency,
        "requests": len(results),
        "failed": len(failed),
        "errors": sorted({r.error for r in failed if r.error})[:3],
        "wall_s": wall_s,
        "throughput": {
            "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
            "output_tokens_per_s": out_tokens / wall_s if wall_s > 0 else None,
            "prompt_tokens_per_s": prompt_tokens / wall_s if wall_s > 0 else None,
        },
        "ttft_s": stats([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s": stats([g for r in ok for g in r.itl_s]),
        "e2e_s": stats([r.e2e_s for r in ok if r.e2e_s is not None]),
        # Every prompt arrived as sent: the engine counted exactly the token ids the client sent
        # (no tokenizer in between to add, merge or drop any).
        "prompt_tokens_as_sent": all(r.prompt_tokens == r.sent_prompt_tokens for r in ok),
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "client_cached_tokens": sum(c for c in cached if c is not None) if ok and None not in cached else None,
        "engine": engine["deltas"],
        "hit_quality": engine["hit_quality"],
        "per_request": [
            {
                "index": r.index,
                "sent_s": r.sent_s,
                "ttft_s": r.ttft_s,
                "e2e_s": r.e2e_s,
                "itl_mean_s": float(np.mean(r.itl_s)) if r.itl_s else None,
                "prompt_tokens": r.prompt_tokens,
                "output_tokens": r.output_tokens,
                "cached_tokens": r.cached_tokens,
                "error": r.error,
            }
            for r in results
        ],
    }


def verdict(step: dict[str, Any], budgets: dict[str, float | None], is_baseline: bool) -> dict[str, Any] | None:
    """Keep or roll back one step under the rollback rule: a step whose p99 TTFT or p99 ITL, at
    any concurrency level, is over its budget (or that failed requests) is rolled back; the
    reason names the budget, the level and the value. The baseline has nothing to roll back to:
    over budget, it is said to be so. None when no budget was given."""
    if all(b is None for b in budgets.values()):
        return None
    reasons = []
    worst: dict[str, float] = {}
    for lv in step["levels"]:
        where = "at trace timing" if lv["concurrency"] is None else f"at concurrency {lv['concurrency']}"
        for key, label in (("ttft_p99_s", "TTFT"), ("itl_p99_s", "ITL")):
            budget = budgets.get(key)
            s = lv[key.removesuffix("_p99_s") + "_s"]
            if budget is None or s is None:
                continue
            worst[key] = max(worst.get(key, 0.0), s["p99"])
            if s["p99"] > budget:
                reasons.append(
                    f"p99 {label} {fmt_duration(s['p99'])} over the budget --{label.lower()}-p99 "
                    f"{fmt_duration(budget)} {where}"
                )
        if lv["failed"]:
            reasons.append(f"{lv['failed']} of {lv['requests']} requests failed {where}")
    if reasons:
        decision = OVER_BUDGET if is_baseline else ROLL_BACK
    else:
        decision = KEEP
        shown = [
            f"p99 {label} {fmt_duration(worst[key])} within {fmt_duration(budgets[key])}"
            for key, label in (("ttft_p99_s", "TTFT"), ("itl_p99_s", "ITL"))
            if key in worst and budgets.get(key) is not None
        ]
        reasons = ["; ".join(shown) or "no latency measured"]
    return {"decision": decision, "reasons": reasons}


def recommended(steps: list[dict[str, Any]]) -> str | None:
    """The newest step that is kept with every step before it: a tier is judged on top of the ones
    before it, so the first one rolled back ends the rollout there."""
    best = None
    for s in steps:
        v = s["verdict"]
        if v is None:
            return None
        if v["decision"] == ROLL_BACK:
            break
        best = s["name"]
    return best


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _ms(s: dict[str, Any] | None, key: str) -> str:
    return "-" if s is None else fmt_duration(s[key])


def render_table(report: dict[str, Any]) -> str:
    head = (
        f"{'step':<10} {'level':>6} {'req':>4} {'fail':>4} {'TTFT p50':>9} {'p95':>9} {'p99':>9} "
        f"{'ITL p50':>9} {'p95':>9} {'p99':>9} {'e2e p99':>9} {'out tok/s':>9}  "
        f"{'gpu':>4} {'cpu':>4} {'disk':>4} {'recmp':>5}"
    )
    lines = [f"kvtier rollout: {report['trace']['path']} ({report['trace']['requests']} requests)", "", head]
    lines.append("-" * len(head))
    for step in report["steps"]:
        for lv in step["levels"]:
            sh = lv["hit_quality"]["shares"]
            tp = lv["throughput"]["output_tokens_per_s"]
            lines.append(
                f"{step['name']:<10} {lv['level']:>6} {lv['requests']:>4} {lv['failed']:>4} "
                f"{_ms(lv['ttft_s'], 'p50'):>9} {_ms(lv['ttft_s'], 'p95'):>9} {_ms(lv['ttft_s'], 'p99'):>9} "
                f"{_ms(lv['itl_s'], 'p50'):>9} {_ms(lv['itl_s'], 'p95'):>9} {_ms(lv['itl_s'], 'p99'):>9} "
                f"{_ms(lv['e2e_s'], 'p99'):>9} {('-' if tp is None else f'{tp:.1f}'):>9}  "
                f"{_pct(sh['gpu']):>4} {_pct(sh['cpu']):>4} {_pct(sh['disk']):>4} {_pct(sh['recomputed']):>5}"
            )
        pred = step.get("predicted")
        if pred and pred.get("shares"):
            ps = pred["shares"]
            lines.append(
                f"{'':<10} {'plan':>6} {'':>4} {'':>4} {'':>9} {'':>9} {'':>9} {'':>9} {'':>9} {'':>9} {'':>9} "
                f"{'':>9}  {_pct(ps.get('gpu')):>4} {_pct(ps.get('cpu')):>4} {_pct(ps.get('disk')):>4} "
                f"{_pct(ps.get('recomputed')):>5}"
            )
    lines.append("")
    for step in report["steps"]:
        v = step["verdict"]
        if v is None:
            lines.append(f"{step['name']}: no budget given (--ttft-p99, --itl-p99): no verdict")
        else:
            lines.append(f"{step['name']}: {v['decision'].replace('_', ' ')}: {'; '.join(v['reasons'])}")
    rec = report["recommendation"]
    if rec is not None:
        lines.append(f"recommended: {rec}")
    return "\n".join(lines)
