"""vLLM's manager over kvtier's CPU tier and the shared remote tier, on a real 3-primary cluster:
the lookup contract (RETRY while one batched probe per request is in flight, then HIT_PENDING
while the read is verified, then HIT), the reuse that `uses:2` admission waits for, two managers
(two replicas) sharing blocks, and the store's failures as misses."""

from __future__ import annotations

import hashlib
import time

import numpy as np
from support.valkey import Cluster, start_cluster
from support.vllm import engine as E

E.require_vllm()

from vllm.v1.kv_offload.base import LookupResult, ReqContext  # noqa: E402

from kvtier_rs import BlockIndex, HostPool  # noqa: E402
from kvtier_rs.integrations.vllm.lower_tiers import LowerTiers  # noqa: E402
from kvtier_rs.integrations.vllm.manager import KvtierOffloadingManager  # noqa: E402
from kvtier_rs.integrations.vllm.options import parse_options  # noqa: E402
from kvtier_rs.integrations.vllm.remote_layer import RemoteLayer  # noqa: E402
from kvtier_rs.tiers.remote.build import open_remote_tier  # noqa: E402

CHUNK = 4096
WAIT_S = 60.0
HIT, MISS, PENDING, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING, LookupResult.RETRY


def key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest() + (0).to_bytes(4, "big")


class Replica:
    """One engine's scheduler side: a CPU tier of `slots` chunks and the remote tier."""

    def __init__(self, cluster: Cluster, slots: int = 4, clock=time.monotonic, **extra):
        self.pool = HostPool(slots * CHUNK, CHUNK)
        self.cpu = BlockIndex(pool=self.pool)
        opts = parse_options({"cpu_bytes_to_use": slots * CHUNK, "remote_url": cluster.url, **extra})
        assert opts.remote is not None
        self.remote = open_remote_tier(opts.remote, CHUNK, "test-model", clock=clock)
        layer = RemoteLayer(self.remote, self.pool, self.cpu, opts, tokens_per_chunk=16)
        self.mg = KvtierOffloadingManager(self.cpu, lower=LowerTiers([layer]))
        self.view = np.frombuffer(memoryview(self.pool), dtype=np.uint8).reshape(slots, CHUNK)

    def store(self, i: int) -> None:
        """Offload chunk `i` (bytes = i) as the engine would: a store job, then its completion."""
        c = ReqContext(req_id=f"store-{i}")
        out = self.mg.prepare_store([key(i)], c)
        assert out is not None and out.keys_to_store == [key(i)]
        self.view[int(out.store_spec.block_ids[0])] = i
        self.mg.complete_store([key(i)], c)

    def load(self, i: int) -> bytes:
        """Load chunk `i` (a HIT) and return its bytes."""
        c = ReqContext(req_id=f"load-{i}")
        spec = self.mg.prepare_load([key(i)], c)
        data = self.view[int(spec.block_ids[0])].tobytes()
        self.mg.complete_load([key(i)], c)
        return data

    def settle(self, i: int, c: ReqContext) -> list[LookupResult]:
        """Look `i` up once per step until HIT or MISS; the answers, in order."""
        answers: list[LookupResult] = []
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            r = self.mg.lookup(key(i), c)
            answers.append(r)
            if r in (HIT, MISS):
                return answers
            self.mg.on_schedule_end(None)  # the step ends: probes go out, completions come in
            self.remote.wait_idle(WAIT_S)
        raise AssertionError(f"lookup of chunk {i} never settled: {answers}")

    def drain(self) -> None:
        self.mg.on_schedule_end(None)
        self.remote.wait_idle(WAIT_S)
        self.mg.on_schedule_end(None)

    def close(self) -> None:
        self.mg.shutdown()


def test_a_chunk_reused_on_one_replica_is_served_to_another_verified(cluster):
    a, b = Replica(cluster), Replica(cluster)
    try:
        a.store(7)
        a.drain()
        # One use is not reuse evidence (uses:2): nothing in the store yet.
        assert cluster.dbsize() == 0 and a.remote.stats()["writes_refused_admission"] == 1
        assert a.load(7) == bytes([7]) * CHUNK  # the reuse
        a.drain()
        assert cluster.dbsize() == 1 and a.remote.stats()["writes_ok"] == 1
        # B: RETRY while the probe is out, HIT_PENDING while the read is verified, then HIT.
        answers = b.settle(7, ReqContext(req_id="b"))
        assert answers[0] is RETRY and PENDING in answers and answers[-1] is HIT, answers
        assert b.remote.stats()["probes"] == 1
        assert b.load(7) == bytes([7]) * CHUNK
        assert b.mg.counters.loads_remote == 1 and b.mg.counters.loads_cpu == 0
        # B's own reuse: the store holds it already, nothing written twice.
        b.drain()
        assert cluster.dbsize() == 1
    finally:
        a.close()
        b.close()


def test_a_request_probes_all_its_unknown_chunks_in_one_batch(cluster):
    r = Replica(cluster, slots=8)
    try:
        c = ReqContext(req_id="long")
        # vLLM scans on after RETRY: every chunk of the prompt is asked about in one step.
        assert [r.mg.lookup(key(i), c) for i in range(5)] == [RETRY] * 5
        r.mg.on_schedule_end(None)
        r.remote.wait_idle(WAIT_S)
        s = r.remote.stats()
        assert (s["probes"], s["probe_keys"]) == (1, 5)
        # The store holds none of them: misses now, without asking again.
        assert r.mg.lookup(key(0), c) is MISS
        assert r.remote.stats()["probes"] == 1
    finally:
        r.close()


def test_a_value_that_does_not_verify_is_a_counted_miss_never_loaded(cluster):
    a, b = Replica(cluster, remote_admission="always"), Replica(cluster)
    try:
        a.store(3)
        a.drain()
        assert cluster.dbsize() == 1
        for c in cluster.node_clients():
            for k in c.scan_iter(match=b"kvtier:*"):
                v = bytearray(c.get(k))
                v[-10] ^= 1
                c.set(k, bytes(v))
        answers = b.settle(3, ReqContext(req_id="b"))
        assert answers[-1] is MISS, answers
        assert b.remote.stats()["miss_check"] == 1 and b.mg.counters.loads_remote == 0
        assert b.cpu.state(key(3)) is None, "the failed read left the chunk in the CPU tier"
    finally:
        a.close()
        b.close()


def test_a_cluster_that_is_down_costs_misses_and_the_breaker_opens(tmp_path):
    dead = start_cluster(tmp_path / "dead")
    url = dead.url
    dead.stop()
    cluster = Cluster(dead.nodes)  # its URL only: every node is down
    assert cluster.url == url
    # A clock that stands still: the breaker's cool-down never ends within the test.
    r = Replica(cluster, clock=lambda: 0.0, remote_deadline_s=0.5)
    try:
        for i in range(8):
            answers = r.settle(i, ReqContext(req_id=f"q{i}"))
            assert answers[-1] is MISS, answers
        s = r.remote.stats()
        assert s["probe_errors"] >= 5 and s["breaker_trips"] >= 1, s
        # While open, no lookup waits on the store at all.
        assert r.mg.lookup(key(99), ReqContext(req_id="open")) is MISS
    finally:
        r.close()
