"""How much of the LRU -> Belady (opt) hit-rate gap each policy closes, per trace and capacity,
through the planner's replay (prefix-tree mode, token-weighted, warm-up 0.5 by default).

For each trace and capacity: LRU's and opt's hit rates, each policy's, the share of the gap it
closes ((p - lru) / (opt - lru)) and its difference from LRU. opt is left out (and the gap with
it) on a trace whose block ids are not prefix-chained, where it is no bound.

    .venv/bin/python benches/policy_gap.py [--policies arc,s3fifo,lhd] [--capacities 1024,...]
        [--traces PATH ...] [--warmup 0.5] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvtier_rs._core import replay_sweep
from kvtier_rs.planner.plan import build_trace
from kvtier_rs.planner.traces import read_trace

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces"
DEFAULT_TRACES = [
    TRACES / "mooncake_conversation_trace.jsonl",
    TRACES / "mooncake_synthetic_trace.jsonl",
    TRACES / "weka_kvcachetester_trace_0001.json",
    TRACES / "weka_kvcachetester_trace_0146.json",
]
DEFAULT_CAPACITIES = "1024,2048,4096,8192,16384,32768,65536"


def sweep(path: Path, policies: list[str], caps: list[int], warmup: float) -> dict:
    trace = build_trace(read_trace(path))
    names = ["lru", *[p for p in policies if p != "lru"]]
    if trace.prefix_chained:
        names.append("opt")
    jobs = [(p, c, "always") for p in names for c in caps]
    rates = {
        (r["policy"], r["capacity_blocks"]): r["hit_tokens"] / r["total_tokens"]
        for r in replay_sweep(trace, jobs, warmup=warmup)
    }
    rows = []
    for c in caps:
        lru = rates[("lru", c)]
        opt = rates.get(("opt", c))
        row = {"capacity": c, "lru": lru, "opt": opt, "policies": {}}
        for p in policies:
            v = rates[(p, c)]
            gap = (v - lru) / (opt - lru) if opt is not None and opt - lru > 1e-9 else None
            row["policies"][p] = {"hit_rate": v, "minus_lru": v - lru, "gap_closed": gap}
        rows.append(row)
    return {"trace": path.name, "distinct_blocks": trace.n_keys, "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default="arc,s3fifo,lhd")
    ap.add_argument("--capacities", default=DEFAULT_CAPACITIES)
    ap.add_argument("--traces", nargs="*", type=Path, default=DEFAULT_TRACES)
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    caps = [int(c) for c in args.capacities.split(",")]
    missing = [str(t) for t in args.traces if not t.is_file()]
    if missing:
        print(f"policy_gap: trace(s) not found: {', '.join(missing)} (pass --traces)", file=sys.stderr)
        return 2
    out = [sweep(t, policies, caps, args.warmup) for t in args.traces]
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    for t in out:
        print(f"\n{t['trace']} ({t['distinct_blocks']} distinct blocks)")
        print(f"{'capacity':>9} {'lru':>7} {'opt':>7}" + "".join(f" {p:>8} {'gap':>6} {'-lru':>7}" for p in policies))
        for r in t["rows"]:
            opt = f"{r['opt']:7.4f}" if r["opt"] is not None else f"{'-':>7}"
            line = f"{r['capacity']:>9} {r['lru']:7.4f} {opt}"
            for p in policies:
                v = r["policies"][p]
                gap = f"{100 * v['gap_closed']:5.1f}%" if v["gap_closed"] is not None else f"{'-':>6}"
                line += f" {v['hit_rate']:8.4f} {gap} {v['minus_lru']:+7.4f}"
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
