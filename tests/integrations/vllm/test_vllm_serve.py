"""kvtier under `vllm serve`, as users run it: vLLM's OpenAI server in its default multiprocess
mode (the model worker in a process of its own), driven over HTTP by the OpenAI client, greedy
outputs compared token by token with a server without offloading.

The tests of this module run in order and share one disk directory: CPU-tier hits and disk-tier
hits from one server, then disk hits after a SIGTERM restart and after SIGKILL of the whole
process tree; then tensor parallelism (two worker processes), vLLM's tiering spec with
kvtier's disk tier, then with kvtier's shared remote tier (a prompt one server stored in a real
Redis Cluster is loaded by a second server), the disk tier's SLO guard tripped by a slow disk and back after its
cool-down, the request rule (a TTFT budget) bypassing the newest tier first, and a negative
control whose
worker loads wrong bytes (the comparison must catch it). kvtier's counters are read from the
server's own Prometheus exposition, scraped over HTTP.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from support.valkey import start_cluster
from support.vllm import engine as E
from support.vllm.server import Server, metric

from kvtier_rs.tiers.disk import FAULT_ENV

E.require_vllm()  # fail, never skip: CI installs vLLM

PROMPT_LEN = E.PROMPT_LEN
SERVED = E.SERVED  # 3 full chunks of each prompt can come from an offload tier
CHUNK = E.BLOCK_BYTES
K = "vllm:kv_offload_kvtier_"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-serve")
    return {"tmp": tmp, "model": E.tiny_model(tmp_path_factory.getbasetemp()), "disk": tmp / "disk"}


@pytest.fixture(scope="module")
def prompts():
    return {name: E.prompt(seed, PROMPT_LEN) for seed, name in enumerate("ABCDE", start=11)}


def start(env, name, kv_transfer_config=None, **kw) -> Server:
    return Server(env["model"], env["tmp"] / name, kv_transfer_config=kv_transfer_config, **kw).wait_ready()


def kvtier_config(env, connector="KvtierConnector", **extra):
    """kvtier under its own connector (vLLM's OffloadingConnector with every series from
    start-up), or with connector="OffloadingConnector" under vLLM's."""
    cfg = {
        "spec_name": "KvtierOffloadingSpec",
        "spec_module_path": "kvtier_rs.integrations.vllm",
        # Four chunks: a prompt's three fit, the next prompt's stores evict them.
        "cpu_bytes_to_use": 4 * CHUNK,
        "disk_root": str(env["disk"]),
        "disk_bytes_to_use": 64 * 4096 * 8,
    }
    cfg.update(extra)
    top = {"kv_connector": connector, "kv_role": "kv_both", "kv_connector_extra_config": cfg}
    if connector == "KvtierConnector":
        top["kv_connector_module_path"] = "kvtier_rs.integrations.vllm"
    return top


def offload_series(srv: Server) -> set[str]:
    return {n for n, _ in srv.metrics() if n.startswith("vllm:kv_offload_")}


@pytest.fixture(scope="module")
def baseline(env, prompts):
    """Greedy tokens of each prompt from a server without offloading."""
    srv = start(env, "baseline")
    try:
        out = {}
        for name, ids in prompts.items():
            tokens, cached = srv.complete(ids)
            assert cached == 0, "the baseline must compute every prompt token"
            out[name] = tokens
        return out
    finally:
        srv.stop()


def serve_abcd(srv: Server, prompts, baseline) -> None:
    """Prompts A..D in turn, each with the baseline's tokens, each one's three chunks written
    to the disk tier before the next: a request's chunks stay pinned until their disk writes
    are done, so which chunks the next stores evict does not hang on the disk's speed. The
    CPU tier (four chunks) then holds D's; A, B and C are on disk only."""
    for i, name in enumerate("ABCD", start=1):
        tokens, _ = srv.complete(prompts[name])
        assert tokens == baseline[name], name
        srv.wait_for_metric(K + "stores_completed_total", 3 * i, tier="disk")


def served_by(srv: Server, ids: list[int]):
    """Drop the GPU prefix cache, then send the prompt: whatever prefix it does not compute now
    comes from kvtier."""
    srv.reset_gpu_prefix_cache()
    before = srv.metrics()
    tokens, cached = srv.complete(ids)
    after = srv.metrics()
    moved = {n: metric(after, K + n + "_total") - metric(before, K + n + "_total") for n in ("loads_cpu", "loads_disk")}
    return tokens, cached, moved


