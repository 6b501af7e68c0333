"""Plain-text rendering of a plan report (`--format table`)."""

from __future__ import annotations

from typing import Any

from kvtier_rs.planner.plan import LATE_FILL_SHARE
from kvtier_rs.planner.units import fmt_blocks, fmt_bytes


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:6.1%}"


def _rate(row: dict[str, Any]) -> str:
    """A measured hit rate with its fill mark: ^ never filled, * filled late (see the legend)."""
    mark = "^" if row.get("underfilled") else "*" if row.get("filled_late") else " "
    return _pct(row["hit_rate"]) + mark


def _fill_note(row: dict[str, Any]) -> str:
    if row["underfilled"]:
        return " (never filled)"
    if row["filled_late"]:
        return f" (filled late: {row['unfilled_share']:.0%} of the measured requests came before it filled)"
    return ""


def render_table(rep: dict[str, Any]) -> str:  # noqa: C901, PLR0912, PLR0915 - one table section after another
    t = rep["trace"]
    lines = [
        f"trace     {t['path']} ({t['format']}, {t['block_size']}-token blocks)",
        f"          {t['requests']} requests, {t['block_refs']} block references, "
        f"{t['distinct_blocks']} distinct blocks, "
        f"{t['input_tokens']} input tokens; measured: last {t['measured_requests']} requests "
        f"(warmup {t['warmup']:.0%}), "
        f"{t['mode']} mode",
    ]
    if t["skipped_records"]:
        lines.append(f"          skipped {t['skipped_records']} bad records, e.g. {t['skipped_examples'][0]}")
    lines += [f"          note: {n}" for n in t.get("notes", [])]
    if rep["model"]:
        m = rep["model"]
        lines.append(
            f"model     {m['bytes_per_token']} bytes/token, {fmt_bytes(m['block_bytes'])} per block ({m['source']})"
        )
        lines += [f"          note: {n}" for n in m["notes"]]
    lines.append("")
    lines.append("Hit rate (token-weighted) by capacity")
    lines.append("   ^ the cache never filled: it holds all it was offered (an infinite cache's rate)")
    lines.append(
        f"   * it filled only after {LATE_FILL_SHARE:.0%} of the measured requests: the rate is partly warm-up "
        "and overstates it (raise --warmup or replay a longer trace)"
    )
    caps = rep["capacities_blocks"]
    policies = list(dict.fromkeys(r["policy"] for r in rep["results"]))
    if "opt" in policies:
        lines.append(
            "   opt = Belady: the most block hits any eviction order gets at that capacity over the whole replay "
            "(warm-up included); not a bound on these measured token-weighted rates"
        )
    head = f"{'blocks':>10} {'bytes':>10} " + " ".join(f"{p:>8}" for p in policies)
    lines.append(head)
    by = {(r["policy"], r["capacity_blocks"]): r for r in rep["results"]}
    for c in caps:
        row = by.get((policies[0], c)) if policies else None
        b = fmt_bytes(row["capacity_bytes"]) if row and row["capacity_bytes"] else "-"
        lines.append(f"{c:>10} {b:>10} " + " ".join(f"{_rate(by[(p, c)]):>8}" for p in policies))
    lines.append(f"{'ceiling':>10} {'inf':>10} {_pct(rep['ceiling']['hit_rate']):>7}")
    rows = [*rep["results"], rep["ceiling"]]
    if rep["cost_weighted"] and any(r["gain_tokens"] != r["hit_tokens"] for r in rows):
        # Only when the cost model set some hits aside: the advice goes by these.
        lines.append("Hits worth loading (a request's load beats recomputing it), share of tokens:")
        lines.append(head)
        for c in caps:
            lines.append(f"{c:>10} {'':>10} " + " ".join(f"{_pct(by[(p, c)]['gain_rate']):>7} " for p in policies))
        lines.append(f"{'ceiling':>10} {'inf':>10} {_pct(rep['ceiling']['gain_rate']):>7}")
    q = rep["questions"]
    lines.append("")
    lines.append("1. Which prefixes are shared?")
    sp = q["shared_prefixes"]
    lines.append(
        f"   {sp['shared_token_share']:.1%} of block tokens are in blocks used by two or more "
        "requests. Top shared prefixes:"
    )
    lines.append(f"   {'tokens':>8} {'requests':>9} {'token share':>12} {'reusable':>9}  first request")
    for p in sp["top"]:
        lines.append(
            f"   {p['tokens']:>8} {p['requests']:>9} {p['token_share']:>12.1%} "
            f"{p['reusable_token_share']:>9.1%}  {p['first_request']}"
        )
    lines.append("2. How soon do they come back?")
    ru = q["reuse"]
    if ru["time_s"]:
        ts, ds = ru["time_s"], ru["distance_blocks"]
        lines.append(
            f"   {ru['reuses']} reuses. Reuse time p50 {ts['p50']:.1f}s, p90 {ts['p90']:.1f}s, p99 {ts['p99']:.1f}s"
        )
        lines.append(
            f"   Reuse distance (distinct blocks in between) p50 {ds['p50']:.0f}, p90 "
            f"{ds['p90']:.0f}, p99 {ds['p99']:.0f}"
        )
    else:
        lines.append("   No block is ever reused.")
    lines.append("3. Are useful blocks worth moving?")
    tr = q["transfer"]
    if tr:
        lines.append(
            f"   A block is {fmt_bytes(tr['block_bytes'])}; recomputing it takes "
            f"{tr['recompute_s_per_block'] * 1e3:.2f} ms at the prefill rate"
        )
        for x in tr["tiers"]:
            verdict = "worth loading" if x["worth_loading"] else "NOT worth loading"
            lines.append(
                f"   from {x['name']:>6}: {x['load_s_per_block'] * 1e3:.2f} ms per block "
                f"({x['load_to_recompute']:.2f}x recompute): {verdict}"
            )
    else:
        lines.append("   (give --model-config or --bytes-per-token to compare bytes per hit with tier bandwidth)")
    lines.append("4. Which blocks should never be admitted?")
    ad = q["admission"]
    lines.append(
        f"   {ad['one_hit_block_fraction']:.1%} of distinct blocks are used once "
        f"({ad['one_hit_token_fraction']:.1%} of block tokens)."
    )
    for e in ad["threshold_effect"]:
        lines.append(
            f"   {e['policy']} @ {fmt_blocks(e['capacity_blocks'])}, admit {e['admission']}: hit rate "
            f"{_rate(e).rstrip()} "
            f"(always: {_pct(e['hit_rate_always'])}), writes {e['insertions']} (always: "
            f"{e['insertions_always']})"
        )
    if rep["tiers"]:
        mt = rep["tiers"]
        lines.append("")
        lines.append("Multi-tier replay (inclusive, write-through):")
        total = mt["total_tokens"] or 1
        for x in mt["tiers"]:
            what = "GPU hits" if x["name"] == "gpu" else f"{x['name'].upper()} promotions"
            worth = ""
            if x["saved_tokens"] != x["served_tokens"]:
                worth = f" ({x['saved_tokens'] / total:.1%} worth loading)"
            lines.append(
                f"   {x['name']:>6} {x['capacity_blocks']:>10} blocks {x['policy']:>7} admit "
                f"{x['admission']:<8} "
                f"{what}: {x['served_tokens'] / total:6.1%} of "
                f"tokens{worth}{_fill_note(x)}"
            )
        lines.append(f"   misses: {mt['miss_tokens'] / total:6.1%} of tokens")
    if rep["cost"]:
        c = rep["cost"]
        lines.append(
            f"   prefill compute saved by the lower tiers: {c['prefill_compute_saved_s']:.1f} s "
            f"({c['prefill_compute_saved_share']:.1%} of tokens) "
            f"at {c['prefill_tokens_per_s']:.0f} tokens/s"
        )
        if c["not_worth_loading_tokens"]:
            lines.append(
                f"   promotions not worth loading (recomputed, as the orchestrator would): "
                f"{c['not_worth_loading_tokens'] / (c['total_tokens'] or 1):.1%} of tokens"
            )
        if "mean_ttft_change_s" in c:
            lines.append(
                f"   mean TTFT estimate: {c['mean_ttft_gpu_only_s'] * 1e3:.0f} ms GPU-only -> "
                f"{c['mean_ttft_tiered_s'] * 1e3:.0f} ms tiered "
                f"({c['mean_ttft_change_s'] * 1e3:+.0f} ms)"
            )
    if rep.get("replicas"):
        lines += _replica_lines(rep["replicas"])
    rec = rep["recommendation"]
    lines.append("")
    lines.append(f"Recommendation: {rec['summary']}")
    lines += [f"   - {r}" for r in rec["reasons"]]
    return "\n".join(lines)


