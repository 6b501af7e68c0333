"""kvtier's shared remote tier as a vLLM secondary tier (``KvtierRemoteTier``), on a real 3-primary
cluster: in place over a primary region laid out as vLLM's (an mmap, one row per chunk), the
lookup contract (RETRY, one batched probe per scheduler step sent at its end, then HIT or MISS),
stores and promotions through vLLM's job interface, the namespace shared with
KvtierOffloadingSpec's remote tier, a cache reset, the metrics and the entry's checks. Two
engines sharing a prompt through it run as `vllm serve` processes, as users run them
(test_vllm_serve.py).
"""

from __future__ import annotations

import hashlib
import mmap
import time
from types import SimpleNamespace

import numpy as np
import pytest
from support.vllm import engine as E

E.require_vllm()

from vllm.v1.kv_offload.base import Locality, LookupResult, ReqContext, ScheduleEndContext  # noqa: E402
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402

from kvtier_rs._core import InvalidArgumentError  # noqa: E402
from kvtier_rs.integrations.vllm import metrics as m  # noqa: E402
from kvtier_rs.integrations.vllm.options import parse_options  # noqa: E402
from kvtier_rs.integrations.vllm.secondary import KvtierRemoteTier  # noqa: E402
from kvtier_rs.integrations.vllm.tier_identity import layout_identity  # noqa: E402
from kvtier_rs.tiers.remote.build import open_remote_tier  # noqa: E402

ROW = 8192
ROWS = 8
WAIT_S = 60.0
HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
STEP_END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest() + (0).to_bytes(4, "big")


def vllm_config(model: str = "tiny-model") -> SimpleNamespace:
    """What layout_identity reads of vLLM's OffloadingConfig."""
    return SimpleNamespace(
        model=SimpleNamespace(name=model, dtype="torch.float32"),
        cache=SimpleNamespace(tokens_per_hash=32, blocks_per_chunk=1),
        groups=[SimpleNamespace(tokens_per_block=32, layer_names=["l0", "l1"])],
        kv_cache_layout="NHD",
        parallel=SimpleNamespace(tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, data_parallel_size=1),
        replicated_layout=False,
        canonical_layout=False,
    )


class Primary:
    """vLLM's primary region as a secondary tier sees it: a (rows, row bytes) view of an mmap."""

    def __init__(self) -> None:
        self.mm = mmap.mmap(-1, ROWS * ROW)
        self.view = memoryview(self.mm).cast("B", (ROWS, ROW))
        self.rows = np.frombuffer(self.mm, dtype=np.uint8).reshape(ROWS, ROW)


@pytest.fixture
def tiers(cluster):
    """Opens KvtierRemoteTiers (each a replica's) over their own primary regions; shuts them down."""
    made: list[KvtierRemoteTier] = []

    def make(**entry) -> tuple[KvtierRemoteTier, Primary]:
        p = Primary()
        spec = SimpleNamespace(config=vllm_config())
        t = KvtierRemoteTier(spec, p.view, "KvtierRemoteTier", remote_url=cluster.url, remote_deadline_s=10.0, **entry)
        made.append(t)
        return t, p

    yield make
    for t in made:
        t.shutdown()


_job_ids = iter(range(1, 1 << 30))


def job(keys: list[bytes], rows: list[int], promotion: bool) -> TransferJob:
    return TransferJob(next(_job_ids), keys, np.asarray(rows, dtype=np.int64), promotion, ReqContext(req_id="r"))


def finished(t: KvtierRemoteTier, job_id: int):
    end = time.monotonic() + WAIT_S
    while time.monotonic() < end:
        for r in t.get_finished_jobs():
            if r.job_id == job_id:
                return r
        time.sleep(0.01)
    raise AssertionError(f"job {job_id} never finished")


def store(t: KvtierRemoteTier, p: Primary, ids: list[int]) -> None:
    """Cascade chunks `ids` (bytes = i) from rows 0.. as vLLM does."""
    for row, i in enumerate(ids):
        p.rows[row] = i
    j = job([key(i) for i in ids], list(range(len(ids))), promotion=False)
    t.submit_store(j)
    assert finished(t, j.job_id).success


def settle(t: KvtierRemoteTier) -> None:
    """Step until the tier has no pending work (its probe answered), as the engine does."""
    end = time.monotonic() + WAIT_S
    while t.has_pending_work():
        t.on_schedule_end(STEP_END)
        list(t.get_finished_jobs())
        assert time.monotonic() < end, "the probe was never answered"
        time.sleep(0.01)


def test_in_place_over_the_primary_rows_with_remote_locality(tiers):
    t, p = tiers()
    assert t.locality is Locality.REMOTE
    assert t.pool is not None and t.pool.wrapped and t.pool.ptr == p.rows.ctypes.data
    assert (t.pool.slot_bytes, t.pool.num_slots) == (ROW, ROWS)
    assert KvtierRemoteTier.medium.name == "STORAGE"
    t2, _ = tiers(locality="LOCAL")
    assert t2.locality is Locality.LOCAL


