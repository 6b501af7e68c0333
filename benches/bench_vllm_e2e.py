"""End to end on a real vLLM engine (vLLM's CPU platform): time to first token and throughput
with no offloading, with vLLM's tiering spec and its ``fs`` file tier, and with kvtier (CPU tier
+ disk tier), on a multi-turn workload with reuse and on the same shapes with zero reuse.

* Model: a small random Llama built here (4 layers, hidden 512, head 64, fp32), so a prefill
  costs tens of milliseconds on a CPU and reuse has something to save. No download.
* Multi-turn: ``--sessions`` conversations in round robin, ``--turns`` turns each; a turn's
  prompt is the whole conversation so far plus new user tokens. The engine's own cache is small
  (``--gpu-blocks``), so by the time a session comes back its prefix has been evicted from the
  engine and only an offload tier can serve it.
* Zero reuse: the same prompt lengths (``--zero-repeat`` times as many requests, so one
  measurement lasts several seconds), every prompt unique. Tiering
  cannot help here; it can only cost. kvtier's bar: at most 2% over no offloading. Measured for
  kvtier with its disk tier and with its CPU tier alone (``kvtier_cpu``), so the cost of the
  disk tier's background writes shows separately. A repetition's wall-clock ratio scatters by
  10-25% on a shared VM, more than the bar; so one more run of each kvtier config goes under a
  sampling profiler (py-spy, ``benches/attribution.py``), which reports kvtier's and vLLM's
  connector hooks' share of the engine thread and the CPU of kvtier's own native threads: shares
  within one run that the machine's noise does not move.
* vLLM's tiering spec refuses vLLM's CPU platform in its worker (``get_worker`` raises), so the
  "vLLM fs" row runs vLLM's tiering manager, primary tier and ``fs`` tier with kvtier's worker
  (``KvtierTieringOffloadingSpec``, which differs from vLLM's spec in ``get_worker`` only).
* TTFT is vLLM's own per-request ``first_token_latency``; throughput is (prompt + generated)
  tokens over the wall time of the whole workload. Requests run one at a time
  (``max_num_seqs=1``), so each TTFT is a prefill, not queueing.

Under ``vllm serve`` (``--serve``): each config is a `vllm serve` in its default multiprocess
mode (tests/support/vllm/server.py), loaded over HTTP by the OpenAI client (benches/serve_load.py:
``--serve-sessions`` conversations of ``--turns`` turns, ``--concurrency`` requests in flight),
the reuse workload and then the zero-reuse one on the same server. TTFT p50/p95/p99 is the
client's (request sent to first streamed token, queueing included) and throughput is tokens over
the workload's wall time; kvtier (under ``KvtierConnector``) against no offloading and against
vLLM's CPU tier (``vllm_cpu``: vLLM's tiering manager and CPU tier policy, kvtier's worker, as
above), every config once per ``--serve-reps``, in a rotating order.

Usage: python benches/bench_vllm_e2e.py [--json] [--sessions 4] [--turns 4] [--reps 3]
       python benches/bench_vllm_e2e.py --serve [--serve-sessions 8] [--concurrency 2] [--serve-reps 1]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import attribution  # noqa: E402 - benches/attribution.py
import serve_load  # noqa: E402 - benches/serve_load.py
from support.vllm import engine as E  # noqa: E402 - the tests' engine helpers
from support.vllm.server import Server  # noqa: E402 - `vllm serve` as the tests start it

BLOCK = 32
LAYERS, HIDDEN, HEADS, KV_HEADS = 4, 512, 8, 2
HEAD = HIDDEN // HEADS
BLOCK_BYTES = LAYERS * KV_HEADS * BLOCK * 2 * HEAD * 4  # fp32 K+V per engine block
GEN = 8  # generated tokens per turn


def build_model(out: Path) -> str:
    stamp = out / ".kvtier-bench-llama-v1"
    if stamp.exists():
        return str(out)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=1000,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=4096,
        torch_dtype="float32",
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    stamp.touch()
    return str(out)


def multi_turn(sessions: int, turns: int, first: int, per_turn: int, seed: int) -> list[tuple[int, int]]:
    """(session, new user tokens) in round-robin order."""
    return [(s, first if t == 0 else per_turn) for t in range(turns) for s in range(sessions)]


def run_workload(llm: Any, plan: list[tuple[int, int]], reuse: bool, seed: int) -> dict[str, float]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    r = random.Random(seed)
    history: dict[int, list[int]] = {}
    sp = SamplingParams(temperature=0.0, max_tokens=GEN, ignore_eos=True)
    ttft, cached, tokens = [], 0, 0
    t0 = time.perf_counter()
    for session, new in plan:
        fresh = [r.randrange(3, 1000) for _ in range(new)]
        if reuse:
            prompt = history.get(session, []) + fresh
        else:
            # Same length as the reuse prompt would have, but nothing shared with anything.
            prompt = [r.randrange(3, 1000) for _ in range(len(history.get(session, [])))] + fresh
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0]
        gen = list(out.outputs[0].token_ids)
        history[session] = prompt + gen
        ttft.append(out.metrics.first_token_latency)
        cached += int(out.num_cached_tokens or 0)
        tokens += len(prompt) + len(gen)
    wall = time.perf_counter() - t0
    return {
        "ttft_mean_ms": 1e3 * statistics.fmean(ttft),
        "ttft_p50_ms": 1e3 * statistics.median(ttft),
        "tokens_per_s": tokens / wall,
        "wall_s": wall,
        "cached_tokens": cached,
        "prompt_tokens": tokens - GEN * len(plan),
    }


def extra_configs(tmp: Path, cpu_chunks: int) -> dict[str, dict[str, Any] | None]:
    """Each config's kv_connector_extra_config (None: no offloading)."""
    cpu = cpu_chunks * BLOCK_BYTES
    module = "kvtier_rs.integrations.vllm"
    tiering = {"spec_name": "KvtierTieringOffloadingSpec", "spec_module_path": module, "cpu_bytes_to_use": cpu}
    kvtier = {"spec_name": "KvtierOffloadingSpec", "spec_module_path": module, "cpu_bytes_to_use": cpu}
    return {
        "none": None,
        # vLLM's CPU tier (its manager and policy; kvtier's worker copies, see the docstring).
        "vllm_cpu": tiering,
        "vllm_fs": {**tiering, "secondary_tiers": [{"type": "fs", "root_dir": str(tmp / "fs")}]},
        "kvtier": {**kvtier, "disk_root": str(tmp / "kvtier"), "disk_bytes": "1GiB"},
        # The CPU tier alone: separates the disk tier's background writes from the rest.
        "kvtier_cpu": kvtier,
    }