def _replica_lines(rp: dict[str, Any]) -> list[str]:
    """The K-replica comparison: the replicas' own tiers alone, then with the shared remote tier."""
    a, b, saves = rp["private"], rp["with_remote"], rp["remote_saves"]
    total = b["total_tokens"] or 1
    counts = rp["requests_per_replica"]
    lines = [
        "",
        f"{rp['replicas']} replicas, {rp['split']} split ({min(counts)}..{max(counts)} requests each), "
        "each with its own tiers:",
    ]
    for label, side in (("own tiers alone", a), ("+ shared remote", b)):
        served = ", ".join(f"{t['name']} {t['saved_tokens'] / total:.1%}" for t in side["tiers"])
        lines.append(
            f"   {label:<16} prefilled {side['recomputed_tokens'] / total:6.1%} of tokens "
            f"({side['recomputed_blocks']} blocks); served: {served}"
        )
    lines.append(
        f"   the shared remote tier saves {saves['recomputed_blocks']} block recomputes, "
        f"{saves['recomputed_tokens']} prefill tokens ({saves['token_share']:.1%} of tokens, "
        f"{saves['prefill_compute_saved_s']:.1f} s of prefill)"
    )
    if saves["remote_served_tokens"] != saves["remote_saved_tokens"]:
        lines.append(
            f"   remote hits not worth loading (recomputed): "
            f"{(saves['remote_served_tokens'] - saves['remote_saved_tokens']) / total:.1%} of tokens"
        )
    return lines
