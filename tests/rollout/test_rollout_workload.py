"""Prompts synthesized from a trace share token prefixes exactly as the trace's block ids say,
on a real Mooncake trace slice and on the tests' own trace; and the rollback rule's verdicts."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.rollout import BLOCK_TOKENS, CHAINS, write_reuse_trace

from kvtier_rs.planner.traces import read_trace
from kvtier_rs.rollout.report import KEEP, OVER_BUDGET, ROLL_BACK, recommended, verdict
from kvtier_rs.rollout.workload import WorkloadOptions, build_requests, shared_prefix_blocks

# The shared traces stand beside the project wherever the tests run (CI too), as the planner's
# tests assume: a missing trace fails the test, never skips it.
MOONCAKE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def common_ids(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def check_sharing(data, reqs, bt: int) -> None:
    chains = [list(data.keys[data.offsets[r.index] : data.offsets[r.index + 1]])[: r.blocks] for r in reqs]
    for i in range(len(reqs)):
        for j in range(i + 1, len(reqs)):
            want = common_ids(chains[i], chains[j])
            got = shared_prefix_blocks(reqs[i], reqs[j], bt)
            # A prompt's last block may be partial: the blocks both hold whole are compared.
            whole = min(len(reqs[i].prompt), len(reqs[j].prompt)) // bt
            assert got == min(want, whole), (i, j, want, got)


def test_prompts_share_exactly_the_blocks_their_ids_share(tmp_path):
    data = read_trace(write_reuse_trace(tmp_path / "t.jsonl"))
    reqs = build_requests(data, WorkloadOptions(block_tokens=BLOCK_TOKENS, max_tokens=4))
    assert [len(r.prompt) for r in reqs] == [(len(c) - 1) * BLOCK_TOKENS + BLOCK_TOKENS // 2 for c in CHAINS]
    check_sharing(data, reqs, BLOCK_TOKENS)
    assert reqs[4].prompt == reqs[8].prompt  # the same chain twice: the same prompt
    assert all(100 <= t < 1000 for r in reqs for t in r.prompt)
    # Deterministic: the same trace and salt give the same tokens; another salt shares nothing.
    assert build_requests(data, WorkloadOptions(block_tokens=BLOCK_TOKENS, max_tokens=4))[0] == reqs[0]
    other = build_requests(data, WorkloadOptions(block_tokens=BLOCK_TOKENS, max_tokens=4), salt=7)
    assert all(shared_prefix_blocks(a, b, BLOCK_TOKENS) == 0 for a, b in zip(reqs, other, strict=True))


def test_a_mooncake_slice_keeps_its_prefix_sharing_under_a_prompt_limit():
    data = read_trace(MOONCAKE, limit=60)
    bt, limit = 16, 16 * 20
    reqs = build_requests(data, WorkloadOptions(block_tokens=bt, max_tokens=8, max_prompt_tokens=limit))
    assert len(reqs) == 60 and all(len(r.prompt) <= limit for r in reqs)
    check_sharing(data, reqs, bt)
    # The slice has reuse, so the check above compared some shared prefixes, not only zeros.
    assert any(shared_prefix_blocks(a, b, bt) > 0 for i, a in enumerate(reqs) for b in reqs[i + 1 :])


def level(conc, ttft_p99, itl_p99, failed=0):
    return {
        "concurrency": conc,
        "ttft_s": {"p99": ttft_p99},
        "itl_s": {"p99": itl_p99},
        "failed": failed,
        "requests": 10,
    }


def test_the_rollback_rule_names_the_budget_the_level_and_the_value():
    budgets = {"ttft_p99_s": 0.5, "itl_p99_s": 0.05}
    base = {"name": "baseline", "levels": [level(1, 0.1, 0.01), level(4, 0.2, 0.02)], "verdict": None}
    cpu = {"name": "cpu", "levels": [level(1, 0.08, 0.01), level(4, 0.3, 0.02)], "verdict": None}
    disk = {"name": "disk", "levels": [level(1, 0.09, 0.01), level(4, 0.7, 0.02)], "verdict": None}
    base["verdict"] = verdict(base, budgets, is_baseline=True)
    cpu["verdict"] = verdict(cpu, budgets, is_baseline=False)
    disk["verdict"] = verdict(disk, budgets, is_baseline=False)
    assert base["verdict"]["decision"] == KEEP and cpu["verdict"]["decision"] == KEEP
    assert disk["verdict"]["decision"] == ROLL_BACK
    assert disk["verdict"]["reasons"] == ["p99 TTFT 700.0 ms over the budget --ttft-p99 500.0 ms at concurrency 4"]
    assert recommended([base, cpu, disk]) == "cpu"
    slow_base = {"name": "baseline", "levels": [level(1, 0.1, 0.09)]}
    v = verdict(slow_base, budgets, is_baseline=True)
    assert v["decision"] == OVER_BUDGET and "--itl-p99 50.0 ms" in v["reasons"][0]
    failing = {"name": "cpu", "levels": [level(1, 0.1, 0.01, failed=2)]}
    assert verdict(failing, budgets, is_baseline=False)["reasons"] == ["2 of 10 requests failed at concurrency 1"]
    assert verdict(cpu, {"ttft_p99_s": None, "itl_p99_s": None}, is_baseline=False) is None


def test_the_prediction_replays_what_was_sent_with_the_engines_sizes(tmp_path):
    from kvtier_rs.rollout.predict import predict

    data = read_trace(write_reuse_trace(tmp_path / "t.jsonl"))
    reqs = build_requests(data, WorkloadOptions(block_tokens=BLOCK_TOKENS, max_tokens=4))
    # vLLM's GPU cache of 8 blocks of 32 tokens; kvtier's CPU tier of 64 chunks of 32.
    engine = {"cache_config": {"block_size": "32", "num_gpu_blocks": "8"}, "kvtier_capacity_blocks": {"cpu": 64.0}}
    p = predict(reqs, BLOCK_TOKENS, engine, None)
    assert p["capacity_blocks"] == {"gpu": 8, "cpu": 64} and p["note"] is None
    shares = p["shares"]
    assert sum(shares.values()) == pytest.approx(1.0)
    # Requests 5-9 come back to chains the GPU cache lost: a CPU tier that holds everything serves them.
    assert shares["cpu"] > 0 and shares["disk"] == 0
    gpu_only = predict(reqs, BLOCK_TOKENS, {**engine, "kvtier_capacity_blocks": {}}, None)["shares"]
    assert gpu_only["cpu"] == 0 and gpu_only["recomputed"] > shares["recomputed"]
    # Cut to two blocks each, the prompts share only their first two ids: less to hit.
    cut = build_requests(data, WorkloadOptions(block_tokens=BLOCK_TOKENS, max_tokens=4, max_prompt_tokens=64))
    assert all(r.cut and r.blocks == 2 and len(r.prompt) == 64 for r in cut)
    assert predict(cut, BLOCK_TOKENS, engine, None)["shares"] != shares
    no_size = predict(reqs, BLOCK_TOKENS, {"kvtier_capacity_blocks": {}}, None)
    assert no_size["shares"] is None and "cache_config_info" in no_size["note"]
