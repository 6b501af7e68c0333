"""`kvtier rollout`: roll tiers out step by step against a live engine and say, per step, keep or
roll back."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

DESCRIPTION = """\
A controlled rollout, measured against a live engine: a GPU-only baseline, then +CPU tier, then
+disk tier, one dimension at a time. Each step replays the same trace against an OpenAI-compatible
endpoint, streaming, and reports TTFT, ITL and end-to-end p50/p95/p99 per concurrency level,
throughput, and hit quality by tier (GPU prefix hits, CPU loads, disk promotions, recomputed
tokens) from the engine's own /metrics, beside the planner's prediction for the same trace and
tier sizes. With budgets (--ttft-p99, --itl-p99) each step gets a verdict: a step over budget at
any level is rolled back, with the reason.

Steps, one of:
  --endpoint [NAME=]URL ...   servers you started, one per step, in order (unnamed: baseline,
                              cpu, disk)
  --launch MODEL --cpu SIZE [--disk SIZE --disk-root DIR] [--engine-args "..."]
                              starts `python -m vllm.entrypoints.openai.api_server` per step
                              (baseline, +cpu, +disk) with the --kv-transfer-config it generates,
                              waits for it, and stops it afterwards
  --config FILE               JSON (or .toml) listing the steps; see docs/rollout.md

Workload: each trace block id becomes a fixed run of --block-tokens token ids, so prompts share
prefixes exactly as the trace's block ids do; prompts go as token ids (no tokenizer in between).
Each concurrency level replays the trace from cold (its own tokens).

