"""The seals on a real vLLM engine: a scheduler whose host memory is not its workers' (the
layout in which every process allocated its own CPU tier) must never write that memory to
disk nor promote from it, and the start-up check refuses such a layout outright.

Both cases take the layout the shared region prevents and force it: the scheduler-role spec
maps a region of its own, which no worker fills, and claims every rank attached, so that only
the seals stand between it and the disk. With the seals bypassed, the same scenario serves
wrong tokens: the comparison with the baseline can tell.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.vllm import engine as E

E.require_vllm()  # fail, never skip: CI installs vLLM

from kvtier_rs.integrations.vllm.spec import KvtierOffloadingSpec, engine_state  # noqa: E402

CHUNK = E.BLOCK_BYTES
SERVED = E.SERVED


class SplitMemorySpec(KvtierOffloadingSpec):
    """The scheduler on host memory of its own (its region is named after another engine id),
    told that every worker rank mapped it."""

    def get_manager(self):
        self.engine_id = self.engine_id + "-scheduler-only"
        return super().get_manager()

    def open_region(self, rank):
        region = super().open_region(rank)
        if rank is None:
            for r in range(self.ranks):
                region.attach(r)  # defeats the start-up check: only the seals are left
        return region


class UnattachedSpec(KvtierOffloadingSpec):
    """The scheduler on a region of its own, with nothing to claim that any rank mapped it."""

    def get_manager(self):
        self.engine_id = self.engine_id + "-scheduler-only"
        return super().get_manager()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return E.module_env(tmp_path_factory, "vllm-seals")


@pytest.fixture(scope="module")
def prompts():
    return {name: E.prompt(seed, E.PROMPT_LEN) for seed, name in enumerate("ABC", start=21)}


@pytest.fixture(scope="module")
def baseline(env, prompts):
    return E.baseline_tokens(env["model"], prompts)


def split_llm(env, disk_dir):
    cfg = E.offloading_config(
        {
            "spec_name": "SplitMemorySpec",
            "spec_module_path": __name__,
            "cpu_bytes_to_use": 4 * CHUNK,
            "disk_root": str(disk_dir),
            "disk_bytes_to_use": "4MiB",
        }
    )
    llm = E.make_llm(env["model"], cfg)
    return llm, engine_state(E.engine_id(llm) + "-scheduler-only").manager


def run_scenario(llm, mgr, prompts):
    """A, B, C through a 4-chunk CPU tier (A's chunks leave it for the disk, if any were
    written), then A again with the GPU cache dropped."""
    for name in "ABC":
        E.generate(llm, prompts[name])
        mgr.lower.layer("disk").drain()
    E.drop_gpu_cache(llm)
    return E.generate(llm, prompts["A"])


def test_a_scheduler_on_memory_no_worker_fills_writes_nothing_to_disk(env, prompts, baseline):
    llm, mgr = split_llm(env, env["tmp"] / "sealed-disk")
    try:
        tokens, _ = run_scenario(llm, mgr, prompts)
        assert tokens == baseline["A"], "a wrong block was served"
        stager = mgr.lower.layer("disk").stager.counters
        # Every chunk stored (nine, and any offered again) was refused, none written.
        assert stager.writes_dropped_unsealed >= 9 and stager.writes_submitted == 0, stager
        assert mgr.counters.loads_disk == 0
    finally:
        E.shutdown(llm)


def test_without_the_seals_the_same_layout_serves_wrong_tokens(env, prompts, baseline, monkeypatch):
    """The control: the seals are what keeps the scenario above right."""
    from kvtier_rs.orchestrator.disk_stager import DiskStager

    monkeypatch.setattr(DiskStager, "_sealed_only", lambda self, keys, slots: (keys, slots))
    monkeypatch.setattr(
        "kvtier_rs.tiers.shared_region.SlotSeals.matches", lambda self, rows, seals, rank=None: np.ones(len(rows), bool)
    )
    llm, mgr = split_llm(env, env["tmp"] / "unsealed-disk")
    try:
        tokens, cached = run_scenario(llm, mgr, prompts)
        assert mgr.counters.loads_disk >= 1 and cached == SERVED, (mgr.counters, cached)
        # The disk got the scheduler's bytes, which no worker filled, and the worker loaded its
        # own row, which holds another chunk by now.
        assert tokens != baseline["A"], "KV no worker stored for A must change the greedy tokens"
    finally:
        E.shutdown(llm)


def test_a_rank_that_did_not_map_the_region_stops_the_engine_at_start(env):
    from kvtier_rs.integrations.vllm.spec import live_engines

    cfg = E.offloading_config(
        {"spec_name": "UnattachedSpec", "spec_module_path": __name__, "cpu_bytes_to_use": 4 * CHUNK}
    )
    try:
        with pytest.raises(Exception, match=r"worker rank\(s\) \[0\] of 1 have not mapped"):
            E.make_llm(env["model"], cfg)
    finally:
        # vLLM does not tear down the worker of an engine that failed to start (make_llm drops
        # its process-wide connector).
        for st in live_engines().values():
            if st.worker is not None:
                st.worker.shutdown()
    assert live_engines() == {}
