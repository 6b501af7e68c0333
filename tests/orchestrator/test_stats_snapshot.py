"""`TierOrchestrator.snapshot()`, the typed stats, against `stats()`, the mapping dashboards and
scripts read: after real stores and loads through a CPU tier and a disk tier, the mapping is the
snapshot's `as_dict()`, its figures are the counts of what moved, and every key of the mapping,
at every depth, is a field of the snapshot (in the fields' order), so the two cannot drift."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import pytest
import torch

import kvtier_rs as kv
from kvtier_rs._core import DiskTier
from kvtier_rs.orchestrator import CostModel, DataPathSnapshot, GuardRule, TierOrchestrator
from kvtier_rs.orchestrator.stats import DiskTierSnapshot, GuardSnapshot
from kvtier_rs.tiers.events import EventStream
from kvtier_rs.transfer import BlockLayout, CpuTransferEngine

CPU_BLOCKS = 8
DISK_BLOCKS = 64
GPU_BLOCKS = 32


def make(tmp_path, *, disk: bool = True, **kw: Any) -> TierOrchestrator:
    torch.manual_seed(0)
    layers = [torch.randn(GPU_BLOCKS, 2, 4, 2, 8, dtype=torch.float16) for _ in range(2)]
    layout = BlockLayout.per_layer(layers)
    slot = -(-layout.bytes_per_block // 4096) * 4096
    host = kv.HostTier(kv.TierConfig(CPU_BLOCKS * slot, layout.bytes_per_block))
    engine = CpuTransferEngine(layout, host.pool)
    tier = None
    if disk:
        tier = DiskTier(str(tmp_path / "disk"), DISK_BLOCKS * host.pool.slot_bytes, host.pool.slot_bytes, engine="pool")
    return TierOrchestrator(host, engine, disk=tier, **kw)


def round_trip(orch: TierOrchestrator) -> None:
    """6 blocks stored, pushed out of the CPU tier by 8 others, loaded back with 1 block more
    that no tier holds."""
    keys = [f"chain-{i}".encode() for i in range(6)]
    orch.offload(keys, list(range(6)))
    orch.drain()
    orch.offload([f"other-{i}".encode() for i in range(8)], list(range(6, 14)))
    orch.drain()
    request = [*keys, b"never-stored"]
    plan = orch.plan(request)
    orch.load(request, list(range(20, 27)), request_id="r", plan=plan)
    (res,) = orch.drain()
    assert (res.loaded_cpu, res.loaded_disk, res.failed) == (plan.cpu_hits, plan.disk_hits, 0)


def full(tmp_path) -> TierOrchestrator:
    """Every optional part on: guards, a cost model that always loads, an event stream."""
    cost = CostModel(prefill_tokens_per_s=1.0, tokens_per_block=4, block_bytes=4096)
    rule = GuardRule(p99_ms=1e6, min_samples=1)
    return make(tmp_path, cost=cost, guards={"cpu": rule, "disk": rule}, events=EventStream())


def same_order(a: Any, b: Any) -> bool:
    """Equal and, at every depth, with the keys in the same order (dashboards print them)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same_order(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(same_order(x, y) for x, y in zip(a, b, strict=True))
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def test_the_snapshot_is_the_mapping_and_counts_the_round_trip(tmp_path):
    orch = full(tmp_path)
    round_trip(orch)
    snap = orch.snapshot()
    assert isinstance(snap, DataPathSnapshot)
    assert snap.as_dict() == orch.stats()
    assert same_order(snap.as_dict(), orch.stats())
    assert same_order(orch.snapshot(histograms=True).as_dict(), orch.stats(histograms=True))

    # One lookup of 7 blocks: nothing on the GPU or in the CPU tier, 6 on disk, 1 miss.
    assert (snap.lookups, snap.misses, snap.load_failed, snap.load_timed_out) == (1, 1, 0, 0)
    gpu, cpu, disk = snap.tiers.gpu, snap.tiers.cpu, snap.tiers.disk
    assert disk is not None
    assert (gpu.lookup_blocks, gpu.hits) == (7, 0)
    assert (cpu.lookup_blocks, cpu.hits, cpu.promotions) == (7, 0, 0)
    assert (disk.lookup_blocks, disk.hits, disk.promotions) == (7, 6, 6)
    assert sum(cpu.refused.values()) == sum(disk.refused.values()) == 0
    # 14 blocks stored in the CPU tier, each written through to disk.
    assert (cpu.stored, cpu.store_failed, cpu.store_no_space) == (14, 0, 0)
    assert (disk.writes.submitted, disk.writes.completed, disk.writes.failed) == (14, 14, 0)
    assert disk.store_refused.as_dict() == {"admission": 0, "no_space": 0, "backpressure": 0, "unavailable": 0}
    assert (cpu.store_refused.admission, cpu.store_refused.no_space) == (0, 0)
    block = cpu.block_bytes
    assert (snap.bytes.d2h, snap.bytes.h2d) == (14 * block, 6 * block)
    assert cpu.evictions == cpu.index["evictions"] >= 6
    assert (cpu.capacity_bytes, cpu.usage_bytes, cpu.pinned_bytes) == (
        CPU_BLOCKS * block,
        cpu.index["resident_blocks"] * block,
        0,
    )
    assert disk.usage_bytes == 14 * disk.block_bytes and disk.pinned_bytes == 0
    assert (cpu.promotions_in_flight, disk.promotions_in_flight, disk.write_backlog) == (0, 0, 0)
    assert disk.load_latency.p99 > 0 and disk.read_latency.p50 > 0 and cpu.store_latency.p50 > 0
    # The histograms come only when asked for (the collector asks).
    assert cpu.load_histogram is None and "load_histogram" not in snap.as_dict()["tiers"]["cpu"]
    hist = orch.snapshot(histograms=True).tiers.disk
    assert hist is not None and hist.load_histogram is not None and hist.load_histogram[1] == 1

    assert set(snap.guards) == {"cpu", "disk"}
    assert (snap.guards["disk"].state, snap.guards["disk"].trips, snap.guards["disk"].threshold_ms) == (
        "active",
        0,
        1e6,
    )
    assert snap.cost_model is not None and snap.cost_model.bandwidth.keys() == {"cpu", "disk"}
    dropped = snap.latency_samples_dropped
    assert (dropped.cpu_load, dropped.disk_load, dropped.cpu_store, dropped.disk_read, dropped.disk_write) == (
        0,
        0,
        0,
        0,
        0,
    )
    assert snap.events is not None and snap.events.dropped == 0 and sum(snap.events.published.values()) > 0

    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.lookups = 0  # type: ignore[misc]


def test_without_a_disk_tier_or_optional_parts(tmp_path):
    orch = make(tmp_path, disk=False)
    orch.offload([b"a", b"b"], [0, 1])
    orch.drain()
    snap = orch.snapshot()
    assert snap.tiers.disk is None and snap.cost_model is None and snap.events is None and snap.guards == {}
    assert snap.latency_samples_dropped.disk_read is None
    s = orch.stats()
    assert snap.as_dict() == s and same_order(snap.as_dict(), s)
    assert list(s["tiers"]) == ["gpu", "cpu"] and s["cost_model"] is None and s["events"] is None
    assert list(s["latency_samples_dropped"]) == ["cpu_load", "disk_load", "cpu_store"]
    assert snap.tiers.cpu.stored == 2 and snap.bytes.d2h == 2 * snap.tiers.cpu.block_bytes


def fields_cover(node: Any, plain: Any, path: str = "stats()") -> None:
    """Walks the mapping alongside the snapshot: every key of a snapshot's mapping is one of its
    fields, in the fields' order; a field without a key is one left out while None."""
    if dataclasses.is_dataclass(node):
        assert isinstance(plain, dict), path
        names = [f.name for f in dataclasses.fields(node)]
        unknown = [k for k in plain if k not in names]
        assert not unknown, f"{path}: keys without a field: {unknown}"
        assert list(plain) == [n for n in names if n in plain], f"{path}: keys out of the fields' order"
        for name in names:
            if name not in plain:
                assert getattr(node, name) is None, f"{path}.{name}: a field missing from the mapping"
            else:
                fields_cover(getattr(node, name), plain[name], f"{path}.{name}")
    elif isinstance(node, Mapping):
        assert isinstance(plain, dict) and list(plain) == list(node), path
        for k in node:
            fields_cover(node[k], plain[k], f"{path}[{k!r}]")
    elif isinstance(node, tuple) and all(dataclasses.is_dataclass(n) for n in node):  # guard trips
        assert isinstance(plain, list) and len(plain) == len(node), path
        for i, (n, p) in enumerate(zip(node, plain, strict=True)):
            fields_cover(n, p, f"{path}[{i}]")
    else:
        assert same_order(node, plain), f"{path}: {node!r} != {plain!r}"


@pytest.mark.parametrize("histograms", [False, True])
@pytest.mark.parametrize("disk", [True, False])
def test_every_key_of_stats_maps_to_a_field(tmp_path, disk, histograms):
    cost = CostModel(prefill_tokens_per_s=1.0, tokens_per_block=4, block_bytes=4096)
    orch = make(tmp_path, disk=disk, cost=cost, guards={"cpu": GuardRule(p99_ms=1e6)}, events=EventStream())
    if disk:
        round_trip(orch)
    snap = orch.snapshot(histograms=histograms)
    plain = orch.stats(histograms=histograms)
    fields_cover(snap, plain)
    # The two walks agree on the figures too, not only the keys (nothing moves between them).
    fields_cover(snap, snap.as_dict())


def test_stats_keeps_the_keys_it_always_had(tmp_path):
    """The mapping's shape, written out: a key renamed or dropped in the snapshot breaks the
    dashboards and scripts reading `stats()`, so it fails here first. Keys may be added."""
    orch = full(tmp_path)
    round_trip(orch)
    s = orch.stats(histograms=True)
    assert list(s) == [
        "lookups",
        "misses",
        "load_failed",
        "load_released",
        "load_unreserved",
        "load_timed_out",
        "bytes",
        "tiers",
        "guards",
        "cost_model",
        "latency_samples_dropped",
        "events",
    ]
    assert list(s["bytes"]) == ["d2h", "h2d"]
    assert list(s["tiers"]) == ["gpu", "cpu", "disk"]
    assert list(s["tiers"]["gpu"]) == ["hits", "lookup_blocks"]
    occupancy = ["block_bytes", "capacity_bytes", "usage_bytes", "pinned_bytes"]
    assert list(s["tiers"]["cpu"]) == [
        "hits",
        "promotions",
        "stored",
        "store_failed",
        "store_no_space",
        "store_index_failed",
        "refused",
        "load_latency",
        "store_latency",
        "index",
        "lookup_blocks",
        "evictions",
        "store_refused",
        "promotions_in_flight",
        *occupancy,
        "load_histogram",
        "store_histogram",
    ]
    assert list(s["tiers"]["cpu"]["store_refused"]) == ["admission", "no_space"]
    assert list(s["tiers"]["cpu"]["load_latency"]) == ["p50", "p95", "p99"]
    assert list(s["tiers"]["disk"]) == [
        "hits",
        "promotions",
        "refused",
        "load_latency",
        "read_latency",
        "write_latency",
        "writes",
        "promotion_blocks_failed",
        "index",
        "lookup_blocks",
        "evictions",
        "store_refused",
        "promotions_in_flight",
        "write_backlog",
        *occupancy,
        "load_histogram",
        "store_histogram",
        "read_histogram",
    ]
    assert list(s["tiers"]["disk"]["writes"]) == [
        "submitted",
        "completed",
        "failed",
        "refused",
        "no_space",
        "dropped_backlog",
        "dropped_evicted",
        "dropped_index_failed",
        "not_started",
    ]
    assert list(s["tiers"]["disk"]["store_refused"]) == ["admission", "no_space", "backpressure", "unavailable"]
    assert list(s["guards"]["cpu"]) == [
        "tier",
        "state",
        "trips",
        "p99_ms",
        "threshold_ms",
        "bypassed_for_s",
        "recent_trips",
        "dropped_samples",
        "samples",
    ]
    assert list(s["cost_model"]) == ["bandwidth", "observations_dropped", "observations_skipped", "probes"]
    assert list(s["latency_samples_dropped"]) == ["cpu_load", "disk_load", "cpu_store", "disk_read", "disk_write"]
    assert list(s["events"]) == ["published", "dropped", "queued", "capacity", "last_seq"]


def test_a_guard_only_the_request_rule_covers_keeps_its_shorter_mapping():
    """`LoadGate.state` reports a tier only the request-level rule guards without the SLO
    guard's own keys; its snapshot leaves them None and the mapping without them."""
    state = {"tier": "disk", "state": "bypassed", "trips": 1, "p99_ms": 0.0, "request_rule": {"tier": "disk"}}
    g = GuardSnapshot.of(state)
    assert g.threshold_ms is None and g.recent_trips is None and g.request_rule == {"tier": "disk"}
    assert same_order(g.as_dict(), state)
    tripped = {
        "tier": "cpu",
        "state": "bypassed",
        "trips": 1,
        "p99_ms": 5.0,
        "threshold_ms": 1.0,
        "bypassed_for_s": 30.0,
        "recent_trips": [{"at": 1.0, "at_unix": 2.0, "p99_ms": 5.0}],
        "dropped_samples": 0,
        "samples": 0,
    }
    g = GuardSnapshot.of(tripped)
    assert g.recent_trips is not None and g.recent_trips[0].p99_ms == 5.0
    assert same_order(g.as_dict(), tripped)


def test_the_disk_tier_snapshot_is_typed_apart_from_the_cpu_tier(tmp_path):
    orch = make(tmp_path)
    tiers = orch.snapshot().tiers
    assert isinstance(tiers.disk, DiskTierSnapshot) and not isinstance(tiers.cpu, DiskTierSnapshot)
