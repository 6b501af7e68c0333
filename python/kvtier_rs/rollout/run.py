"""One rollout from start to end: inputs checked first (budgets, trace, endpoints, model), then
each step measured (its server launched and stopped, in launcher mode) level by level, with the
engine's counters scraped around every level; then the planner's predictions, the verdicts, and
the output directory written in one piece."""

from __future__ import annotations

import dataclasses
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier_rs.planner.traces import TraceData, read_trace
from kvtier_rs.rollout import metrics as M
from kvtier_rs.rollout.client import check_model
from kvtier_rs.rollout.driver import TRACE_TIMING, run_level
from kvtier_rs.rollout.errors import RolloutError
from kvtier_rs.rollout.launcher import Launched
from kvtier_rs.rollout.output import check_out_dir, staged_dir, write_json
from kvtier_rs.rollout.predict import predict
from kvtier_rs.rollout.report import SCHEMA_VERSION, level_report, recommended, render_table, verdict
from kvtier_rs.rollout.steps import Launch, Step
from kvtier_rs.rollout.workload import TOKEN_RANGE, WorkloadOptions, build_requests

#: How long the engine may take, after the last response of a level, to count it in /metrics.
SETTLE_TIMEOUT_S = 30.0
#: Salts of the token synthesis: the warm-up's prompts share nothing with any level's.
WARMUP_SALT = 1 << 20


@dataclass
class RolloutOptions:
    trace: str
    steps: list[Step]
    out: str
    launch: Launch | None = None
    model: str | None = None
    trace_format: str = "auto"
    block_size: int | None = None
    limit: int | None = None
    skip_bad: bool = False
    block_tokens: int | None = None  # default: the trace's block size
    max_tokens: int = 16
    max_prompt_tokens: int | None = None  # default: the model's max_model_len less max_tokens
    token_range: tuple[int, int] = TOKEN_RANGE
    # None: drawn per run. A rerun with the same seed sends the same prompts, which an engine
    # still up, or a disk tier's directory (it outlives its server), may hold already: the rerun
    # would measure warm caches as if cold. Give one to repeat a run's prompts exactly.
    seed: int | None = None
    concurrency: list[int] | None = field(default_factory=lambda: [1])  # None: the trace's timing
    time_scale: float = 1.0
    ttft_p99_s: float | None = None
    itl_p99_s: float | None = None
    warmup_requests: int = 1
    overwrite: bool = False
    progress: bool | None = None
    predict: bool = True


def check_options(opts: RolloutOptions) -> TraceData:
    """Every input refused before anything is sent or started; returns the trace."""
    if opts.block_tokens is not None and opts.block_tokens <= 0:
        raise RolloutError(f"--block-tokens: must be positive, got {opts.block_tokens}")
    if opts.max_tokens <= 0:
        raise RolloutError(f"--max-tokens: must be positive, got {opts.max_tokens}")
    if opts.concurrency is not None and (not opts.concurrency or any(c <= 0 for c in opts.concurrency)):
        raise RolloutError(f"--concurrency: levels must be positive integers, got {opts.concurrency}")
    if not opts.time_scale > 0:
        raise RolloutError(f"--time-scale: must be positive, got {opts.time_scale}")
    if opts.seed is not None and opts.seed < 0:
        raise RolloutError(f"--seed: must be >= 0, got {opts.seed}")
    if opts.warmup_requests < 0:
        raise RolloutError(f"--warmup-requests: must be >= 0, got {opts.warmup_requests}")
    if not opts.steps:
        raise RolloutError("no steps: give --endpoint, --launch or --config")
    names = [s.name for s in opts.steps]
    if len(set(names)) != len(names):
        raise RolloutError(f"steps: names must differ, got {names}")
    if any(s.endpoint is None for s in opts.steps) and opts.launch is None:
        raise RolloutError("--launch: a step without an endpoint needs a model to launch (--launch MODEL)")
    if opts.launch is not None and opts.model is not None and opts.model != opts.launch.served_model_name:
        # Refused now, not after a server start of minutes.
        raise RolloutError(
            f"--model {opts.model}: launched servers serve {opts.launch.served_model_name!r} "
            "(--served-model-name); give the same name"
        )
    check_out_dir(opts.out, opts.overwrite)
    data = read_trace(
        opts.trace, opts.trace_format, block_size=opts.block_size, skip_bad=opts.skip_bad, limit=opts.limit
    )
    for s in opts.steps:
        if s.endpoint is not None:
            check_model(s.endpoint, opts.model, "--endpoint")
    return data