Output: a table on the terminal, and --out DIR (written whole at the end, or not at all) with
report.json (schema "kvtier.rollout/1"), table.txt, latency_cdf.png, p99_vs_concurrency.png,
hit_quality.png and, in launcher mode, each step's server log.
"""


def _levels(text: str) -> list[int] | None:
    if text == "trace":
        return None
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated levels like 1,4,16 or 'trace', got {text!r}"
        ) from None
    if not levels or any(c <= 0 for c in levels):
        raise argparse.ArgumentTypeError(f"levels must be positive integers, got {text!r}")
    return levels


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "rollout",
        help="roll tiers out step by step against a live engine, with a keep/roll-back verdict",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("trace")
    g.add_argument("--trace", required=True, help="trace file (formats as kvtier plan reads them)")
    g.add_argument(
        "--trace-format", default="auto", choices=["auto", "mooncake", "bailian", "kvcache-tester", "tokens"]
    )
    g.add_argument("--block-size", type=int, help="the trace's tokens per block (default: per format)")
    g.add_argument("--limit", type=int, help="replay only the first N requests")
    g.add_argument("--skip-bad", action="store_true", help="skip malformed records instead of failing")
    s = p.add_argument_group("steps")
    s.add_argument("--endpoint", action="append", default=[], metavar="[NAME=]URL", help="a running server per step")
    s.add_argument("--launch", metavar="MODEL", help="start vllm serve with MODEL for each step")
    s.add_argument("--served-model-name", default="model", help="the launched servers' model name (default model)")
    s.add_argument(
        "--engine-args",
        default="",
        help="more vllm serve arguments for launched steps, one string (one flag alone: --engine-args=--enforce-eager)",
    )
    s.add_argument("--cpu", help="CPU tier size of the +cpu (and +disk) step, e.g. 32GiB")
    s.add_argument("--disk", help="disk tier size of the +disk step, e.g. 500GiB")
    s.add_argument("--disk-root", help="the disk tier's parent directory")
    s.add_argument("--extra", help="more kv_connector_extra_config keys for kvtier's steps, as JSON")
    s.add_argument("--config", help="JSON or TOML file listing the steps (and the launch)")
    s.add_argument("--model", help="the model name to request (default: the endpoint's only model)")
    w = p.add_argument_group("load")
    w.add_argument(
        "--concurrency",
        type=_levels,
        default=[1],
        help="stepped concurrency levels, e.g. 1,4,16; or 'trace' for the trace's own timing (default 1)",
    )
    w.add_argument(
        "--time-scale", type=float, default=1.0, help="with --concurrency trace: stretch (>1) or squeeze time"
    )
    w.add_argument("--block-tokens", type=int, help="prompt tokens per trace block (default: the trace's block size)")
    w.add_argument("--max-tokens", type=int, default=16, help="output tokens per request at most (default 16)")
    w.add_argument(
        "--max-prompt-tokens", type=int, help="cut longer prompts at a block boundary (default: fit the model)"
    )
    w.add_argument("--token-range", default="100:1000", help="token ids LO:HI the prompts are drawn from")
    w.add_argument(
        "--seed",
        type=int,
        help="seed of the prompt tokens (default: drawn per run, so a rerun meets no cache left warm by the last)",
    )
    w.add_argument("--warmup-requests", type=int, default=1, help="unmeasured requests before each step (default 1)")
    b = p.add_argument_group("rollback rule")
    b.add_argument("--ttft-p99", help="p99 TTFT budget, e.g. 500ms")
    b.add_argument("--itl-p99", help="p99 inter-token latency budget, e.g. 50ms")
    o = p.add_argument_group("output")
    o.add_argument("--out", required=True, help="output directory (report.json, table.txt, figures, logs)")
    o.add_argument("--overwrite", action="store_true", help="replace an existing --out directory")
    o.add_argument("--no-predict", action="store_true", help="skip the planner's prediction")
    o.add_argument("--format", choices=["table", "json"], default="table", help="what to print (default table)")
    o.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None, help="progress bar")
    p.set_defaults(func=run)


def _steps(args: argparse.Namespace):
    from kvtier_rs.rollout.errors import RolloutError
    from kvtier_rs.rollout.steps import Launch, endpoint_steps, launch_steps, load_config

    modes = [m for m, on in (("--endpoint", args.endpoint), ("--launch", args.launch), ("--config", args.config)) if on]
    if len(modes) > 1 and not (modes == ["--launch", "--config"]):
        raise RolloutError(f"{modes[1]}: give one of --endpoint, --launch, --config")
    if not modes:
        raise RolloutError("--endpoint: give the endpoint to measure (or --launch MODEL, or --config FILE)")
    launch = Launch(args.launch, args.served_model_name, shlex.split(args.engine_args)) if args.launch else None
    if args.config:
        steps, file_launch = load_config(args.config)
        return steps, launch or file_launch
    if args.endpoint:
        return endpoint_steps(args.endpoint), None
    extra = {}
    if args.extra:
        try:
            extra = json.loads(args.extra)
        except ValueError as e:
            raise RolloutError(f"--extra: not valid JSON ({e})") from None
        if not isinstance(extra, dict):
            raise RolloutError("--extra: expected a JSON object of kv_connector_extra_config keys")
    return launch_steps(args.cpu, args.disk, args.disk_root, extra), launch


def run(args: argparse.Namespace) -> int:
    from kvtier_rs.rollout.run import RolloutOptions, run_rollout
    from kvtier_rs.rollout.units import parse_duration
    from kvtier_rs.rollout.workload import parse_token_range

    # Budgets and token range first: cheap, and a typo there must not cost a whole rollout.
    ttft = parse_duration(args.ttft_p99, "--ttft-p99") if args.ttft_p99 is not None else None
    itl = parse_duration(args.itl_p99, "--itl-p99") if args.itl_p99 is not None else None
    token_range = parse_token_range(args.token_range)
    steps, launch = _steps(args)
    opts = RolloutOptions(
        trace=args.trace,
        steps=steps,
        out=args.out,
        launch=launch,
        model=args.model,
        trace_format=args.trace_format,
        block_size=args.block_size,
        limit=args.limit,
        skip_bad=args.skip_bad,
        block_tokens=args.block_tokens,
        max_tokens=args.max_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        token_range=token_range,
        seed=args.seed,
        concurrency=args.concurrency,
        time_scale=args.time_scale,
        ttft_p99_s=ttft,
        itl_p99_s=itl,
        warmup_requests=args.warmup_requests,
        overwrite=args.overwrite,
        progress=args.progress,
        predict=not args.no_predict,
    )
    report = run_rollout(opts)
    if args.format == "json":
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(report["table"])
        print(f"\nwritten: {args.out}/ (report.json, table.txt, {', '.join(report['plots'])})")
    return 0
