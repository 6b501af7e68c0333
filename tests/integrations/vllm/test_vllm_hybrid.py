"""A hybrid-attention model (a sliding-window layer and a full-attention layer: two KV-cache
groups) through kvtier on a real vLLM engine (vLLM's CPU platform), greedy tokens compared with
an engine without offloading: CPU-tier hits, disk-tier hits, and a negative control."""

from __future__ import annotations

import pytest
from support.vllm import engine as E
from support.vllm.make_tiny_model import build_tiny_hybrid

E.require_vllm()  # fail, never skip: CI installs vLLM

#: Longer than the 64-token window: the sliding layer's early blocks fall out of its window.
PROMPT_LEN = 200
#: One block of one group: 1 KV head x 32 tokens x K and V x 64 x fp32.
GROUP_BLOCK_BYTES = 32 * 2 * 64 * 4


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    env = E.module_env(tmp_path_factory, "vllm-hybrid")
    env["model"] = str(build_tiny_hybrid(tmp_path_factory.getbasetemp() / "tiny-hybrid"))
    return env


@pytest.fixture(scope="module")
def prompts():
    return {name: E.prompt(seed, PROMPT_LEN) for seed, name in enumerate("ABCD", start=31)}


def make_llm(env, cfg=None):
    return E.make_llm(env["model"], cfg, kv_cache_memory_bytes=64 * GROUP_BLOCK_BYTES * 2)


@pytest.fixture(scope="module")
def baseline(env, prompts):
    llm = make_llm(env)
    try:
        groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
        assert len(groups) == 2, "the model must give vLLM two KV-cache groups"
        out = {}
        for name, ids in prompts.items():
            tokens, cached = E.generate(llm, ids)
            assert cached == 0
            out[name] = tokens
        assert len({tuple(t) for t in out.values()}) == len(out), "greedy tokens must tell prompts apart"
        return out
    finally:
        E.shutdown(llm)


def counters(llm):
    from kvtier_rs.integrations.vllm.spec import engine_state

    st = engine_state(E.engine_id(llm))
    assert st is not None and st.manager is not None
    return st.manager


def test_cpu_tier_hits_of_both_groups_match_the_baseline(env, prompts, baseline):
    llm = make_llm(env, E.kvtier_config(cpu_bytes_to_use="16MiB"))
    try:
        tokens, cached = E.generate(llm, prompts["A"])
        assert (tokens, cached) == (baseline["A"], 0)
        E.drop_gpu_cache(llm)
        tokens, cached = E.generate(llm, prompts["A"])
        assert tokens == baseline["A"]
        assert cached == 192, cached  # the prompt's 6 full blocks, from the CPU tier
        assert counters(llm).counters.loads_cpu > 0
    finally:
        E.shutdown(llm)


def test_disk_tier_hits_of_both_groups_match_the_baseline(env, prompts, baseline):
    # A CPU tier of 12 chunks (a chunk: one block of one group): B..D's stores evict A's.
    cfg = E.kvtier_config(
        cpu_bytes_to_use=12 * GROUP_BLOCK_BYTES, disk_root=str(env["disk"]), disk_bytes_to_use="16MiB"
    )
    llm = make_llm(env, cfg)
    try:
        mgr = counters(llm)
        for name in "ABCD":
            tokens, _ = E.generate(llm, prompts[name])
            assert tokens == baseline[name], name
            mgr.lower.layer("disk").drain()
        assert mgr.cpu_index.stats()["evictions"] > 0
        E.drop_gpu_cache(llm)
        for name in "AB":
            tokens, cached = E.generate(llm, prompts[name])
            assert tokens == baseline[name], name
            assert cached == 192, (name, cached, mgr.snapshot())
        assert mgr.counters.loads_disk > 0, mgr.snapshot()
    finally:
        E.shutdown(llm)


def test_negative_control_wrong_bytes_change_the_hybrid_models_tokens(env, prompts, baseline):
    cfg = E.offloading_config(
        {"spec_name": "WrongBytesSpec", "spec_module_path": "support.vllm.faulty", "cpu_bytes_to_use": "16MiB"}
    )
    llm = make_llm(env, cfg)
    try:
        E.generate(llm, prompts["A"])
        E.drop_gpu_cache(llm)
        tokens, cached = E.generate(llm, prompts["A"])
        assert cached == 192
        assert tokens != baseline["A"], "wrong KV went unnoticed: the comparison proves nothing"
    finally:
        E.shutdown(llm)
