"""`kvtier plan`: replay a trace through the core's policies and answer whether tiering pays.

The replays run in the Rust core with the GIL released (`kvtier_rs._core.replay_sweep`,
`replay_tiers`); this module reads the trace, picks capacities, runs the sweeps (with a
progress bar), and turns counts into the report described by `SCHEMA` below.
"""

from __future__ import annotations

import bisect
import math
import sys
import threading
from typing import Any

from kvtier_rs.planner import gains, replicas
from kvtier_rs.planner.advice import choose_policy, recommend
from kvtier_rs.planner.checks import TIERS, check_options, tier_blocks
from kvtier_rs.planner.errors import PlanError
from kvtier_rs.planner.options import PlanOptions
from kvtier_rs.planner.traces import TraceData, read_trace

SCHEMA_VERSION = "kvtier.plan/1"
# Sweep grid as fractions of the trace's distinct blocks (its working set).
DEFAULT_FRACTIONS = (1 / 256, 1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2)
# What the two reference curves bound, as the report labels them. The ceiling (an infinite
# cache) holds every block any finite cache could, so no policy hits more blocks or tokens.
# Belady (`opt`) keeps the blocks whose next use comes soonest, which maximises block hits over
# the whole replay (`all_block_hit_rate`: warm-up included). It does not weigh blocks by their
# tokens, so a policy that keeps fuller blocks (a request's last block is often partial) can hit
# more tokens; nor does it favour the measured window, so after a warm-up another policy can hit
# more blocks there. Neither measured rate is bounded by opt's.
BOUNDS = {
    "opt": {"metric": "all_block_hit_rate", "of": "every policy at the same capacity"},
    "ceiling": {"metric": ["hit_rate", "block_hit_rate", "all_block_hit_rate"], "of": "every policy at every capacity"},
}
# A cache that first filled after this share of the measured requests is flagged `filled_late`.
LATE_FILL_SHARE = 0.1


def _rate(hit: int, total: int) -> float | None:
    return hit / total if total else None


def _progress_run(fn, total: int, desc: str, show: bool | None):
    """Run `fn(progress)` in a worker thread (it releases the GIL) and draw a tqdm bar."""
    from kvtier_rs._core import ReplayProgress

    prog = ReplayProgress()
    if show is None:
        show = sys.stderr.isatty()
    if not show or total == 0:
        return fn(prog)
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is a nicety; the plan extra installs tqdm
        return fn(prog)
    out: dict[str, Any] = {}

    def work() -> None:
        try:
            out["value"] = fn(prog)
        except BaseException as e:  # re-raised in the caller's thread
            out["error"] = e

    th = threading.Thread(target=work, daemon=True)
    with tqdm(total=total, desc=desc, unit="req", unit_scale=True, leave=False, file=sys.stderr) as bar:
        th.start()
        while th.is_alive():
            th.join(0.1)
            bar.update(prog.done - bar.n)
        bar.update(prog.done - bar.n)
    if "error" in out:
        raise out["error"]
    return out["value"]


def _percentile(s: list[float], q: float) -> float:
    """numpy's default ("linear") percentile `q` of the sorted, non-empty `s`."""
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    frac = pos - lo
    return s[lo] + (s[hi] - s[lo]) * frac


def _percentiles(values: list[float]) -> dict[str, float] | None:
    # Plain Python (a sort and three look-ups): importing numpy for this would cost the
    # command more than the computation.
    if not values:
        return None
    s = sorted(values)
    return {
        "count": len(s),
        "mean": math.fsum(s) / len(s),
        "p50": _percentile(s, 50),
        "p90": _percentile(s, 90),
        "p99": _percentile(s, 99),
    }


