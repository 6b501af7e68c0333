"""kvtier as vLLM's offloading backend, on a real vLLM engine (vLLM's CPU platform).

Every case compares greedy tokens with a run without offloading, and uses kvtier's own
counters to prove which tier served the prefix. The tests in this module run in order and share
one disk directory: CPU tier -> disk tier -> restart -> corruption.
"""

from __future__ import annotations

import pytest
from support.vllm import engine as E

E.require_vllm()  # fail, never skip: CI installs vLLM

PROMPT_LEN = E.PROMPT_LEN
SERVED = E.SERVED
CHUNK = E.BLOCK_BYTES  # one chunk = one engine block of the 2-layer model


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return E.module_env(tmp_path_factory, "vllm-e2e")


@pytest.fixture(scope="module")
def prompts():
    return {name: E.prompt(seed, PROMPT_LEN) for seed, name in enumerate("ABCD", start=1)}


@pytest.fixture(scope="module")
def baseline(env, prompts):
    """Greedy tokens of each prompt from an engine without any connector."""
    llm = E.make_llm(env["model"])
    try:
        out = {}
        for name, ids in prompts.items():
            tokens, cached = E.generate(llm, ids)
            assert cached == 0, "baseline must compute every token"
            out[name] = tokens
        return out
    finally:
        E.shutdown(llm)


def kvtier_llm(env, **extra):
    return E.make_llm(env["model"], E.kvtier_config(**extra))


def state(llm):
    from kvtier_rs.integrations.vllm.spec import engine_state

    st = engine_state(E.engine_id(llm))
    assert st is not None and st.manager is not None
    return st


def counters(llm):
    return state(llm).manager.counters.as_dict()


def disk_cfg(env, cpu_chunks=4):
    return dict(cpu_bytes_to_use=cpu_chunks * CHUNK, disk_root=str(env["disk"]), disk_bytes_to_use="4MiB")


def test_cpu_tier_serves_prefix_evicted_from_engine_cache(env, prompts, baseline):
    llm = kvtier_llm(env, cpu_bytes_to_use="1MiB")
    try:
        tokens, cached = E.generate(llm, prompts["A"])
        assert (tokens, cached) == (baseline["A"], 0)
        E.drop_gpu_cache(llm)
        tokens, cached = E.generate(llm, prompts["A"])
        assert cached == SERVED
        assert tokens == baseline["A"]
        c = counters(llm)
        assert c["loads_cpu"] == 3 and c["loads_disk"] == 0
        cpu = state(llm).manager.cpu_index.stats()
        assert cpu["stores_completed"] == 3 and cpu["pinned_blocks"] == 0
    finally:
        E.shutdown(llm)
    from kvtier_rs.integrations.vllm.spec import live_engines

    assert live_engines() == {}, "engine shutdown must release kvtier's host memory"


def test_negative_control_wrong_kv_changes_tokens(env, prompts, baseline):
    """Same scenario with a worker that loads wrong bytes: the comparison must catch it."""
    from vllm.config import KVTransferConfig

    cfg = KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "spec_name": "WrongBytesSpec",
            "spec_module_path": "support.vllm.faulty",
            "cpu_bytes_to_use": "1MiB",
        },
    )
    llm = E.make_llm(env["model"], cfg)
    try:
        E.generate(llm, prompts["A"])
        E.drop_gpu_cache(llm)
        tokens, cached = E.generate(llm, prompts["A"])
        assert cached == SERVED and counters(llm)["loads_cpu"] == 3
        assert tokens != baseline["A"], "wrong KV went unnoticed: the comparison proves nothing"
    finally:
        E.shutdown(llm)


def test_disk_tier_serves_prefix_evicted_from_cpu_tier(env, prompts, baseline):
    llm = kvtier_llm(env, **disk_cfg(env))  # CPU tier: 4 chunks
    try:
        # 9 chunks through a 4-chunk CPU tier: A's last two chunks are evicted from it. Its
        # head stays (a finished request's head is made the most recent) and answers HIT;
        # the promotions of the other two must not evict it (before, one did, and it was read
        # back from disk: 3 promotions for 2 chunks missing).
        mgr = state(llm).manager
        for name in "ABC":
            tokens, _ = E.generate(llm, prompts[name])
            assert tokens == baseline[name]
            # A request's chunks stay pinned while their disk write-throughs run: wait for them,
            # so that which chunks the next stores evict does not hang on the disk's speed (on a
            # busy machine B's chunks were still pinned when C stored, C evicted A's head, and
            # A came back from disk whole). And before A is looked up, C's must not be held, or
            # A's promotions could find no slot they may take and A would be recomputed.
            mgr.lower.layer("disk").drain()
        assert mgr.cpu_index.stats()["evictions"] >= 3
        E.drop_gpu_cache(llm)
        tokens, cached = E.generate(llm, prompts["A"])
        assert cached == SERVED, mgr.snapshot()
        assert tokens == baseline["A"]
        c = counters(llm)
        assert c["loads_disk"] == 2 and c["loads_cpu"] == 1 and c["promotions"] == 2, c
        disk = mgr.lower.layer("disk").stats()
        assert disk["blocks_written"] == 9 and disk["blocks_read"] == 2
    finally:
        E.shutdown(llm)


def test_disk_tier_survives_engine_restart(env, prompts, baseline):
    llm = kvtier_llm(env, **disk_cfg(env))
    try:
        assert state(llm).manager.lower.layer("disk").stats()["recovered_blocks"] == 9
        for name in "BA":
            tokens, cached = E.generate(llm, prompts[name])
            assert cached == SERVED
            assert tokens == baseline[name]
        c = counters(llm)
        assert c["loads_disk"] == 6 and c["loads_cpu"] == 0
    finally:
        E.shutdown(llm)


def test_corrupt_disk_block_is_recomputed(env, prompts, baseline):
    assert E.corrupt_payloads(env["disk"]) >= 9
    llm = kvtier_llm(env, **disk_cfg(env))
    try:
        tokens, cached = E.generate(llm, prompts["C"])
        assert cached == 0, "a corrupt block must never be served"
        assert tokens == baseline["C"]
        c = counters(llm)
        assert c["promotion_failures"] >= 1 and c["loads_disk"] == 0
        assert state(llm).manager.lower.layer("disk").stats()["checksum_failures"] >= 1
        # The recomputed head chunk was stored again and is served from the CPU tier. (Later
        # chunks may not be: if their doomed promotion reads were still in flight when the
        # request recomputed them, they were "being written" at store time and so skipped.)
        E.drop_gpu_cache(llm)
        tokens, cached = E.generate(llm, prompts["C"])
        assert tokens == baseline["C"]
        assert cached >= E.BLOCK and counters(llm)["loads_cpu"] >= 1
    finally:
        E.shutdown(llm)


def test_no_offloading_tier_hit_for_unseen_prompt(env, prompts, baseline):
    """A prompt never seen is computed, not served: counters stay at zero loads."""
    llm = kvtier_llm(env, cpu_bytes_to_use="1MiB")
    try:
        tokens, cached = E.generate(llm, prompts["D"])
        assert (tokens, cached) == (baseline["D"], 0)
        c = counters(llm)
        assert c["loads_cpu"] == 0 and c["loads_disk"] == 0
    finally:
        E.shutdown(llm)
