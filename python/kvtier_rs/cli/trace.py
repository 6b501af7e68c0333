"""`kvtier trace synth`: write a synthetic trace (Mooncake JSONL) for the planner and demos."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable

from kvtier_rs.planner.errors import PlanError


def _number(lo: float, hi: float = math.inf, *, lo_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite float in [lo, hi] (or (lo, hi] with `lo_open`)."""
    rng = f"> {lo:g}" if lo_open else f">= {lo:g}"
    if hi != math.inf:
        rng += f" and <= {hi:g}"

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (math.isfinite(v) and (v > lo if lo_open else v >= lo) and v <= hi):
            raise argparse.ArgumentTypeError(f"must be a finite number {rng}, got {text!r}")
        return v

    return parse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="trace tools (synth)", description="Trace tools.")
    tsub = p.add_subparsers(dest="trace_command", metavar="TRACE_COMMAND")
    tsub.required = True
    s = tsub.add_parser(
        "synth",
        help="synthesize a realistic request trace",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Synthesize a request trace in Mooncake JSONL (chained hash_ids, block_size per record, "
        "session_id for the turns of a chat)."
        "\n\n"
        "Workloads, mixed by share of arrivals (--mix):\n"
        "  system  a shared system prompt (Zipf-popular among --system-prompts) and a unique question\n"
        "  rag     a RAG prompt, 1-3 documents from a shared set (--documents, Zipf) and a question\n"
        "  chat    multi-turn sessions resending the whole conversation each turn (--mean-turns, "
        "--think-time)\n"
        "  unique  prompts that share nothing\n"
        "Arrivals of new work: Poisson at --rate per second, or bursty (5x bursts and 0.2x lulls).",
    )
    s.add_argument("--out", "-o", required=True, help="output file (.jsonl, or .jsonl.gz)")
    s.add_argument("--requests", type=int, default=4000, help="number of requests (default 4000)")
    s.add_argument("--rate", type=_number(0, lo_open=True), default=2.0, help="new arrivals per second (default 2)")
    s.add_argument("--arrivals", choices=["poisson", "bursty"], default="poisson")
    s.add_argument(
        "--mix",
        default="system=0.25,rag=0.25,chat=0.35,unique=0.15",
        help="workload shares (default %(default)s)",
    )
    s.add_argument("--block-size", type=int, default=512, help="tokens per block (default 512)")
    s.add_argument("--system-prompts", type=int, default=8)
    s.add_argument("--documents", type=int, default=400)
    # Weights are 1 / rank**s: rank**s overflows a float for large s, and past 10 rank 1 takes all.
    s.add_argument("--zipf", type=_number(0, 10), default=1.1, help="popularity skew of prompts and documents")
    s.add_argument("--mean-turns", type=_number(1), default=5.0)
    s.add_argument(
        "--think-time", type=_number(0, lo_open=True), default=30.0, help="mean seconds between turns of a session"
    )
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=run_synth)


def run_synth(args: argparse.Namespace) -> int:
    from kvtier_rs.planner.synth import SynthConfig, parse_mix, synthesize, write_trace
    from kvtier_rs.planner.traces import MAX_BLOCK_SIZE

    # The planner's own bound: a larger block size wrote a trace `kvtier plan` then refused.
    if not 0 < args.block_size <= MAX_BLOCK_SIZE:
        raise PlanError(f"--block-size: must be between 1 and {MAX_BLOCK_SIZE} tokens, got {args.block_size}")
    if args.system_prompts <= 0 or args.documents <= 0:
        raise PlanError("--system-prompts and --documents must be positive")
    cfg = SynthConfig(
        requests=args.requests,
        rate=args.rate,
        arrivals=args.arrivals,
        mix=parse_mix(args.mix),
        block_size=args.block_size,
        system_prompts=args.system_prompts,
        documents=args.documents,
        zipf=args.zipf,
        think_time_s=args.think_time,
        mean_turns=args.mean_turns,
        seed=args.seed,
    )
    records = synthesize(cfg)
    try:
        write_trace(records, args.out)
    except OSError as e:
        raise PlanError(f"--out: cannot write {args.out}: {e.strerror}") from None
    refs = sum(len(r["hash_ids"]) for r in records)
    print(f"wrote {len(records)} requests ({refs} block references) to {args.out}", file=sys.stderr)
    return 0
