"""kvtier's disk tier as a secondary tier under vLLM's own TieringOffloadingSpec, on a real
vLLM engine (CPU platform). vLLM's manager owns the CPU primary tier; kvtier's tier serves what
the primary evicted, survives a restart, and never serves a corrupt block.

Tests run in order and share one disk directory.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.vllm import engine as E

E.require_vllm()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return E.module_env(tmp_path_factory, "vllm-tiering")


@pytest.fixture(scope="module")
def prompts():
    return {name: E.prompt(seed, 100) for seed, name in enumerate("ABC", start=1)}


@pytest.fixture(scope="module")
def baseline(env, prompts):
    return E.baseline_tokens(env["model"], prompts)


def tiering_llm(env, primary_chunks=4, tier_type="KvtierDiskTier", module="kvtier_rs.integrations.vllm", root=None):
    cfg = {
        "spec_name": "KvtierTieringOffloadingSpec",
        "spec_module_path": "kvtier_rs.integrations.vllm",
        "cpu_bytes_to_use": primary_chunks * E.BLOCK_BYTES,
        "secondary_tiers": [
            {
                "type": tier_type,
                "module_path": module,
                "root_dir": str(root or env["disk"]),
                "capacity_bytes": "4MiB",
            }
        ],
    }
    return E.make_llm(env["model"], E.offloading_config(cfg))


def tier(llm):
    from kvtier_rs.integrations.vllm.secondary import KvtierDiskTier

    mgr = llm.llm_engine.engine_core.engine_core.scheduler.connector.connector_scheduler.manager
    (t,) = [t for t in mgr.secondary_tiers if isinstance(t, KvtierDiskTier)]
    return t


def generate_and_drain(llm, ids):
    """generate, then wait for the request's cascades to the disk tier. vLLM keeps the primary
    chunks a cascade reads pinned until it is reported: while one runs, the next request's
    stores may find no room in the 4-chunk primary, and a chunk never stored is never cascaded."""
    out = E.generate(llm, ids)
    tier(llm).drain_jobs()
    return out


def test_negative_control_wrong_promoted_bytes_change_tokens(env, prompts, baseline, tmp_path):
    """The first scenario with a secondary tier that promotes wrong bytes: the comparison with
    the baseline must catch it, or the positive tests below would prove nothing."""
    llm = tiering_llm(env, tier_type="WrongBytesDiskTier", module="support.vllm.faulty", root=tmp_path)
    try:
        for name in "ABC":
            assert generate_and_drain(llm, prompts[name]) == (baseline[name], 0)
        t = tier(llm)
        assert t.disk.stats()["blocks_written"] == 9, t.disk.stats()
        E.drop_gpu_cache(llm)
        tokens, cached = E.generate(llm, prompts["A"])
        assert cached == E.SERVED and t.counters["loads"] == 3, (cached, t.counters, t.disk.stats())
        assert tokens != baseline["A"], "wrong KV went unnoticed: the comparison proves nothing"
    finally:
        E.shutdown(llm)


def test_secondary_tier_serves_prefix_evicted_from_primary(env, prompts, baseline):
    llm = tiering_llm(env)
    try:
        for name in "ABC":  # 9 chunks through a 4-chunk primary: A leaves the primary
            assert generate_and_drain(llm, prompts[name]) == (baseline[name], 0)
        t = tier(llm)
        assert t.disk.stats()["blocks_written"] == 9
        # In place: the disk tier's pool is vLLM's primary region itself (no staging copy).
        primary = np.frombuffer(t._primary_kv_view, dtype=np.uint8)  # vLLM's base class keeps it here
        assert t.pool.wrapped and t.pool.ptr == primary.ctypes.data
        assert t.pool.slot_bytes == t.block_size_bytes and t.pool.num_slots == 4
        E.drop_gpu_cache(llm)
        tokens, cached = E.generate(llm, prompts["A"])
        assert cached == E.SERVED
        assert tokens == baseline["A"]
        assert t.counters["loads"] == 3 and t.counters["failed_reads"] == 0
    finally:
        E.shutdown(llm)


def test_secondary_tier_survives_restart(env, prompts, baseline):
    llm = tiering_llm(env)
    try:
        t = tier(llm)
        assert t.disk.stats()["recovered_blocks"] == 9
        tokens, cached = E.generate(llm, prompts["B"])
        assert (tokens, cached) == (baseline["B"], E.SERVED)
        assert t.counters["loads"] == 3
    finally:
        E.shutdown(llm)


def test_secondary_tier_corrupt_block_is_recomputed(env, prompts, baseline):
    assert E.corrupt_payloads(env["disk"]) >= 9
    llm = tiering_llm(env)
    try:
        t = tier(llm)
        tokens, cached = E.generate(llm, prompts["C"])
        assert cached == 0, "a corrupt block must never be served"
        assert tokens == baseline["C"]
        assert t.counters["loads"] == 0 and t.counters["failed_reads"] >= 1
        assert t.disk.stats()["checksum_failures"] >= 1
    finally:
        E.shutdown(llm)


def test_bad_tier_config_names_the_key(env):
    cfg = {
        "spec_name": "KvtierTieringOffloadingSpec",
        "spec_module_path": "kvtier_rs.integrations.vllm",
        "cpu_bytes_to_use": 4 * E.BLOCK_BYTES,
        "secondary_tiers": [
            {
                "type": "KvtierDiskTier",
                "module_path": "kvtier_rs.integrations.vllm",
                "root_dir": str(env["disk"]),
            }
        ],
    }
    with pytest.raises(Exception) as ei:
        E.make_llm(env["model"], E.offloading_config(cfg))
    # vLLM may wrap the error; the original must be kvtier's, naming the missing key.
    err = ei.value
    chain = [err]
    while err.__cause__ or err.__context__:
        err = err.__cause__ or err.__context__
        chain.append(err)
    msgs = " | ".join(str(e) for e in chain)
    assert "secondary_tiers[type=KvtierDiskTier]['disk_bytes']: required (also taken as capacity_bytes)" in msgs, msgs