def test_cpu_and_disk_tier_hits_match_the_baseline(env, prompts, baseline):
    srv = start(env, "kvtier", kvtier_config(env))
    try:
        # Before any request: kvtier's series of both tiers and vLLM's own offload series are
        # exported, at zero.
        samples = srv.metrics()
        for n, labels in [
            ("loads_disk_total", {}),
            ("promotion_failures_total", {}),
            ("stores_completed_total", {"tier": "cpu"}),
            ("stores_completed_total", {"tier": "disk"}),
            ("resident_blocks", {"tier": "disk"}),
            ("write_through_dropped_total", {"tier": "disk", "reason": "unsealed"}),
        ]:
            present = any(x == K + n and set(labels.items()) <= set(ls) for x, ls in samples)
            assert present, (n, labels, sorted(offload_series(srv)))
            assert metric(samples, K + n, **labels) == 0
        assert "vllm:kv_offload_load_bytes_total" in offload_series(srv)
        serve_abcd(srv, prompts, baseline)
        # What a timed-out wait reports: kvtier's non-zero series (and the server log's end).
        report = srv.diagnosis()
        disk_writes = [ln for ln in report.splitlines() if "stores_completed_total" in ln and "'disk'" in ln]
        assert len(disk_writes) == 1 and disk_writes[0].endswith(" = 12.0"), report
        # D's chunks are the CPU tier's newest: served from host memory.
        before = metric(srv.metrics(), "vllm:kv_offload_load_bytes_total")
        tokens, cached, moved = served_by(srv, prompts["D"])
        assert tokens == baseline["D"]
        assert cached == SERVED and moved["loads_cpu"] == 3 and moved["loads_disk"] == 0, (cached, moved)
        # vLLM's own offload series count kvtier's loads too (dashboards built on them work).
        loaded = metric(srv.metrics(), "vllm:kv_offload_load_bytes_total") - before
        assert loaded == 3 * CHUNK, loaded
        # Most of A's left the CPU tier for later stores (a finished request's head is kept
        # longest): they are promoted from disk.
        tokens, cached, moved = served_by(srv, prompts["A"])
        assert tokens == baseline["A"]
        assert cached == SERVED and moved["loads_disk"] >= 2 and sum(moved.values()) == 3, (cached, moved)
    finally:
        srv.stop()


def test_disk_hits_after_a_sigterm_restart_match_the_baseline(env, prompts, baseline):
    # Under vLLM's own OffloadingConnector, the same spec: neither kvtier's series nor vLLM's
    # flat offload series exist before the first request (the control for the start-up series
    # above; vLLM creates only its deprecated, transfer_type-labelled ones at start).
    srv = start(env, "kvtier-restarted", kvtier_config(env, connector="OffloadingConnector"))
    try:
        early = offload_series(srv)
        assert not {n for n in early if n.startswith(K)} and "vllm:kv_offload_load_bytes_total" not in early, early
        for name in "BC":
            tokens, cached, moved = served_by(srv, prompts[name])
            assert tokens == baseline[name], name
            assert cached == SERVED and moved["loads_disk"] == 3, (name, cached, moved)
    finally:
        srv.kill()  # the next test restarts after a crash


def test_disk_hits_after_sigkill_of_the_process_tree_match_the_baseline(env, prompts, baseline):
    srv = start(env, "kvtier-after-kill", kvtier_config(env))
    try:
        tokens, cached, moved = served_by(srv, prompts["D"])
        assert tokens == baseline["D"]
        assert cached == SERVED and moved["loads_disk"] == 3, (cached, moved)
        # A new prompt is computed, stored and served as before.
        tokens, _ = srv.complete(prompts["E"])
        assert tokens == baseline["E"]
    finally:
        srv.stop()


def test_tensor_parallel_2_serves_cpu_and_disk_hits_right(env, prompts):
    """TP=2: two worker processes, each rank's part of a chunk in one shared row; the disk tier
    writes and promotes whole rows. Compared with the same server's own first, computed pass
    (TP=2 sums attention over ranks, so its floats need not be TP=1's)."""
    srv = start(
        env,
        "tp2",
        kvtier_config(env, disk_root=str(env["tmp"] / "tp2-disk")),
        extra_args=["--tensor-parallel-size", "2"],
        # vLLM's CPU build binds each rank's threads to a NUMA node, and this machine has one.
        extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    )
    try:
        computed = {}
        for i, name in enumerate("ABCD", start=1):
            computed[name], cached = srv.complete(prompts[name])
            assert cached == 0, name
            srv.wait_for_metric(K + "stores_completed_total", 3 * i, tier="disk")
        tokens, cached, moved = served_by(srv, prompts["D"])
        assert tokens == computed["D"] and cached == SERVED and moved["loads_cpu"] == 3, (cached, moved)
        tokens, cached, moved = served_by(srv, prompts["A"])
        assert tokens == computed["A"], "a TP=2 disk hit changed the tokens"
        assert cached == SERVED and moved["loads_disk"] >= 2 and sum(moved.values()) == 3, (cached, moved)
    finally:
        srv.stop()


