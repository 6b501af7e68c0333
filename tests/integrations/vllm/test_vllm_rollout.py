"""`kvtier rollout` against real `vllm serve` processes of the tiny model on CPU, run as users run
it (the `kvtier` CLI in a process of its own).

Endpoint mode: a GPU-only server and a server with kvtier's CPU tier, started here, measured as
the baseline and +cpu steps at two concurrency levels; the report's hit quality is held against
the engine's own counters, scraped by the test, and against what each response's usage said.
Launcher mode: the rollout starts a +disk step's server itself, with the disk tier's first reads
slowed by the fault injection in its environment; the request that waits on them puts p99 TTFT
over the budget, and the step is rolled back naming it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support import child_env
from support.rollout import BLOCK_TOKENS, write_reuse_trace
from support.vllm import engine as E
from support.vllm.server import Server, metric

from kvtier_rs.tiers.disk import FAULT_ENV

E.require_vllm()  # fail, never skip: CI installs vLLM

K = "vllm:kv_offload_kvtier_"
MAX_TOKENS = 4
#: The fault: the disk tier's first two reads each take this long.
READ_DELAY_MS = 5000
#: The launcher step's TTFT budget: far above a tiny model's TTFT on a busy CPU, far below a
#: request that waited on a delayed read.
TTFT_BUDGET = "2500ms"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-rollout")
    return {
        "tmp": tmp,
        "model": E.tiny_model(tmp_path_factory.getbasetemp()),
        "trace": write_reuse_trace(tmp / "trace.jsonl"),
    }


def server_env(env) -> dict[str, str]:
    out = child_env()
    out.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    out.update(CUDA_VISIBLE_DEVICES="", VLLM_CACHE_ROOT=str(env["tmp"] / "vllm-cache"), TMPDIR=str(env["tmp"]))
    return out


def kvtier(cpu_chunks: int, **extra) -> dict:
    cfg = {
        "spec_name": "KvtierOffloadingSpec",
        "spec_module_path": "kvtier_rs.integrations.vllm",
        "cpu_bytes_to_use": cpu_chunks * E.BLOCK_BYTES,
        **extra,
    }
    return {
        "kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier_rs.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": cfg,
    }


@pytest.fixture(scope="module")
def servers(env):
    """A GPU-only server and one with a CPU tier that holds the whole trace; two sequences at
    once, so that concurrency 2 runs two."""
    started = []
    try:
        for name, cfg in (("baseline", None), ("cpu", kvtier(64))):
            started.append(Server(env["model"], env["tmp"] / name, kv_transfer_config=cfg, max_num_seqs=2))
        for srv in started:
            srv.wait_ready()
        yield dict(zip(("baseline", "cpu"), started, strict=True))
    finally:
        for srv in started:
            srv.stop()


def kvtier_cli(env, *args: str, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kvtier_rs.cli", "rollout", "--trace", str(env["trace"]), *args]
    return subprocess.run(
        cmd, env={**server_env(env), **(extra_env or {})}, capture_output=True, text=True, timeout=1800, check=False
    )


def test_endpoint_mode_reports_hit_quality_that_matches_the_engines_counters(env, servers):
    base, cpu = servers["baseline"], servers["cpu"]
    before = cpu.metrics()
    out = env["tmp"] / "endpoint-run"
    # The budgets are generous: this test checks the measurements, not the machine's speed.
    r = kvtier_cli(
        env,
        "--endpoint",
        f"baseline={base.url}",
        "--endpoint",
        f"cpu={cpu.url}",
        "--block-tokens",
        str(BLOCK_TOKENS),
        "--max-tokens",
        str(MAX_TOKENS),
        "--concurrency",
        "1,2",
        "--ttft-p99",
        "120s",
        "--itl-p99",
        "120s",
        "--out",
        str(out),
        "--no-progress",
    )
    assert r.returncode == 0, r.stderr
    after = cpu.metrics()
    report = json.loads((out / "report.json").read_text())
    assert report["schema"] == "kvtier.rollout/1"
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["report.json", "table.txt", "latency_cdf.png", "p99_vs_concurrency.png", "hit_quality.png"]
    )
    assert "baseline" in r.stdout and "recommended: cpu" in r.stdout, r.stdout
    steps = {s["name"]: s for s in report["steps"]}
    assert [lv["level"] for lv in steps["cpu"]["levels"]] == ["1", "2"]
    assert steps["baseline"]["tiers"] == ["gpu"] and steps["cpu"]["tiers"] == ["gpu", "cpu"]
    for step in steps.values():
        for lv in step["levels"]:
            assert lv["failed"] == 0 and lv["requests"] == 10, lv["errors"]
            assert lv["prompt_tokens_as_sent"] and lv["engine_counters_settled"]
            assert lv["ttft_s"]["count"] == 10 and lv["itl_s"]["count"] == 10 * (MAX_TOKENS - 1)
            hq = lv["hit_quality"]
            # Two sources agree: every response's usage (cached prompt tokens) and the engine's
            # counters (its prefix-cache hits plus what the connector loaded).
            assert lv["client_cached_tokens"] == hq["tokens"]["gpu"] + hq["tokens"]["cpu"] + hq["tokens"]["disk"]
            assert hq["prompt_tokens"] == lv["prompt_tokens"]
            if lv["concurrency"] == 1:  # request 1 reuses request 0's 4 blocks, computed before it
                assert hq["tokens"]["gpu"] >= 4 * BLOCK_TOKENS
        assert step["predicted"]["shares"] is not None, step["predicted"]
        assert step["verdict"]["decision"] == "keep", step["verdict"]
    # The baseline has no kvtier series: nothing came from a CPU tier, and it says so.
    for lv in steps["baseline"]["levels"]:
        assert lv["engine"]["kvtier_loads_cpu"] is None and lv["hit_quality"]["tokens"]["cpu"] == 0
    # +cpu: prefixes pushed out of the GPU cache come back from the CPU tier, and the report's
    # promotions are exactly what the engine counted over the run (the warm-up loads nothing).
    loads = metric(after, K + "loads_cpu_total") - metric(before, K + "loads_cpu_total")
    external = metric(after, "vllm:external_prefix_cache_hits_total") - metric(
        before, "vllm:external_prefix_cache_hits_total"
    )
    levels = steps["cpu"]["levels"]
    assert loads > 0 and sum(lv["hit_quality"]["chunks"]["cpu"] for lv in levels) == loads
    assert sum(lv["hit_quality"]["tokens"]["cpu"] for lv in levels) == external == loads * BLOCK_TOKENS
    assert all(lv["hit_quality"]["tokens"]["disk"] == 0 for lv in levels)
    # The same requests recompute less with the CPU tier than without it.
    recomputed = {n: sum(lv["hit_quality"]["tokens"]["recomputed"] for lv in steps[n]["levels"]) for n in steps}
    assert recomputed["cpu"] < recomputed["baseline"], recomputed


def test_trace_timing_sends_each_request_at_its_scaled_arrival(env, servers):
    out = env["tmp"] / "trace-timing"
    r = kvtier_cli(
        env,
        "--endpoint",
        servers["cpu"].url,
        "--block-tokens",
        str(BLOCK_TOKENS),
        "--max-tokens",
        str(MAX_TOKENS),
        "--concurrency",
        "trace",
        "--time-scale",
        "0.5",
        "--seed",
        "7",
        "--no-predict",
        "--format",
        "json",
        "--out",
        str(out),
        "--no-progress",
    )
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["timing"] == "trace" and report["recommendation"] is None and report["seed"] == 7
    (step,) = report["steps"]
    assert step["verdict"] is None and step["predicted"] is None  # no budget, --no-predict
    (lv,) = step["levels"]
    assert lv["level"] == "trace" and lv["concurrency"] is None and lv["failed"] == 0
    # The trace's records are 100 ms apart, halved: no request leaves before its arrival time
    # (asyncio's timer may fire up to its clock resolution early).
    sent = {q["index"]: q["sent_s"] for q in lv["per_request"]}
    assert sorted(sent) == list(range(10))
    assert all(sent[i] >= i * 0.05 - 0.01 for i in sent), sent


def test_a_model_the_real_endpoint_does_not_serve_is_refused(env, servers):
    out = env["tmp"] / "wrong-model"
    r = kvtier_cli(env, "--endpoint", servers["baseline"].url, "--model", "llama-70b", "--out", str(out))
    assert r.returncode == 2 and not out.exists()
    assert r.stderr.strip() == (
        f"kvtier rollout: error: --model llama-70b: {servers['baseline'].url} does not serve it (it serves tiny)"
    )


def test_launcher_mode_rolls_back_a_disk_step_slowed_past_the_ttft_budget(env):
    """The rollout starts `vllm serve` for a +disk step itself (a CPU tier of four chunks, so the
    trace's returning prefixes come from disk), with KVTIER_DISK_FAULT in that step's
    environment only, and stops it afterwards."""
    out = env["tmp"] / "launch-run"
    step = {
        "name": "disk",
        "cpu": 4 * E.BLOCK_BYTES,
        "disk": "64MiB",
        "disk_root": str(env["tmp"] / "disk"),
        "env": {FAULT_ENV: f"read_delay_ms:{READ_DELAY_MS}*2"},
    }
    engine_args = [
        "--skip-tokenizer-init",
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "256",
        "--block-size",
        str(E.BLOCK),
        "--max-num-seqs",
        "1",
        "--seed",
        "0",
        "--kv-cache-memory-bytes",
        str(16 * E.BLOCK_BYTES),
    ]
    cfg = env["tmp"] / "rollout.json"
    cfg.write_text(json.dumps({"launch": {"model": env["model"], "args": engine_args}, "steps": [step]}))
    r = kvtier_cli(
        env,
        "--config",
        str(cfg),
        "--block-tokens",
        str(BLOCK_TOKENS),
        "--max-tokens",
        str(MAX_TOKENS),
        "--ttft-p99",
        TTFT_BUDGET,
        "--out",
        str(out),
        "--no-progress",
    )
    assert r.returncode == 0, r.stderr
    report = json.loads((out / "report.json").read_text())
    (s,) = report["steps"]
    assert s["mode"] == "launched" and s["tiers"] == ["gpu", "cpu", "disk"]
    assert s["env"] == {FAULT_ENV: f"read_delay_ms:{READ_DELAY_MS}*2"}
    (lv,) = s["levels"]
    assert lv["failed"] == 0, lv["errors"]
    # Prefixes were promoted from disk, and a request waited on a delayed read: the fault, not
    # the machine's speed, is what the budget caught.
    assert lv["hit_quality"]["chunks"]["disk"] > 0, lv["hit_quality"]
    assert lv["ttft_s"]["max"] >= READ_DELAY_MS / 1000
    v = s["verdict"]
    assert v["decision"] == "roll_back", v
    assert len(v["reasons"]) == 1 and "p99 TTFT" in v["reasons"][0] and "--ttft-p99 2.50 s" in v["reasons"][0], v
    assert report["recommendation"] is None
    assert "disk: roll back: p99 TTFT" in r.stdout
    # The server was stopped: its log is in the output, and it ended with the rollout.
    log = (out / "server-disk.log").read_text()
    assert "Application startup complete" in log