def _settle(url: str, before: M.Samples, finished: int) -> tuple[M.Samples, bool]:
    """A scrape once the engine has counted every finished request (vLLM publishes a step's
    stats with its outputs, so this is at once, or nearly)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    name = "vllm:request_success_total"
    while True:
        after = M.scrape(url)
        if not M.has(after, name) or M.total(after, name) - M.total(before, name) >= finished:
            return after, True
        if time.monotonic() > deadline:
            return after, False
        time.sleep(0.2)


def _measure_step(opts: RolloutOptions, data: TraceData, step: Step, url: str, i: int) -> dict[str, Any]:
    model, card = check_model(
        url, opts.model or (opts.launch.served_model_name if opts.launch else None), f"step {step.name}:"
    )
    limit = card.get("max_model_len")
    max_prompt = opts.max_prompt_tokens or (int(limit) - opts.max_tokens if limit else None)
    wopts = WorkloadOptions(
        block_tokens=opts.block_tokens or data.block_size,
        max_tokens=opts.max_tokens,
        max_prompt_tokens=max_prompt,
        token_range=opts.token_range,
        seed=opts.seed or 0,
    )
    if opts.warmup_requests:
        # The engine's first requests pay one-time costs (allocations, kernel set-up) that are no
        # tier's doing; their prompts share no block with the measured ones.
        warm = build_requests(data, wopts, salt=WARMUP_SALT)[: opts.warmup_requests]
        run_level(url, model, warm, "warmup", 1, progress=False)
    levels = []
    plan = [(str(c), c) for c in opts.concurrency] if opts.concurrency else [(TRACE_TIMING, None)]
    reqs = []
    for li, (name, conc) in enumerate(plan):
        # Each level's prompts have their own tokens (salt): every level replays the trace's reuse
        # from a cold start instead of hitting what the level before it left in the caches.
        reqs = build_requests(data, wopts, salt=li + 1)
        before = M.scrape(url)
        results, wall = run_level(
            url,
            model,
            reqs,
            name,
            conc,
            time_scale=opts.time_scale,
            progress=opts.progress,
            desc=f"{step.name} @{name}",
        )
        after, settled = _settle(url, before, sum(r.error is None for r in results))
        d = M.deltas(before, after)
        lv = level_report(name, conc, results, wall, {"deltas": d, "hit_quality": M.hit_quality(d)})
        lv["engine_counters_settled"] = settled
        levels.append(lv)
    info = M.engine_info(M.scrape(url))
    tiers = list(step.tiers)
    if step.endpoint is not None:
        # An endpoint's configuration is the user's: its tiers are those kvtier reports there.
        tiers += [t for t in ("cpu", "disk") if info["kvtier_capacity_blocks"].get(t, 0) > 0]
    return {
        "name": step.name,
        "index": i,
        "mode": "endpoint" if step.endpoint else "launched",
        "endpoint": step.endpoint,
        "model": model,
        "tiers": tiers,
        "kv_transfer_config": step.kv_transfer_config,
        "env": step.env,
        "block_tokens": wopts.block_tokens,
        "max_prompt_tokens": max_prompt,
        "prompts_cut": sum(r.cut for r in reqs),
        "engine_info": info,
        "levels": levels,
        # The same requests (block ids, lengths) at every level: one prediction for them all.
        "predicted": predict(reqs, wopts.block_tokens, info, step.kv_transfer_config) if opts.predict else None,
    }


def _run_step(opts: RolloutOptions, data: TraceData, step: Step, i: int, tmp: Path) -> dict[str, Any]:
    if step.endpoint is not None:
        return _measure_step(opts, data, step, step.endpoint, i)
    assert opts.launch is not None  # check_options
    srv = Launched(
        opts.launch.model,
        opts.launch.served_model_name,
        opts.launch.args,
        step.kv_transfer_config,
        step.env,
        tmp / f"server-{step.name}.log",
    )
    try:
        if opts.progress is not False and sys.stderr.isatty():
            print(f"step {step.name}: starting vllm serve on {srv.url}", file=sys.stderr)
        srv.wait_ready(step.name)
        out = _measure_step(opts, data, step, srv.url, i)
        out["launch_args"] = srv.args[1:]
        return out
    finally:
        srv.stop()


def run_rollout(opts: RolloutOptions) -> dict[str, Any]:
    data = check_options(opts)
    if opts.seed is None:
        opts = dataclasses.replace(opts, seed=secrets.randbelow(1 << 32))
    budgets = {"ttft_p99_s": opts.ttft_p99_s, "itl_p99_s": opts.itl_p99_s}
    out = Path(opts.out)
    with staged_dir(out) as tmp:
        steps = [_run_step(opts, data, step, i, tmp) for i, step in enumerate(opts.steps)]
        trace = {
            "path": data.path,
            "format": data.format,
            "block_size": data.block_size,
            "requests": data.n_requests,
            "skipped_records": data.skipped,
        }
        for s in steps:
            # The reference is the first step when it runs no kvtier tier (an endpoint's setup is
            # the user's to say: the first endpoint is taken as the baseline).
            baseline = s["index"] == 0 and s["kv_transfer_config"] is None
            s["verdict"] = verdict(s, budgets, is_baseline=baseline)
        report: dict[str, Any] = {
            "schema": SCHEMA_VERSION,
            "trace": trace,
            "budgets": budgets,
            "timing": "trace" if opts.concurrency is None else "concurrency",
            "concurrency": opts.concurrency,
            "time_scale": opts.time_scale,
            "max_tokens": opts.max_tokens,
            "token_range": list(opts.token_range),
            "seed": opts.seed,
            "steps": steps,
        }
        report["recommendation"] = recommended(steps)
        from kvtier_rs.rollout.plots import write_plots

        report["plots"] = write_plots(report, tmp)
        report["table"] = render_table(report)
        write_json(tmp / "report.json", report)
        (tmp / "table.txt").write_text(report["table"] + "\n")
    return report