def test_tiering_spec_with_kvtiers_disk_tier_matches_the_baseline(env, prompts, baseline):
    cfg = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "KvtierTieringOffloadingSpec",
            "spec_module_path": "kvtier_rs.integrations.vllm",
            "cpu_bytes_to_use": 4 * 4096 * -(-CHUNK // 4096),
            "secondary_tiers": [
                {
                    "type": "KvtierDiskTier",
                    "module_path": "kvtier_rs.integrations.vllm",
                    "root_dir": str(env["tmp"] / "tiering-disk"),
                    "capacity_bytes": "4MiB",
                }
            ],
        },
    }
    srv = start(env, "tiering", cfg)
    try:
        for name in "ABCD":
            tokens, _ = srv.complete(prompts[name])
            assert tokens == baseline[name], name
        # A was evicted from vLLM's CPU tier by B..D: its prefix comes back from kvtier's disk.
        srv.reset_gpu_prefix_cache()
        tokens, cached = srv.complete(prompts["A"])
        assert tokens == baseline["A"]
        assert cached == SERVED, cached
    finally:
        srv.stop()


def test_tiering_spec_with_kvtiers_remote_tier_shares_a_prompt_between_servers(env, prompts, baseline):
    """Two servers under vLLM's tiering spec, each with a KvtierRemoteTier entry on one cluster:
    what the first computes is cascaded to the store; the second, which never saw the prompt,
    answers RETRY while its batched probe runs, then promotes the chunks from the store."""
    cluster = start_cluster(Path(env["tmp"]) / "cluster")
    cfg = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "KvtierTieringOffloadingSpec",
            "spec_module_path": "kvtier_rs.integrations.vllm",
            "cpu_bytes_to_use": 4 * 4096 * -(-CHUNK // 4096),
            "secondary_tiers": [
                {
                    "type": "KvtierRemoteTier",
                    "module_path": "kvtier_rs.integrations.vllm",
                    "remote_url": cluster.url,
                    # A busy 2-core machine runs the cluster, two servers and their engines.
                    "remote_deadline_s": 10.0,
                }
            ],
        },
    }
    chunks = SERVED // E.BLOCK
    servers: list[Server] = []
    try:
        a = start(env, "tiering-remote-a", cfg)
        servers.append(a)
        tokens, cached = a.complete(prompts["C"])
        assert (tokens, cached) == (baseline["C"], 0)
        a.wait_for_metric(K + "remote_writes_total", chunks, tier="remote")
        assert cluster.dbsize() == chunks
        a.stop()
        servers.remove(a)
        b = start(env, "tiering-remote-b", cfg)
        servers.append(b)
        tokens, cached = b.complete(prompts["C"])
        assert tokens == baseline["C"]
        assert cached == SERVED, cached
        samples = b.metrics()
        assert metric(samples, K + "remote_hits_total", tier="remote") == chunks
        assert metric(samples, K + "remote_probes_total", tier="remote") >= 1
    finally:
        for srv in servers:
            srv.stop()
        cluster.stop()


def disk_tier_back_after(srv: Server, cool_down_left_s: float, prompts, baseline):
    """Once the cool-down is over the disk tier is re-probed: C's prefix (on disk only) is
    promoted again, with the baseline's tokens, and the guard reads 0. Returns the metrics."""
    time.sleep(max(0.0, cool_down_left_s) + 0.5)
    tokens, cached, moved = served_by(srv, prompts["C"])
    assert tokens == baseline["C"]
    assert cached == SERVED and moved["loads_disk"] >= 1, (cached, moved)
    samples = srv.metrics()
    assert metric(samples, K + "guard_state", tier="disk") == 0
    assert "the disk tier is back in service" in srv.log_text()
    return samples


