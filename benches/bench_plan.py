"""Planner replay speed: a sweep of 7 capacities x 4 policies (fifo, lru, arc, opt) over the
Mooncake conversation trace in the Rust core (target: under 2 s on 2 cores), and the same sweep
against the plain-Python reference model (tests/support/planner_reference.py) in the same run.

The Python model is far too slow for the whole trace, so the ratio is measured on identical
work: both replay the first --ref-requests requests with the same capacities; their hit tokens
must agree exactly. Prints a table, or JSON with --json.

    .venv/bin/python benches/bench_plan.py [--trace PATH] [--ref-requests N] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from support import planner_reference as ref  # noqa: E402

from kvtier_rs._core import replay_sweep  # noqa: E402
from kvtier_rs.planner.plan import build_trace  # noqa: E402
from kvtier_rs.planner.traces import read_trace  # noqa: E402

POLICIES = ["fifo", "lru", "arc", "opt"]
FRACTIONS = [1 / 256, 1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2]


def sweep(trace, caps, threads=0):
    jobs = [(p, c, "always") for p in POLICIES for c in caps]
    t0 = time.perf_counter()
    res = replay_sweep(trace, jobs, warmup=0.5, threads=threads)
    return time.perf_counter() - t0, res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"))
    ap.add_argument("--ref-requests", type=int, default=600)
    ap.add_argument("--repeat", type=int, default=3, help="Rust timings: best of N")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not Path(args.trace).is_file():
        print(f"bench_plan: trace {args.trace} not found (pass --trace)", file=sys.stderr)
        return 2

    t0 = time.perf_counter()
    data = read_trace(args.trace)
    trace = build_trace(data)
    load_s = time.perf_counter() - t0
    caps = sorted({max(1, round(trace.n_keys * f)) for f in FRACTIONS})
    full_s = min(sweep(trace, caps)[0] for _ in range(args.repeat))
    one_thread_s = min(sweep(trace, caps, threads=1)[0] for _ in range(args.repeat))

    part = read_trace(args.trace, limit=args.ref_requests)
    ptrace = build_trace(part)
    pcaps = sorted({max(1, round(ptrace.n_keys * f)) for f in FRACTIONS})
    rust_part_s, rust_part = min((sweep(ptrace, pcaps, threads=1) for _ in range(args.repeat)), key=lambda x: x[0])
    reqs = [
        (list(part.keys[part.offsets[r] : part.offsets[r + 1]]), part.input_tokens[r]) for r in range(part.n_requests)
    ]
    t0 = time.perf_counter()
    py = [ref.replay(reqs, part.block_size, p, c, warmup=0.5) for p in POLICIES for c in pcaps]
    py_s = time.perf_counter() - t0
    agree = all(a["hit_tokens"] == b["hit_tokens"] for a, b in zip(rust_part, py, strict=True))

    out = {
        "trace": args.trace,
        "requests": trace.n_requests,
        "block_refs": trace.n_refs,
        "capacities": caps,
        "policies": POLICIES,
        "trace_load_s": round(load_s, 3),
        "rust_sweep_s": round(full_s, 3),
        "rust_sweep_one_thread_s": round(one_thread_s, 3),
        "target_s": 2.0,
        "within_target": full_s < 2.0,
        "ref_requests": part.n_requests,
        "ref_capacities": pcaps,
        "rust_slice_one_thread_s": round(rust_part_s, 4),
        "python_slice_s": round(py_s, 3),
        "python_over_rust": round(py_s / rust_part_s, 1),
        "hit_tokens_agree": agree,
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"trace: {trace.n_requests} requests, {trace.n_refs} block refs (load {load_s:.2f} s)")
        print(f"Rust sweep, {len(POLICIES)} policies x {len(caps)} capacities {caps}:")
        print(
            f"  all cores {full_s:.3f} s (target < 2 s: {'ok' if full_s < 2 else 'MISSED'}), one "
            f"thread {one_thread_s:.3f} s"
        )
        print(f"Same sweep on the first {part.n_requests} requests, one thread each (capacities {pcaps}):")
        print(
            f"  Rust {rust_part_s:.4f} s, Python reference {py_s:.2f} s: Python/Rust = "
            f"{py_s / rust_part_s:.0f}x;"
            f" hit tokens agree: {agree}"
        )
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