def _histogram(values: list[float], *, log: bool) -> dict[str, list[Any]] | None:
    """24 bins as numpy.histogram counts them (each [a, b), the last [a, b]), over edges spaced
    evenly from 0 to the largest value, or logarithmically from the smallest positive value
    (at least 1e-3) with the first edge at 0."""
    if not values:
        return None
    s = sorted(values)
    n_edges = 25
    if log:
        pos = [v for v in s if v > 0]
        lo = max(pos[0], 1e-3) if pos else 1e-3
        hi = max(s[-1], lo * 10)
        a, b = math.log10(lo), math.log10(hi)
        step = (b - a) / (n_edges - 1)
        # The last edge is the largest value itself: 10 ** log10(hi) can come out an ulp below
        # it, which left the largest value out of every bin.
        edges = [10.0 ** (a + i * step) for i in range(n_edges - 1)] + [float(hi)]
        edges[0] = 0.0
    else:
        top = s[-1] or 1
        step = top / (n_edges - 1)
        # As numpy.linspace: a step that underflows to 0 scales the fractions instead.
        edges = [i * step if step else i / (n_edges - 1) * top for i in range(n_edges - 1)] + [float(top)]
    cuts = [bisect.bisect_left(s, e) for e in edges[:-1]] + [bisect.bisect_right(s, edges[-1])]
    counts = [cuts[i + 1] - cuts[i] for i in range(n_edges - 1)]
    return {"edges": [float(e) for e in edges], "counts": counts}


def default_capacities(n_keys: int, tier_blocks: list[int]) -> list[int]:
    caps = {max(1, round(n_keys * f)) for f in DEFAULT_FRACTIONS}
    caps.update(b for b in tier_blocks if b > 0)
    return sorted(caps)


def build_trace(data: TraceData):
    from kvtier_rs._core import ReplayTrace

    return ReplayTrace(data.offsets, data.keys, data.input_tokens, data.timestamps_s, data.block_size)


def run_plan(opts: PlanOptions) -> dict[str, Any]:
    from kvtier_rs._core import replay_sweep

    model = check_options(opts)  # every option, before the trace is read
    data = read_trace(
        opts.trace, opts.trace_format, block_size=opts.block_size, skip_bad=opts.skip_bad, limit=opts.limit
    )
    trace = build_trace(data)
    bs = data.block_size
    block_bytes = model.bytes_per_token * bs if model else None
    # The live orchestrator's load-or-recompute rule, for every gain the report counts.
    remote = (opts.remote_gbps, opts.remote_latency_ms / 1e3) if opts.remote else None
    cost = gains.cost_model(block_bytes, bs, opts.prefill_tps, opts.pcie_gbps, opts.disk_gbps, remote)
    tiers = {name: tier_blocks(f"--{name}", size, block_bytes) for name in TIERS if (size := getattr(opts, name))}
    assignment = replicas.split(data, opts.replicas, opts.split) if opts.replicas > 1 else None

    if opts.capacities:
        caps = sorted(set(opts.capacities))
    else:
        caps = default_capacities(trace.n_keys, list(tiers.values()))

    warm = opts.warmup
    policies = list(dict.fromkeys(opts.policies))  # each once: a repeat is the same replay
    trace_notes = []
    if "opt" in policies and not trace.prefix_chained:
        # Belady is a bound only where every block id always follows the same id (ids that
        # digest their prefix): elsewhere a block's next use can sit behind a miss, online
        # policies beat it, and the core refuses it. The rest of the plan holds: left out, said.
        policies.remove("opt")
        if not policies:
            raise PlanError(
                "--policies: opt (Belady) is no bound on this trace: its block ids are not prefix-chained "
                "(a block follows different blocks in different requests); give an online policy too"
            )
        trace_notes.append(
            "opt (Belady) left out: the block ids are not prefix-chained (a block follows different blocks "
            "in different requests), and there it is no bound"
        )
    jobs = [(p, c, "always") for p in policies for c in caps] + [("ceiling", 0, "always")]
    total = len(jobs) * trace.n_requests
    sweep = _progress_run(
        lambda prog: replay_sweep(trace, jobs, warmup=warm, mode=opts.mode, threads=opts.threads, progress=prog),
        total,
        "replay",
        opts.progress,
    )
    results = [_result(r, block_bytes, trace, cost) for r in sweep[:-1]]
    ceiling = _result(sweep[-1], block_bytes, trace, cost)

    # One policy for the rest of the plan; its admission thresholds at every capacity.
    best_policy = choose_policy(results, ceiling["gain_rate"] or 0.0)
    adm_jobs = [(best_policy, c, f"uses:{k}") for k in opts.admission_thresholds for c in caps] if best_policy else []
    adm = replay_sweep(trace, adm_jobs, warmup=warm, mode=opts.mode, threads=opts.threads) if adm_jobs else []
    admission_results = [_result(r, block_bytes, trace, cost) for r in adm]

    analysis = trace.analyze(opts.top)
    questions = _questions(trace, analysis, model, cost, results, admission_results, best_policy)

    multitier = None
    tier_costs = None
    split = None
    if len(tiers) >= 1:
        specs = _tier_specs(opts, tiers, opts.tier_policy or best_policy or "lru")
        multitier, tier_costs = _tier_replay(trace, specs, opts, cost)
        if assignment is not None:
            private = [s for s in specs if s[0] != "remote"]
            split = replicas.compare(
                opts.replicas,
                opts.split,
                assignment,
                _tier_replay(trace, private, opts, cost, assignment),
                _tier_replay(trace, specs, opts, cost, assignment),
                opts.prefill_tps,
            )

    report: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "trace": {
            "path": data.path,
            "format": data.format,
            "block_size": bs,
            "requests": trace.n_requests,
            "block_refs": trace.n_refs,
            "distinct_blocks": trace.n_keys,
            "input_tokens": trace.total_tokens,
            "skipped_records": data.skipped,
            "skipped_examples": data.skipped_examples,
            "warmup": warm,
            "measured_requests": ceiling["measured_requests"],
            "mode": opts.mode,
            "notes": trace_notes,
        },
        "model": None
        if model is None
        else {
            "bytes_per_token": model.bytes_per_token,
            "block_bytes": block_bytes,
            "source": model.source,
            "notes": model.notes,
        },
        "capacities_blocks": caps,
        "bounds": BOUNDS,
        "results": results,
        "ceiling": ceiling,
        "admission_results": admission_results,
        "questions": questions,
        "tiers": multitier,
        "cost_weighted": cost is not None,
        "cost": tier_costs,
        "replicas": split,
    }
    report["recommendation"] = recommend(report)
    return report