def test_a_slow_disk_trips_the_slo_guard_and_is_back_after_the_cool_down(env, prompts, baseline):
    """The disk tier's first two reads are made slow (400 ms each, armed through the environment
    of the engine's processes): the requests that waited on them trip the disk guard; while it
    is bypassed, disk hits are recomputed instead of waited on; after the cool-down the tier is
    re-probed, now fast, and serves again. Greedy outputs match the baseline throughout."""
    recover_s = 20  # far above one request's time, so the bypassed request runs inside it
    rule = {"p99_ms": 50, "window_s": 600, "recover_s": recover_s, "min_samples": 2}
    cfg = kvtier_config(env, disk_root=str(env["tmp"] / "guard-disk"), disk_slo_guard=rule)
    srv = start(env, "kvtier-guard", cfg, extra_env={FAULT_ENV: "read_delay_ms:400*2"})
    try:
        serve_abcd(srv, prompts, baseline)
        # A's prefix comes back from disk through the two slow reads (and a fast one, maybe).
        tokens, cached, moved = served_by(srv, prompts["A"])
        assert tokens == baseline["A"]
        assert cached == SERVED and moved["loads_disk"] >= 2, (cached, moved)
        srv.wait_for_metric(K + "guard_trips_total", 1, tier="disk")
        tripped_seen = time.monotonic()
        samples = srv.metrics()
        assert metric(samples, K + "guard_state", tier="disk") == 1
        assert metric(samples, K + "guard_p99_seconds", tier="disk") > 0.05  # over the budget
        # Bypassed: B's disk hits are recomputed (counted), nothing is promoted from disk.
        refused = metric(samples, K + "disk_refused_guard_total")
        tokens, _, moved = served_by(srv, prompts["B"])
        assert tokens == baseline["B"]
        assert moved["loads_disk"] == 0, moved
        assert metric(srv.metrics(), K + "disk_refused_guard_total") > refused
        assert "SLO guard tripped: the disk tier is bypassed" in srv.log_text()
        samples = disk_tier_back_after(srv, recover_s - (time.monotonic() - tripped_seen), prompts, baseline)
        assert metric(samples, K + "guard_trips_total", tier="disk") == 1
    finally:
        srv.stop()


def test_a_request_over_the_ttft_budget_bypasses_the_newest_tier_first(env, prompts, baseline):
    """The request rule (slo_guard) watches what users see: the disk tier's first read is made
    very slow (12 s), so the request that waits on it misses the 8 s TTFT budget, which no
    request of this test comes near otherwise. The rule bypasses the newest tier, the disk
    tier: its hits are recomputed while the CPU tier keeps serving. After the cool-down the
    disk tier is re-probed and serves again. Greedy outputs match the baseline throughout."""
    recover_s = 20
    rule = {"ttft_p99_ms": 8000, "window_s": 600, "recover_s": recover_s, "min_samples": 1}
    cfg = kvtier_config(env, disk_root=str(env["tmp"] / "ttft-disk"), slo_guard=rule)
    srv = start(env, "kvtier-ttft", cfg, extra_env={FAULT_ENV: "read_delay_ms:12000*1"})
    try:
        serve_abcd(srv, prompts, baseline)
        samples = srv.metrics()
        assert metric(samples, K + "guard_state", tier="disk") == 0
        assert metric(samples, K + "guard_trips_total", tier="disk") == 0
        # A's prefix comes back from disk through the slow read: its TTFT is over the budget.
        tokens, cached, moved = served_by(srv, prompts["A"])
        assert tokens == baseline["A"]
        assert cached == SERVED and moved["loads_disk"] >= 1, (cached, moved)
        srv.wait_for_metric(K + "guard_trips_total", 1, tier="disk")
        tripped_seen = time.monotonic()
        samples = srv.metrics()
        assert metric(samples, K + "guard_state", tier="disk") == 1
        assert metric(samples, K + "guard_state", tier="cpu") == 0
        assert "request SLO rule tripped (p99 TTFT" in srv.log_text()
        # The disk tier is out: B's disk hits are recomputed, nothing is promoted from disk ...
        refused = metric(samples, K + "disk_refused_guard_total")
        tokens, _, moved = served_by(srv, prompts["B"])
        assert tokens == baseline["B"]
        assert moved["loads_disk"] == 0, moved
        assert metric(srv.metrics(), K + "disk_refused_guard_total") > refused
        # ... while the CPU tier still serves: C and D's stores pushed A out, B is computed
        # now and stored, so B's prefix is a CPU hit.
        tokens, cached, moved = served_by(srv, prompts["B"])
        assert tokens == baseline["B"]
        assert cached == SERVED and moved["loads_cpu"] == 3, (cached, moved)
        samples = disk_tier_back_after(srv, recover_s - (time.monotonic() - tripped_seen), prompts, baseline)
        assert metric(samples, K + "guard_trips_total", tier="cpu") == 0
    finally:
        srv.stop()


def test_negative_control_a_worker_that_loads_wrong_bytes_changes_the_tokens(env, prompts, baseline):
    cfg = kvtier_config(env, spec_name="WrongBytesSpec", spec_module_path="support.vllm.faulty")
    del cfg["kv_connector_extra_config"]["disk_root"], cfg["kv_connector_extra_config"]["disk_bytes_to_use"]
    srv = start(env, "wrong-bytes", cfg)
    try:
        tokens, _ = srv.complete(prompts["A"])
        assert tokens == baseline["A"], "computed without a hit, the control matches"
        tokens, cached, moved = served_by(srv, prompts["A"])
        assert cached == SERVED and moved["loads_cpu"] == 3, (cached, moved)
        assert tokens != baseline["A"], "wrong KV loaded over HTTP must change the greedy tokens"
    finally:
        srv.stop()
