"""The data path with the shared remote tier (the Python API's and TensorRT-LLM's), against a real
3-primary cluster: two replicas, each its own CPU tier, device blocks and transfer engine, share
blocks through the store; the chain continues from the CPU tier (and the disk tier) into the
remote one; a value planted under the right key is a counted miss, never loaded; the remote
tier's admission counts reuse from the CPU tier."""

from __future__ import annotations

import pytest
import torch
from support.valkey import Cluster, make_tier, plain_client, running_cluster

import kvtier_rs as kv
from kvtier_rs._core import DiskTier
from kvtier_rs.orchestrator import CostModel, TierOrchestrator
from kvtier_rs.tiers.remote import RemoteTier, store_key
from kvtier_rs.transfer import BlockLayout, CpuTransferEngine

GPU_BLOCKS = 16
WAIT_S = 60.0  # only spent when the product is broken


class Replica:
    """One serving replica: device blocks (CPU tensors), a CPU tier, a transfer engine and the
    data path over them and the shared store."""

    def __init__(
        self, cluster: Cluster, *, seed: int, cpu_blocks: int = 8, disk_root=None, cost=None, **remote_kw
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tensors = [torch.randn(GPU_BLOCKS, 2, 4, 64, generator=g).to(torch.float16) for _ in range(2)]
        self.layout = BlockLayout.per_layer(self.tensors)
        slot = -(-self.layout.bytes_per_block // 4096) * 4096
        self.host = kv.HostTier(kv.TierConfig(cpu_blocks * slot, self.layout.bytes_per_block))
        self.engine = CpuTransferEngine(self.layout, self.host.pool)
        remote_kw.setdefault("admission", "always")
        self.remote: RemoteTier = make_tier(
            cluster.url,
            password=cluster.password,
            identity="orchestrator-test",
            block_bytes=self.layout.bytes_per_block,
            **remote_kw,
        )
        self.disk = None
        if disk_root is not None:
            self.disk = DiskTier(str(disk_root), 64 * slot, slot, engine="pool")
        self.orch = TierOrchestrator(self.host, self.engine, disk=self.disk, remote=self.remote, cost=cost)

    def block(self, b: int) -> bytes:
        return b"".join(t[b].numpy().tobytes() for t in self.tensors)

    def close(self) -> None:
        self.orch.drain(WAIT_S)
        self.engine.close()
        self.remote.close()
        if self.disk is not None:
            self.disk.close()


@pytest.fixture
def replicas(cluster):
    made: list[Replica] = []

    def make(**kw) -> Replica:
        r = Replica(cluster, seed=len(made), **kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def keys_of(tag: str, n: int) -> list[bytes]:
    return [f"{tag}-{i}".encode() for i in range(n)]


def test_a_chain_stored_by_one_replica_is_loaded_by_another_byte_for_byte(replicas) -> None:
    a, b = replicas(), replicas()
    keys = keys_of("shared", 4)
    a.orch.offload(keys, [3, 5, 7, 9])
    a.orch.drain(WAIT_S)
    want = [a.block(i) for i in (3, 5, 7, 9)]
    assert a.orch.stats()["tiers"]["remote"]["writes"]["completed"] == 4

    assert b.orch.probe(keys, wait_s=WAIT_S), "the probe's answer came in"
    plan = b.orch.plan(keys)
    assert (plan.cpu_hits, plan.disk_hits, plan.remote_hits, plan.load_remote) == (0, 0, 4, 4)
    res = b.orch.load(keys, [0, 1, 2, 3], plan=plan)
    b.orch.drain(WAIT_S)
    assert (res.loaded_remote, res.loaded, res.failed) == (4, 4, 0)
    assert [b.block(i) for i in range(4)] == want
    remote = b.orch.snapshot().tiers.remote
    assert remote is not None
    assert (remote.hits, remote.promotions, remote.lookup_blocks) == (4, 4, 4)
    assert remote.store["hits"] == 4 and remote.store["miss_check"] == 0


def test_the_chain_goes_on_from_the_cpu_tier_into_the_remote_tier(replicas) -> None:
    a, b = replicas(), replicas()
    keys = keys_of("chain", 5)
    a.orch.offload(keys, [1, 2, 3, 4, 5])
    a.orch.drain(WAIT_S)
    b.orch.offload(keys[:2], [8, 9])  # B computed the first two blocks itself
    b.orch.drain(WAIT_S)
    b.orch.probe(keys, wait_s=WAIT_S)
    res = b.orch.load(keys, [10, 11, 12, 13, 14])
    b.orch.drain(WAIT_S)
    assert (res.plan.cpu_hits, res.plan.remote_hits) == (2, 3)
    assert (res.loaded_cpu, res.loaded_remote, res.failed) == (2, 3, 0)
    assert [b.block(i) for i in (12, 13, 14)] == [a.block(i) for i in (3, 4, 5)]


def test_a_remote_hit_slower_than_recomputing_is_not_taken_until_reads_say_otherwise(replicas) -> None:
    # Recomputing a block: 16 tokens at 1e6 tokens/s = 16 us. The remote hop starts at its first
    # estimate (1 GB/s, 1 ms): slower, so the store's hits are recomputed.
    cost = CostModel(prefill_tokens_per_s=1e6, tokens_per_block=16, block_bytes=1, latency_s={"cpu": 0.0, "disk": 0.0})
    a, b = replicas(), replicas(cost=cost)
    cost.block_bytes = b.layout.bytes_per_block
    keys = keys_of("slow", 2)
    a.orch.offload(keys, [0, 1])
    a.orch.drain(WAIT_S)
    b.orch.probe(keys, wait_s=WAIT_S)
    plan = b.orch.plan(keys)
    assert (plan.remote_hits, plan.load_remote) == (2, 0)
    assert plan.refused == {"remote": {"cost": 2}}
    assert b.orch.stats()["tiers"]["remote"]["refused"]["cost"] == 2
    # Reads measured fast (and with no latency) make loading worth it.
    cost.latency_s["remote"] = 0.0
    for _ in range(50):
        cost.observe("remote", 10**9, 1e-3)
    assert b.orch.plan(keys).load_remote == 2


def test_a_plan_asks_the_store_and_the_next_plan_counts_the_answer(replicas) -> None:
    a, b = replicas(), replicas()
    keys = keys_of("later", 3)
    a.orch.offload(keys, [0, 1, 2])
    a.orch.drain(WAIT_S)
    first = b.orch.plan(keys)
    assert first.remote_hits == 0, "nothing learned yet: a miss, and a probe is sent"
    assert b.remote.wait_idle(WAIT_S)
    assert b.orch.plan(keys).remote_hits == 3


def test_the_disk_tier_comes_before_the_remote_tier_in_the_chain(replicas, tmp_path) -> None:
    a, b = replicas(), replicas(disk_root=tmp_path / "disk")
    keys = keys_of("tiers", 6)
    a.orch.offload(keys, list(range(6)))
    a.orch.drain(WAIT_S)
    # B's disk holds the first three blocks (written through, then pushed out of its 4-slot CPU
    # tier by other blocks); the store holds all six.
    b.orch.offload(keys[:3], [0, 1, 2])
    b.orch.drain(WAIT_S)
    b.orch.offload(keys_of("filler", 8), list(range(3, 11)))
    b.orch.drain(WAIT_S)
    b.orch.probe(keys, wait_s=WAIT_S)
    plan = b.orch.plan(keys)
    assert (plan.cpu_hits, plan.disk_hits, plan.remote_hits) == (0, 3, 3)
    res = b.orch.load(keys, [10, 11, 12, 13, 14, 15], plan=plan)
    b.orch.drain(WAIT_S)
    assert (res.loaded_disk, res.loaded_remote, res.failed, res.unreserved) == (3, 3, 0, 0)
    assert [b.block(i) for i in range(10, 13)] == [b.block(i) for i in range(3)], "B's own, from its disk"
    assert [b.block(i) for i in range(13, 16)] == [a.block(i) for i in range(3, 6)], "A's, from the store"


def test_a_staged_part_with_no_cpu_slot_cuts_the_chain_there(replicas, tmp_path) -> None:
    a, b = replicas(), replicas(disk_root=tmp_path / "disk", cpu_blocks=4)
    keys = keys_of("room", 6)
    a.orch.offload(keys, list(range(6)))
    a.orch.drain(WAIT_S)
    b.orch.offload(keys[:3], [0, 1, 2])
    b.orch.drain(WAIT_S)
    b.orch.offload(keys_of("filler", 4), [4, 5, 6, 7])
    b.orch.drain(WAIT_S)
    b.orch.probe(keys, wait_s=WAIT_S)
    reservation = b.orch.reserve(keys, request_id="r")
    assert (reservation.disk, reservation.remote, reservation.blocks) == (3, 0, 3), (
        "4 CPU slots: no room after the disk part"
    )
    res = b.orch.bind("r", [10, 11, 12, 13, 14, 15])
    b.orch.drain(WAIT_S)
    assert (res.loaded_disk, res.loaded_remote, res.unreserved, res.failed) == (3, 0, 3, 0)


def test_a_value_planted_under_the_right_key_is_a_counted_miss_never_loaded(replicas, cluster) -> None:
    a, b = replicas(), replicas()
    keys = keys_of("planted", 4)
    a.orch.offload(keys, [0, 1, 2, 3])
    a.orch.drain(WAIT_S)
    # Another program overwrites block 2's value: the right key, a value that is not kvtier's.
    client = plain_client(cluster)
    skey = store_key(a.remote.prefix, a.remote.format.namespace, keys[2])
    client.set(skey, b"\x00" * len(client.get(skey)))
    before = b.block(12)
    b.orch.probe(keys, wait_s=WAIT_S)
    res = b.orch.load(keys, [10, 11, 12, 13])
    b.orch.drain(WAIT_S)
    assert res.plan.remote_hits == 4
    assert (res.loaded_remote, res.failed) == (2, 2), "the chain stops at the bad block"
    assert [b.block(10), b.block(11)] == [a.block(0), a.block(1)]
    assert b.block(12) == before, "the bad block's bytes never reach the device"
    assert b.remote.stats()["miss_foreign"] == 1, "not a kvtier value: counted by its reason"
    assert b.orch.stats()["tiers"]["remote"]["promotion_blocks_failed"] == 1


def test_uses_k_admission_stores_a_block_once_it_is_reused_from_the_cpu_tier(replicas) -> None:
    a = replicas(admission="uses:2")
    keys = keys_of("reused", 3)
    a.orch.offload(keys, [0, 1, 2])
    a.orch.drain(WAIT_S)
    st = a.remote.stats()
    assert (st["writes_ok"], st["writes_refused_admission"]) == (0, 3), "stored once: no reuse yet"
    res = a.orch.load(keys, [5, 6, 7])
    a.orch.drain(WAIT_S)
    assert res.loaded_cpu == 3
    assert a.remote.stats()["writes_ok"] == 3, "reused from the CPU tier: the store receives them"


def test_a_dead_store_is_misses_and_the_cpu_tier_serves_on(tmp_path) -> None:
    with running_cluster(tmp_path) as cluster:
        a = Replica(cluster, seed=0, deadline_s=2.0)
        for i in range(len(cluster.nodes)):
            cluster.kill(i)
        try:
            _serves_on_without_the_store(a)
        finally:
            a.close()


def _serves_on_without_the_store(a: Replica) -> None:
    keys = keys_of("dead", 3)
    a.orch.offload(keys, [0, 1, 2])
    a.orch.drain(WAIT_S)
    a.orch.probe(keys_of("other", 2), wait_s=WAIT_S)
    plan = a.orch.plan([*keys, *keys_of("other", 2)])
    assert (plan.cpu_hits, plan.remote_hits) == (3, 0)
    res = a.orch.load(keys, [5, 6, 7])
    a.orch.drain(WAIT_S)
    assert res.loaded_cpu == 3 and res.failed == 0
    assert a.remote.stats()["write_errors"] + a.remote.stats()["probe_errors"] >= 1