def test_lookups_never_wait_one_probe_per_step_then_hit_or_miss(cluster, tiers):
    a, pa = tiers()
    store(a, pa, [1, 2, 3])
    assert cluster.dbsize() == 3
    # The writer learned what it wrote: a HIT without asking the store.
    assert a.lookup(key(1), ReqContext(req_id="x")) is HIT

    b, pb = tiers()  # another replica: it knows nothing of the store
    c = ReqContext(req_id="q")
    assert [b.lookup(key(i), c) for i in (1, 2, 9)] == [RETRY] * 3
    assert b.lookup(key(1), c) is RETRY  # asked twice in one step: queued once
    assert b.has_pending_work(), "a queued probe must keep the engine stepping"
    assert b.remote.stats()["probes"] == 0, "nothing is sent before the step ends"
    b.on_schedule_end(STEP_END)
    assert b.remote.stats()["probes"] == 1 and b.remote.stats()["probe_keys"] == 3
    settle(b)
    assert [b.lookup(key(i), c) for i in (1, 2, 9)] == [HIT, HIT, MISS]
    assert b.counters["lookups_deferred"] == 4

    # vLLM promotes the hits into rows it allocated: verified bytes land in them in place.
    pb.rows[5:7] = 0xEE
    j = job([key(1), key(2)], [5, 6], promotion=True)
    b.submit_load(j)
    r = finished(b, j.job_id)
    assert r.success and r.successful_keys is None
    assert (pb.rows[5] == 1).all() and (pb.rows[6] == 2).all()
    assert b.counters["loads"] == 2 and b.counters["failed_reads"] == 0


def test_a_chunk_gone_from_the_store_fails_its_promotion(cluster, tiers):
    a, pa = tiers()
    store(a, pa, [4, 5])
    cluster.flushall()
    j = job([key(4), key(5)], [2, 3], promotion=True)
    a.submit_load(j)
    r = finished(a, j.job_id)
    assert not r.success and list(r.successful_keys) == []
    assert a.counters["failed_reads"] == 2


def test_the_namespace_is_the_one_kvtier_offloading_spec_uses(cluster, tiers):
    """A replica under KvtierOffloadingSpec (its remote tier opened as RemoteLayer opens it)
    finds what a KvtierRemoteTier stored, under the same keys."""
    a, pa = tiers()
    store(a, pa, [7])
    opts = parse_options({"cpu_bytes_to_use": ROWS * ROW, "remote_url": cluster.url})
    assert opts.remote is not None
    other = open_remote_tier(opts.remote, ROW, layout_identity(vllm_config(), ROW))
    try:
        assert other.probe([key(7)])
        assert other.wait_idle(WAIT_S)
        assert other.known(key(7)) is True
    finally:
        other.close()
    # Another model's replica shares nothing.
    stranger = open_remote_tier(opts.remote, ROW, layout_identity(vllm_config("other-model"), ROW))
    try:
        assert stranger.probe([key(7)]) and stranger.wait_idle(WAIT_S)
        assert stranger.known(key(7)) is False
    finally:
        stranger.close()


def test_an_open_breaker_is_a_miss_without_a_probe(tiers):
    t, _ = tiers()
    for _ in range(20):
        t.remote.breaker.failed()
    assert t.lookup(key(1), ReqContext(req_id="b")) is MISS
    t.on_schedule_end(STEP_END)
    assert t.remote.stats()["probes"] == 0


def test_a_cache_reset_switches_the_tier_off(cluster, tiers):
    t, p = tiers()
    store(t, p, [1])
    t.drain_jobs()  # what vLLM's reset_cache calls
    assert t.off_reason is not None
    assert t.lookup(key(1), ReqContext(req_id="z")) is MISS
    p.rows[0] = 9
    j = job([key(9)], [0], promotion=False)
    t.submit_store(j)
    assert finished(t, j.job_id).success
    assert cluster.dbsize() == 1, "a tier switched off stores nothing"
    values = t.get_stats().data["data"]
    assert values[m.PREFIX + "remote_switched_off"][("remote",)] == 1


def test_its_metrics_are_the_remote_tiers_series(tiers):
    t, p = tiers()
    store(t, p, [1, 2])
    defs = KvtierRemoteTier.build_metric_definitions({})
    assert {k.removeprefix(m.PREFIX) for k in defs} == m.REMOTE_SERIES
    values = t.get_stats().data["data"]
    assert set(values) <= set(defs)
    assert values[m.PREFIX + "remote_writes"][("remote",)] == 2
    assert values[m.PREFIX + "remote_breaker_state"][("remote",)] == 0
    # Reported as deltas: nothing new, nothing counted again.
    assert t.get_stats().data["data"].get(m.PREFIX + "remote_writes", {}).get(("remote",), 0) == 0


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({}, "secondary_tiers[type=KvtierRemoteTier]['remote_url']: required"),
        ({"remote_url": "http://h:1"}, "secondary_tiers[type=KvtierRemoteTier]['remote_url']: "),
        ({"remote_url": "redis://h:1", "disk_root": "/kv"}, "secondary_tiers[type=KvtierRemoteTier]['disk_root']: "),
        ({"remote_url": "redis://h:1", "locality": "NEAR"}, "secondary_tiers[type=KvtierRemoteTier]['locality']: "),
    ],
)
def test_a_bad_entry_is_refused_naming_the_key(entry, message):
    p = Primary()
    with pytest.raises(InvalidArgumentError) as e:
        KvtierRemoteTier(SimpleNamespace(config=vllm_config()), p.view, "KvtierRemoteTier", **entry)
    assert str(e.value).startswith(message), str(e.value)


# ---- one in-process engine pair -------------------------------------------------------------