def configs(tmp: Path, cpu_chunks: int) -> dict[str, Any]:
    """The in-process configs (KVTransferConfig objects): all but vLLM's CPU tier alone."""
    return {
        name: None if extra is None else E.offloading_config(extra)
        for name, extra in extra_configs(tmp, cpu_chunks).items()
        if name != "vllm_cpu"
    }


def one(model: str, cfg: Any, gpu_blocks: int, plan, reuse: bool, seed: int, end_hook=None) -> dict[str, float]:  # noqa: PLR0917 - one run's settings
    llm = E.make_llm(
        model,
        cfg,
        gpu_blocks=gpu_blocks,
        # vLLM wants one max-length request to fit in its cache (less a few blocks of slack).
        max_model_len=(gpu_blocks - 3) * BLOCK,
        disable_log_stats=False,
        kv_cache_memory_bytes=gpu_blocks * BLOCK_BYTES,
    )
    try:
        # Warm-up (kernels, allocator) on prompts no workload uses.
        run_workload(llm, [(99, 64)], reuse=False, seed=10_000 + seed)
        result = run_workload(llm, plan, reuse, seed)
        if end_hook is not None:
            end_hook()
        return result
    finally:
        E.shutdown(llm)
        gc.collect()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print the results as JSON only")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first", type=int, default=256, help="tokens of a session's first prompt")
    ap.add_argument("--per-turn", type=int, default=64, help="new user tokens per later turn")
    ap.add_argument("--gpu-blocks", type=int, default=24, help="engine KV cache, in blocks of 32 tokens")
    ap.add_argument("--cpu-chunks", type=int, default=256, help="CPU tier size, in chunks (blocks)")
    ap.add_argument(
        "--zero-repeat", type=int, default=4, help="the zero-reuse workload is the multi-turn shapes this many times"
    )
    ap.add_argument("--reps", type=int, default=3, help="zero-reuse repetitions of each config (interleaved)")
    ap.add_argument(
        "--no-attribution",
        action="store_true",
        help="skip the zero-reuse runs under py-spy that attribute the engine thread's time",
    )
    ap.add_argument("--serve", action="store_true", help="measure under `vllm serve` over HTTP instead")
    ap.add_argument("--serve-sessions", type=int, default=8, help="conversations under --serve")
    ap.add_argument("--concurrency", type=int, default=2, help="requests in flight under --serve")
    ap.add_argument("--serve-gpu-blocks", type=int, default=40, help="engine KV cache under --serve, in blocks")
    ap.add_argument("--serve-reps", type=int, default=1, help="repetitions of every config under --serve")
    a = ap.parse_args()

    # Every config preallocates its disk tier (1 GiB): the whole directory goes when the run
    # ends, however it ends, and each zero-reuse repetition's tiers as soon as it is done.
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-bench-e2e-"))
    try:
        results = measure_serve(a, tmp) if a.serve else measure(a, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    (report_serve if a.serve else report)(a, results)


def measure(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    E.prepare_env(tmp)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    model = build_model(tmp / "model")
    plan = multi_turn(a.sessions, a.turns, a.first, a.per_turn, 0)
    results: dict[str, Any] = {"reuse": {}, "zero_reuse": {}}
    for name, cfg in configs(tmp, a.cpu_chunks).items():
        results["reuse"][name] = one(model, cfg, a.gpu_blocks, plan, True, 1)
    # Zero reuse: no offloading vs kvtier, interleaved so that drift on a shared machine hits
    # both alike, in a rotating order (no config always runs first); vLLM fs once. The overhead
    # is the median over repetitions of each repetition's own ratio (paired: slow drift cancels).
    runs: dict[str, list[dict[str, float]]] = {"none": [], "kvtier": [], "vllm_fs": [], "kvtier_cpu": []}
    # The same shapes, `zero_repeat` times over (fresh sessions): a longer run per measurement.
    zero_plan = [(k * a.sessions + s, n) for k in range(a.zero_repeat) for s, n in plan]
    for rep in range(a.reps):
        cfgs = configs(tmp / f"z{rep}", a.cpu_chunks)
        order = ["none", "kvtier", "kvtier_cpu"]
        order = order[rep % 3 :] + order[: rep % 3] + (["vllm_fs"] if rep == 0 else [])
        for name in order:
            runs[name].append(one(model, cfgs[name], a.gpu_blocks, zero_plan, False, 100 + rep))
        shutil.rmtree(tmp / f"z{rep}", ignore_errors=True)
    for name, rs in runs.items():
        results["zero_reuse"][name] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
    if not a.no_attribution:
        # One more zero-reuse run of each kvtier config under a sampling profiler: its share of
        # the engine thread does not move with this VM's noise the way a wall-clock ratio does.
        cfgs = configs(tmp / "attr", a.cpu_chunks)
        for name in ("kvtier", "kvtier_cpu"):
            shares = attribution.profile(
                lambda mark, name=name: one(model, cfgs[name], a.gpu_blocks, zero_plan, False, 200, end_hook=mark)
            )
            if shares is not None:
                results[f"zero_reuse_{name}_attribution"] = shares.__dict__
        shutil.rmtree(tmp / "attr", ignore_errors=True)
    for name in ("kvtier", "kvtier_cpu"):
        pairs = list(zip(runs["none"], runs[name], strict=True))
        results[f"zero_reuse_{name}_overhead_pct"] = {
            "ttft": statistics.median(100 * (t["ttft_mean_ms"] / n["ttft_mean_ms"] - 1) for n, t in pairs),
            "throughput": statistics.median(100 * (n["tokens_per_s"] / t["tokens_per_s"] - 1) for n, t in pairs),
            "throughput_per_rep": [round(100 * (n["tokens_per_s"] / t["tokens_per_s"] - 1), 1) for n, t in pairs],
        }
    return results


SERVE_ORDER = ("none", "vllm_cpu", "vllm_fs", "kvtier", "kvtier_cpu")


def serve_config(extra: dict[str, Any] | None) -> dict[str, Any] | None:
    """The --kv-transfer-config JSON of a config: kvtier's spec under KvtierConnector, vLLM's
    tiering spec under vLLM's OffloadingConnector."""
    if extra is None:
        return None
    cfg: dict[str, Any] = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
    cfg["kv_connector_extra_config"] = extra
    if extra["spec_name"] == "KvtierOffloadingSpec":
        cfg.update(kv_connector="KvtierConnector", kv_connector_module_path="kvtier_rs.integrations.vllm")
    return cfg


def measure_serve(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    model = build_model(tmp / "model")
    conversations = [[a.first] + [a.per_turn] * (a.turns - 1) for _ in range(a.serve_sessions)]
    longest = a.first + (a.turns - 1) * (a.per_turn + GEN) + GEN
    max_model_len = BLOCK * -(-longest // BLOCK)
    runs: dict[str, dict[str, list[dict[str, float]]]] = {n: {"reuse": [], "zero_reuse": []} for n in SERVE_ORDER}
    for rep in range(a.serve_reps):
        order = SERVE_ORDER[rep % len(SERVE_ORDER) :] + SERVE_ORDER[: rep % len(SERVE_ORDER)]
        for name in order:
            work = tmp / f"serve{rep}-{name}"
            srv = Server(
                model,
                work,
                kv_transfer_config=serve_config(extra_configs(work, a.cpu_chunks)[name]),
                gpu_blocks=a.serve_gpu_blocks,
                block_bytes=BLOCK_BYTES,
                max_model_len=max_model_len,
                max_num_seqs=a.concurrency,
                extra_env={"VLLM_LOGGING_LEVEL": "WARNING"},
            ).wait_ready()
            try:
                kw = {"concurrency": a.concurrency, "gen": GEN}
                serve_load.run(srv.url, [[64]], reuse=False, seed=10_000 + rep, **kw)  # warm-up
                runs[name]["reuse"].append(serve_load.run(srv.url, conversations, reuse=True, seed=rep, **kw))
                runs[name]["zero_reuse"].append(
                    serve_load.run(srv.url, conversations, reuse=False, seed=1_000 + rep, **kw)
                )
            finally:
                srv.stop()
                shutil.rmtree(work, ignore_errors=True)
    results: dict[str, Any] = {"serve": {}}
    for name, by_workload in runs.items():
        results["serve"][name] = {
            wl: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for wl, rs in by_workload.items()
        }
    return results


def report_serve(a: argparse.Namespace, results: dict[str, Any]) -> None:
    if a.json:
        print(json.dumps(results))
        return
    r = results["serve"]
    print(
        f"vllm serve, model {LAYERS} layers hidden {HIDDEN} fp32; {a.serve_sessions} conversations x {a.turns} turns, "
        f"{a.concurrency} in flight; engine cache {a.serve_gpu_blocks} blocks; CPU tier {a.cpu_chunks} chunks; "
        f"medians of {a.serve_reps} rep(s)"
    )
    print(f"{'workload':11} {'config':10} {'TTFT p50':>9} {'p95':>8} {'p99':>8} {'tok/s':>7} {'cached':>7}")
    for wl in ("reuse", "zero_reuse"):
        for name in SERVE_ORDER:
            x = r[name][wl]
            print(
                f"{wl:11} {name:10} {x['ttft_p50_ms']:7.1f}ms {x['ttft_p95_ms']:6.1f}ms {x['ttft_p99_ms']:6.1f}ms "
                f"{x['tokens_per_s']:7.0f} {100 * x['cached_share']:6.1f}%"
            )
    for wl in ("reuse", "zero_reuse"):
        for base in ("none", "vllm_cpu"):
            k, b = r["kvtier"][wl], r[base][wl]
            print(
                f"{wl}, kvtier vs {base}: TTFT p50 {b['ttft_p50_ms'] / k['ttft_p50_ms']:.2f}x, "
                f"p99 {b['ttft_p99_ms'] / k['ttft_p99_ms']:.2f}x lower; "
                f"throughput {k['tokens_per_s'] / b['tokens_per_s']:.2f}x"
            )


def report(a: argparse.Namespace, results: dict[str, Any]) -> None:
    if a.json:
        print(json.dumps(results))
        return
    print(
        f"model {LAYERS} layers hidden {HIDDEN} fp32; {a.sessions} sessions x {a.turns} turns; "
        f"engine cache {a.gpu_blocks} blocks; CPU tier {a.cpu_chunks} chunks"
    )
    print(f"{'workload':11} {'config':10} {'TTFT mean':>10} {'TTFT p50':>9} {'tok/s':>8} {'cached':>7}")
    for wl in ("reuse", "zero_reuse"):
        for name, r in results[wl].items():
            print(
                f"{wl:11} {name:10} {r['ttft_mean_ms']:8.1f}ms {r['ttft_p50_ms']:7.1f}ms "
                f"{r['tokens_per_s']:8.0f} {int(r['cached_tokens']):7d}"
            )
    for name in ("kvtier", "kvtier_cpu"):
        o = results[f"zero_reuse_{name}_overhead_pct"]
        print(
            f"zero reuse, {name} over none (median of paired reps): TTFT {o['ttft']:+.1f}%, "
            f"throughput cost {o['throughput']:+.1f}% (bar: <= 2%); per rep {o['throughput_per_rep']}"
        )
        if f"zero_reuse_{name}_attribution" in results:
            shares = attribution.Shares(**results[f"zero_reuse_{name}_attribution"])
            print(f"zero reuse, {name}, sampled: {shares.line()}")


if __name__ == "__main__":
    main()