def _tier_specs(opts: PlanOptions, tiers: dict[str, int], policy: str) -> list[tuple[str, int, str, str]]:
    """The tiers asked for, fastest first, as the core's replay takes them. The remote store
    evicts by its own rule, the server's allkeys-lru over every block written to it."""
    rule = {"gpu": (policy, "always"), "cpu": (policy, opts.cpu_admission), "disk": (policy, opts.disk_admission)}
    rule["remote"] = ("lru", "always")
    return [(name, tiers[name], *rule[name]) for name in TIERS if name in tiers]


def _tier_replay(trace, specs, opts: PlanOptions, cost, assignment: list[int] | None = None):
    """The multi-tier replay of `specs` (split across replicas by `assignment`, the remote tier
    shared by all of them) and its cost figures: (tier replay, tiers_cost)."""
    from kvtier_rs._core import replay_tiers

    shared = [s[0] for s in specs if s[0] == "remote"]
    mt = replay_tiers(trace, specs, warmup=opts.warmup, mode=opts.mode, replicas=assignment, shared=shared)
    for t in mt["tiers"]:
        t.update(fill_flags({**t, "measured_requests": mt["measured_requests"]}, trace.n_requests))
    tier_costs = gains.tiers_cost(mt, cost, opts.prefill_tps)
    for t in mt["tiers"]:
        t["saved_tokens"] = tier_costs["saved_tokens_by_tier"].get(t["name"], t["served_tokens"])
    del mt["served_histogram"]
    return mt, tier_costs


