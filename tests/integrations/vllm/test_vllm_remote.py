"""The shared remote tier under `vllm serve`, as users deploy it: two engines, each `vllm serve` in
its default multiprocess mode on its own port, sharing one real 3-primary Redis Cluster on
loopback. A prefix computed by engine A is served to engine B from the store; greedy outputs are
compared token by token with a server without offloading, and kvtier's counters, scraped from
each server's Prometheus exposition, prove which tier served what.

In order: A computes and (on reuse) stores; B is served from the remote tier; a value planted
under the right key is a counted miss with the right outputs; every engine restarted still finds
the blocks; a cluster node killed mid-run costs misses, never wrong tokens or a failed request.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.valkey import Cluster, start_cluster
from support.vllm import engine as E
from support.vllm.server import Server, metric

E.require_vllm()  # fail, never skip: CI installs vLLM

PROMPT_LEN = E.PROMPT_LEN
SERVED = E.SERVED  # tokens of each prompt an offload tier can serve...
CHUNKS = SERVED // E.BLOCK  # ...in this many chunks
CHUNK = E.BLOCK_BYTES
K = "vllm:kv_offload_kvtier_"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-remote")
    return {"tmp": tmp, "model": E.tiny_model(tmp_path_factory.getbasetemp())}


@pytest.fixture(scope="module")
def cluster(env):
    c = start_cluster(Path(env["tmp"]) / "cluster")
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def prompts():
    return {name: E.prompt(seed, PROMPT_LEN) for seed, name in enumerate("PQRST", start=41)}


def start(env, name, kv_transfer_config=None) -> Server:
    return Server(env["model"], env["tmp"] / name, kv_transfer_config=kv_transfer_config).wait_ready()


def remote_config(cluster: Cluster, **extra):
    cfg = {
        "spec_name": "KvtierOffloadingSpec",
        "spec_module_path": "kvtier_rs.integrations.vllm",
        "cpu_bytes_to_use": 4 * CHUNK,
        "remote_url": cluster.url,
        # A busy 2-core machine runs four engine processes and three servers here.
        "remote_deadline_s": 10.0,
    }
    cfg.update(extra)
    return {
        "kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier_rs.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": cfg,
    }


@pytest.fixture(scope="module")
def baseline(env, prompts):
    srv = start(env, "baseline")
    try:
        out = {}
        for name, ids in prompts.items():
            tokens, cached = srv.complete(ids)
            assert cached == 0
            out[name] = tokens
        return out
    finally:
        srv.stop()


def served(srv: Server, ids: list[int]):
    """Drop the GPU prefix cache, send the prompt, and say which kvtier tier served what."""
    srv.reset_gpu_prefix_cache()
    before = srv.metrics()
    tokens, cached = srv.complete(ids)
    after = srv.metrics()
    names = ("loads_cpu", "loads_remote")
    moved = {n: metric(after, K + n + "_total") - metric(before, K + n + "_total") for n in names}
    return tokens, cached, moved


def stored_on(srv: Server, prompts, baseline, name: str, writes_before: float) -> float:
    """Run prompt `name` twice on `srv` (the second time from its CPU tier: the reuse the remote
    admission `uses:2` waits for) and wait until its chunks are in the store."""
    tokens, _ = srv.complete(prompts[name])
    assert tokens == baseline[name]
    tokens, _, moved = served(srv, prompts[name])
    assert tokens == baseline[name] and moved["loads_cpu"] == CHUNKS, moved
    return srv.wait_for_metric(K + "remote_writes_total", writes_before + CHUNKS, tier="remote")


def test_a_prefix_computed_by_engine_a_is_served_to_engine_b_from_the_remote_tier(env, cluster, prompts, baseline):
    a = start(env, "engine-a", remote_config(cluster))
    b = start(env, "engine-b", remote_config(cluster))
    try:
        samples = b.metrics()
        assert metric(samples, K + "remote_breaker_state", tier="remote") == 0
        assert metric(samples, K + "loads_remote_total") == 0
        # One use is no reuse evidence: nothing is written yet.
        tokens, _ = a.complete(prompts["P"])
        assert tokens == baseline["P"]
        assert metric(a.metrics(), K + "remote_writes_refused_admission_total", tier="remote") >= CHUNKS
        assert cluster.dbsize() == 0
        stored_on(a, prompts, baseline, "P", 0)
        assert cluster.dbsize() == CHUNKS
        # B never saw P: its lookups probe the store, promote the chunks and load them.
        tokens, cached, moved = served(b, prompts["P"])
        assert tokens == baseline["P"]
        assert cached == SERVED and moved == {"loads_cpu": 0, "loads_remote": CHUNKS}, (cached, moved)
        after = b.metrics()
        assert metric(after, K + "remote_hits_total", tier="remote") == CHUNKS
        assert metric(after, K + "remote_probes_total", tier="remote") >= 1
        # B's own reuse of P finds the blocks stored already: no second copy.
        tokens, _, moved = served(b, prompts["P"])
        assert tokens == baseline["P"] and moved["loads_cpu"] == CHUNKS
        assert cluster.dbsize() == CHUNKS

        # Negative control: Q's values are replaced, under their own keys, by another program's
        # bytes (one flipped payload byte each). B must count them as misses and recompute.
        p_keys = set(keys_now(cluster))
        stored_on(a, prompts, baseline, "Q", CHUNKS)
        assert tamper(cluster, set(keys_now(cluster)) - p_keys) == CHUNKS
        before = b.metrics()
        tokens, cached, moved = served(b, prompts["Q"])
        assert tokens == baseline["Q"], "a tampered value reached the engine"
        assert moved["loads_remote"] == 0 and cached == 0, (cached, moved)
        checks = metric(b.metrics(), K + "remote_misses_total", tier="remote", reason="check")
        assert checks - metric(before, K + "remote_misses_total", tier="remote", reason="check") >= 1
    finally:
        a.stop()
        b.stop()


def keys_now(cluster: Cluster) -> list[bytes]:
    """Every key kvtier stored, from every primary."""
    out: list[bytes] = []
    for c in cluster.node_clients():
        out += list(c.scan_iter(match=b"kvtier:*", count=1000))
    return out


def tamper(cluster: Cluster, keys: set[bytes]) -> int:
    """Flip the last payload byte of each value in `keys`, as a program other than kvtier
    writing under kvtier's keys would."""
    n = 0
    for c in cluster.node_clients():
        for k in c.scan_iter(match=b"kvtier:*", count=1000):
            if k in keys:
                v = bytearray(c.get(k))
                v[-1] ^= 0xFF
                c.set(k, bytes(v))
                n += 1
    return n


def test_restarted_engines_still_find_the_shared_blocks(env, cluster, prompts, baseline):
    c = start(env, "engine-c", remote_config(cluster))
    try:
        tokens, cached, moved = served(c, prompts["P"])
        assert tokens == baseline["P"]
        assert cached == SERVED and moved["loads_remote"] == CHUNKS, (cached, moved)
    finally:
        c.stop()


def test_a_killed_cluster_node_costs_misses_never_wrong_tokens(env, cluster, prompts, baseline):
    d = start(env, "engine-d", remote_config(cluster, remote_deadline_s=2.0))
    try:
        cluster.kill(0)
        for name in "PRS":
            tokens, _, _ = served(d, prompts[name])
            assert tokens == baseline[name], name
        samples = d.metrics()
        failed = sum(
            metric(samples, K + f"remote_{n}_total", tier="remote")
            for n in ("probe_errors", "read_errors", "write_errors", "deadline_exceeded")
        )
        assert failed >= 1, "the dead node cost nothing: was the store asked at all?"
    finally:
        d.stop()
        cluster.restart(0)