def fill_flags(r: dict, n_requests: int) -> dict[str, Any]:
    """How full a bounded cache was while it was measured: `unfilled_share`, the share of the
    measured requests looked up before it first filled (1.0 if it never did), and
    `filled_late`, set when that share is over LATE_FILL_SHARE: the cache filled only late in
    the trace, so its measured rate is partly that of a cache still warming up (no evictions
    yet), which overstates it. `underfilled` (never full at all) comes from the replay."""
    measured = r["measured_requests"]
    filled_at = r["filled_at_request"]
    if filled_at is None:
        unfilled = measured
    else:
        unfilled = min(measured, max(0, filled_at + 1 - (n_requests - measured)))
    share = unfilled / measured if measured else 0.0
    return {"unfilled_share": share, "filled_late": not r["underfilled"] and share > LATE_FILL_SHARE}


def _result(r: dict, block_bytes: int | None, trace, cost) -> dict[str, Any]:
    n_requests = trace.n_requests
    out = dict(r)
    # Hits worth loading (all hits without a cost model): what the advice counts as gains.
    gain = gains.sweep_gain(r, cost)
    out.update(gain_tokens=gain["gain_tokens"], gain_rate=gain["gain_rate"])
    del out["hit_histogram"]
    out["all_block_hit_rate"] = _rate(r["all_hit_blocks"], trace.n_refs)
    out["hit_rate"] = _rate(r["hit_tokens"], r["total_tokens"])
    out["block_hit_rate"] = _rate(r["hit_blocks"], r["total_blocks"])
    cap = r["capacity_blocks"]
    out["capacity_bytes"] = cap * block_bytes if (cap is not None and block_bytes) else None
    if cap is not None:  # the ceiling is unbounded: no fill to speak of
        out.update(fill_flags(r, n_requests))
    return out


def _questions(trace, analysis, model, cost, results, admission_results, best_policy) -> dict[str, Any]:  # noqa: PLR0917 - one input per section of the questions
    total_tokens = trace.total_tokens
    tops = []
    for p in analysis["top_prefixes"]:
        tops.append(
            {
                **p,
                "token_share": p["tokens"] * p["requests"] / total_tokens if total_tokens else 0.0,
                "reusable_token_share": p["tokens"] * (p["requests"] - 1) / total_tokens if total_tokens else 0.0,
            }
        )
    block_tokens = analysis["block_tokens"] or 1
    times = analysis["reuse_time_s"]
    dists = analysis["reuse_distance"]
    transfer = None
    if cost is not None:
        transfer = {"bytes_per_token": model.bytes_per_token, **gains.transfer(cost)}
    threshold_effect = []
    by_key = {(r["policy"], r["capacity_blocks"]): r for r in results}
    for r in admission_results:
        base = by_key.get((r["policy"], r["capacity_blocks"]))
        threshold_effect.append(
            {
                "policy": r["policy"],
                "capacity_blocks": r["capacity_blocks"],
                "admission": r["admission"],
                "hit_rate": r["hit_rate"],
                "hit_rate_always": base["hit_rate"] if base else None,
                "gain_rate": r["gain_rate"],
                "gain_rate_always": base["gain_rate"] if base else None,
                "insertions": r["insertions"],
                "insertions_always": base["insertions"] if base else None,
                "underfilled": r["underfilled"],
                "filled_late": r["filled_late"],
            }
        )
    return {
        "shared_prefixes": {"shared_token_share": analysis["shared_tokens"] / block_tokens, "top": tops},
        "reuse": {
            "reuses": len(times),
            "time_s": _percentiles(times),
            "distance_blocks": _percentiles([float(d) for d in dists]),
            "time_histogram_s": _histogram(times, log=True),
            "distance_histogram_blocks": _histogram([float(d) for d in dists], log=True),
        },
        "transfer": transfer,
        "admission": {
            "one_hit_block_fraction": analysis["one_hit_keys"] / trace.n_keys if trace.n_keys else 0.0,
            "one_hit_ref_fraction": analysis["one_hit_refs"] / trace.n_refs if trace.n_refs else 0.0,
            "one_hit_token_fraction": analysis["one_hit_tokens"] / block_tokens,
            "policy": best_policy,
            "threshold_effect": threshold_effect,
        },
    }
