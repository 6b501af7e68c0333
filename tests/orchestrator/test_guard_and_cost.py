"""The SLO guard, the cost model and the latency recorder on their own and under the
orchestrator: thread safety, probation, bad settings and bad measurements, the bound on kept
trips, and what a load split into region groups tells the cost model. No assertion depends on
how fast this machine is: clocks are fake where time matters, and measured seconds are replaced
by fixed ones where the cost model's arithmetic is checked."""

from __future__ import annotations

import dataclasses
import math
import random
import sys
import threading
import time
from fractions import Fraction

import numpy as np
import pytest
import torch
from support.disk import HeldReads

import kvtier_rs as kv
from kvtier_rs.orchestrator import CostModel, GuardRule, LatencyRecorder, SloGuard, TierOrchestrator
from kvtier_rs.orchestrator.cost import OPTIONAL_HOPS
from kvtier_rs.transfer import BlockLayout, CpuTransferEngine

NAN, INF = float("nan"), float("inf")
#: Slack for float rounding in differences of perf_counter readings (seconds since boot): far
#: below any duration a test here tells apart, far above the rounding at any uptime.
CLOCK_TOLERANCE_S = 1e-6


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def orchestrator(*, layers=2, gpu_blocks=32, cpu_blocks=16, engine_cls=CpuTransferEngine, **kw):
    tensors = [torch.randn(gpu_blocks, 2, 8, 32) for _ in range(layers)]
    layout = BlockLayout.per_layer(tensors)
    slot = -(-layout.bytes_per_block // 4096) * 4096
    host = kv.HostTier(kv.TierConfig(cpu_blocks * slot, layout.bytes_per_block))
    return TierOrchestrator(host, engine_cls(layout, host.pool), **kw)


# ---- 1. thread safety ------------------------------------------------------------------------
@pytest.mark.parametrize("window_s", [1e-4, 3600.0])
def test_guard_record_and_stats_race_without_errors(window_s):
    """The engine thread records promotion latencies while a scrape thread reads stats(). A
    sub-millisecond window makes record() expire samples as the scrape expires them (the race
    that raised IndexError on the engine thread); a long one keeps a long window for the scrape
    to iterate while record() appends (HTTP 500: deque mutated during iteration)."""
    orch = orchestrator(guards={"cpu": GuardRule(p99_ms=1e6, window_s=window_s, min_samples=10**9)})
    guard = orch.guards["cpu"]
    errors: list[str] = []
    scrapes = 0
    done = threading.Event()

    def engine():
        try:
            i = 0
            # Until the scrape thread has had its turns too (bounded: the test cannot hang).
            while (i < 30_000 or scrapes < 200) and i < 300_000 and not errors:
                guard.record(0.001)
                if i % 64 == 0:
                    guard.allows()
                i += 1
        except Exception as e:  # noqa: BLE001 - the assertion below reports it
            errors.append(f"engine thread: {e!r}")
        finally:
            done.set()

    def scrape():
        nonlocal scrapes
        try:
            while not done.is_set():
                # What a scrape reads (stats() -> guard.state()), mostly the guard's part of it.
                orch.stats() if scrapes % 16 == 0 else guard.state()
                scrapes += 1
        except Exception as e:  # noqa: BLE001
            errors.append(f"scrape thread: {e!r}")

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # switch threads often (the default is 5 ms)
    try:
        threads = [threading.Thread(target=engine), threading.Thread(target=scrape)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors
    assert orch.stats()["guards"]["cpu"]["state"] == "active"


# ---- 2. probation ----------------------------------------------------------------------------
def tripped_guard(clock: FakeClock) -> SloGuard:
    g = SloGuard("cpu", GuardRule(p99_ms=10, window_s=60, recover_s=5, min_samples=20), clock=clock)
    for _ in range(20):
        g.record(0.5)
        clock.t += 0.01
    assert g.state()["state"] == "bypassed" and g.state()["trips"] == 1
    return g


def test_probation_starts_with_an_empty_window_and_needs_min_samples_fresh_samples():
    clock = FakeClock()
    g = tripped_guard(clock)
    for _ in range(19):  # loads that were in flight at the trip land while bypassed
        g.record(0.5)
        clock.t += 0.01
    clock.t += 5.0
    assert g.allows(), "back on probation after recover_s"
    g.record(0.001)  # one fast promotion on probation
    st = g.state()
    assert (st["state"], st["trips"]) == ("active", 1), "the bypassed samples did not count"
    assert st["p99_ms"] == pytest.approx(1.0), "the window holds the one fresh sample only"
    for _ in range(18):  # 19 fresh samples, p99 far over: still fewer than min_samples
        clock.t += 0.01
        g.record(0.5)
    assert g.allows() and g.state()["trips"] == 1
    clock.t += 0.01
    g.record(0.5)  # the 20th fresh sample
    assert not g.allows() and g.state()["trips"] == 2


def test_a_load_in_flight_at_the_trip_that_lands_after_probation_is_not_counted():
    clock = FakeClock()
    g = tripped_guard(clock)
    tripped_at = g.trips[-1]["at"]
    clock.t = tripped_at + 6  # past recover_s
    assert g.allows()
    g.record(7.0)  # started 7 s ago: before the trip
    assert g.state()["p99_ms"] == 0.0, "a stale sample is not in the probation window"
    for _ in range(19):  # with the stale one these would be min_samples slow samples
        clock.t += 0.01
        g.record(0.5)
    assert g.allows() and g.state()["trips"] == 1


# ---- 3. bad settings and bad measurements ------------------------------------------------------
@pytest.mark.parametrize("field", ["p99_ms", "window_s", "recover_s"])
@pytest.mark.parametrize("bad", [0, -1.0, NAN, INF, "5", None, True])
def test_guard_rule_thresholds_must_be_finite_positive_numbers(field, bad):
    kw = {"p99_ms": 5.0, field: bad}
    with pytest.raises(kv.InvalidArgumentError, match=f"invalid argument `{field}`: must be a positive finite number"):
        GuardRule(**kw)


@pytest.mark.parametrize("bad", [0, -3, 2.5, 20.0, NAN, INF, "20", None, True])
def test_guard_rule_min_samples_must_be_a_positive_int(bad):
    with pytest.raises(kv.InvalidArgumentError, match="invalid argument `min_samples`: must be a positive int"):
        GuardRule(p99_ms=5, min_samples=bad)


def test_guard_rule_takes_numpy_and_fraction_numbers_as_floats():
    r = GuardRule(p99_ms=np.float32(5), window_s=Fraction(1, 2), recover_s=np.int64(3), min_samples=np.int64(4))
    assert (r.p99_ms, r.window_s, r.recover_s, r.min_samples) == (5.0, 0.5, 3.0, 4)
    assert type(r.window_s) is float and type(r.min_samples) is int


def filled(values, rule=None) -> SloGuard:
    clock = FakeClock()
    g = SloGuard("cpu", rule or GuardRule(p99_ms=5, min_samples=20), clock=clock)
    for v in values:
        g.record(v)
        clock.t += 0.001
    return g


def test_non_finite_and_negative_latencies_are_dropped_and_counted_not_blinding_the_guard():
    g = filled([NAN] + [1.0] * 39)
    st = g.state()
    assert st["state"] == "bypassed" and st["dropped_samples"] == 1
    g = filled([INF, -1.0, -INF] * 10 + [0.001] * 25)
    st = g.state()
    assert (st["state"], st["trips"], st["dropped_samples"]) == ("active", 0, 30)
    assert st["p99_ms"] == pytest.approx(1.0), "only the valid samples are in the window"
    with pytest.raises(kv.InvalidArgumentError, match="`latency_s`"):
        g.record("0.5")
    with pytest.raises(kv.InvalidArgumentError, match="`latency_s`"):
        g.record(None)


def test_one_slow_promotion_does_not_trip_the_guard_two_do():
    # With fewer than 100 samples the p99 is the window's maximum: one outlier is not a tail.
    assert filled([0.001] * 19 + [0.2]).state()["trips"] == 0
    assert filled([0.001] * 98 + [10.0]).state()["trips"] == 0
    assert filled([0.001] * 18 + [0.2, 0.2]).state()["trips"] == 1


def test_the_guard_skips_sorting_only_when_the_p99_cannot_exceed_the_threshold():
    """record() decides without a percentile when too few samples are over the threshold for
    the p99 to be over it (or fewer than MIN_SLOW are). At the boundary (the other samples
    exactly at the threshold, so any over-sample interpolated into the p99 pushes it over) the
    shortcut must never skip a trip."""
    for n in [*range(1, 400), 1000, 1100, 1101, 1102, 4095, 4096, 10_001]:
        for over in {0, 1, max(0, (n - 101) // 100), max(0, (n - 101) // 100) + 1, n}:
            if over > n:
                continue
            clock = FakeClock()
            g = SloGuard("cpu", GuardRule(p99_ms=1000.0, window_s=3600, min_samples=10**9), clock=clock)
            for v in [1.0] * (n - over) + [10.0] * over:  # 1.0 s is exactly the 1000 ms threshold
                g.record(v)
            with g._lock:
                shortcut = g._cannot_trip()
            exact = g.current_p99_ms()
            if shortcut and over >= SloGuard.MIN_SLOW:  # min_samples is huge here
                assert exact <= 1000.0, (n, over, exact)


def test_the_shortcut_and_the_percentile_trip_alike_on_random_latencies():
    rng = random.Random(3)
    for _ in range(40):
        rule = GuardRule(p99_ms=20, window_s=0.5, recover_s=0.2, min_samples=rng.choice([1, 5, 50]))
        clock = FakeClock()
        g = SloGuard("disk", rule, clock=clock)
        trips = []
        for _ in range(600):
            clock.t += rng.expovariate(500)
            slow = rng.random() < rng.choice([0.001, 0.01, 0.05])
            v = rng.uniform(0.02, 0.2) if slow else rng.uniform(0.0, 0.019)
            with g._lock:
                bypassed = g.bypassed_until is not None and clock.t < g.bypassed_until
                stale = clock.t - v < g._tripped_at
                window = [s for t, s in g._samples if t >= clock.t - rule.window_s and not bypassed]
            expect = (
                not bypassed
                and not stale
                and len(window) + 1 >= rule.min_samples
                and sum(s * 1e3 > rule.p99_ms for s in [*window, v]) >= min(SloGuard.MIN_SLOW, rule.min_samples)
                and float(np.percentile([*window, v], 99)) * 1e3 > rule.p99_ms
            )
            before = g.trip_count
            g.record(v)
            assert (g.trip_count > before) == expect
            trips.append(expect)
        assert g.trip_count == sum(trips)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "8", None])
def test_latency_recorder_window_must_be_a_positive_int(bad):
    with pytest.raises(kv.InvalidArgumentError, match="invalid argument `window`: must be a positive int"):
        LatencyRecorder(window=bad)


def test_latency_recorder_drops_and_counts_non_finite_and_negative_samples():
    r = LatencyRecorder()
    r.observe(0.001)
    for bad in (NAN, INF, -INF, -1.0, np.float64(NAN)):
        r.observe(bad)
    for _ in range(1000):
        r.observe(0.002)
    buckets, count, total = r.histogram()
    assert r.dropped == 5
    assert count == 1001 and buckets[-1] == (INF, 1001)
    assert total == pytest.approx(0.001 + 1000 * 0.002)
    assert r.percentiles()["p50"] == pytest.approx(0.002)
    assert dict(buckets)[0.0025] == 1001, "nothing landed in +Inf only"
    with pytest.raises(kv.InvalidArgumentError, match="`seconds`"):
        r.observe("0.1")


def test_orchestrator_stats_show_what_was_dropped():
    orch = orchestrator(
        guards={"cpu": GuardRule(p99_ms=5)},
        cost=CostModel(prefill_tokens_per_s=1e4, tokens_per_block=16, block_bytes=4096),
    )
    orch.latency["cpu_load"].observe(NAN)
    orch.guards["cpu"].record(-1.0)
    orch.cost.observe("cpu", 4096, INF)
    orch.cost.observe("cpu", 4096, 1e-6)  # within the fixed latency: no bandwidth information
    s = orch.stats()
    assert s["latency_samples_dropped"] == {"cpu_load": 1, "disk_load": 0, "cpu_store": 0}
    assert s["guards"]["cpu"]["dropped_samples"] == 1
    assert s["cost_model"]["observations_dropped"] == 1
    assert s["cost_model"]["observations_skipped"] == 1
    assert s["cost_model"]["bandwidth"] == {"cpu": 10e9, "disk": 1e9}


# ---- 7. cost model settings --------------------------------------------------------------------
def cost(**kw) -> CostModel:
    return CostModel(**{"prefill_tokens_per_s": 1e4, "tokens_per_block": 16, "block_bytes": 1 << 20, **kw})


@pytest.mark.parametrize(
    "kw, name",
    [
        ({"bandwidth": {"disk": 1e9}}, "bandwidth"),
        ({"bandwidth": {"cpu": 1e9}}, "bandwidth"),
        ({"bandwidth": {"cpu": 1e9, "disk": 1e9, "gpu": 1e9}}, "bandwidth"),
        ({"bandwidth": 1e9}, "bandwidth"),
        ({"bandwidth": {"cpu": 0, "disk": 1e9}}, r"bandwidth\['cpu'\]"),
        ({"bandwidth": {"cpu": NAN, "disk": 1e9}}, r"bandwidth\['cpu'\]"),
        ({"bandwidth": {"cpu": 1e9, "disk": -1.0}}, r"bandwidth\['disk'\]"),
        ({"bandwidth": {"cpu": "fast", "disk": 1e9}}, r"bandwidth\['cpu'\]"),
        ({"latency_s": {"cpu": 0.0}}, "latency_s"),
        ({"latency_s": {"cpu": NAN, "disk": 2e-4}}, r"latency_s\['cpu'\]"),
        ({"latency_s": {"cpu": INF, "disk": 2e-4}}, r"latency_s\['cpu'\]"),
        ({"latency_s": {"cpu": -1.0, "disk": 2e-4}}, r"latency_s\['cpu'\]"),
        ({"latency_s": {"cpu": 5e-5, "disk": None}}, r"latency_s\['disk'\]"),
        ({"prefill_tokens_per_s": NAN}, "prefill_tokens_per_s"),
        ({"prefill_tokens_per_s": INF}, "prefill_tokens_per_s"),
        ({"prefill_tokens_per_s": "1e4"}, "prefill_tokens_per_s"),
        ({"prefill_tokens_per_s": 10**400}, "prefill_tokens_per_s"),  # beyond a float: inf
        ({"tokens_per_block": 2.5}, "tokens_per_block"),
        ({"tokens_per_block": True}, "tokens_per_block"),
        ({"block_bytes": 0}, "block_bytes"),
        ({"block_bytes": 4096.0}, "block_bytes"),
        ({"alpha": 0}, "alpha"),
        ({"alpha": 1.5}, "alpha"),
        ({"alpha": NAN}, "alpha"),
        ({"alpha": "0.2"}, "alpha"),
    ],
)
def test_cost_model_settings_are_checked_at_construction(kw, name):
    with pytest.raises(kv.InvalidArgumentError, match=f"invalid argument `{name}"):
        cost(**kw)


def test_cost_model_accepts_a_free_hop_and_zero_latency_and_copies_its_dicts():
    bw, lat = {"cpu": INF, "disk": 2e9}, {"cpu": 0.0, "disk": 0}
    c = cost(bandwidth=bw, latency_s=lat)
    assert c.load_seconds("cpu", 10) == 0.0, "an infinite bandwidth is a free hop"
    c.observe("disk", 1 << 30, 0.25)
    assert c.bandwidth["disk"] != 2e9 and bw["disk"] == 2e9, "the caller's dict is not the model's"
    c.observe("cpu", 1 << 30, 0.25)
    assert c.bandwidth["cpu"] == INF, "a free hop stays free"


def test_a_remote_hop_is_priced_through_the_cpu_hop_and_starts_from_defaults():
    bw, lat = {"cpu": 10e9, "disk": 1e9, "remote": 2e9}, {"cpu": 50e-6, "disk": 200e-6, "remote": 1e-3}
    c = cost(bandwidth=bw, latency_s=lat)
    nbytes = 4 << 20
    assert c.load_seconds("remote", 4) == pytest.approx(1e-3 + nbytes / 2e9 + 50e-6 + nbytes / 10e9)
    c.observe("remote", 1 << 30, 0.5)
    assert c.bandwidth["remote"] != 2e9, "a remote transfer is measured like any other"
    # Not given: the network's first estimates, until transfers measure it.
    fresh = cost()
    rate, latency = OPTIONAL_HOPS["remote"]
    assert fresh.load_seconds("remote", 1) == pytest.approx(latency + (1 << 20) / rate + fresh.load_seconds("cpu", 1))
    assert cost(bandwidth=bw).latency_s["remote"] == latency
    with pytest.raises(kv.InvalidArgumentError, match="`tier`: expected one of"):
        fresh.load_seconds("nvme", 1)
    with pytest.raises(kv.InvalidArgumentError, match="`bandwidth`: expected a dict"):
        cost(bandwidth={**bw, "nvme": 1e9})


def test_a_plan_never_raises_a_bare_key_error_for_a_missing_hop():
    # Refused at construction, before any plan could reach the missing hop.
    expected = "`bandwidth`: expected a dict with keys 'cpu' and 'disk' \\(and optionally 'remote'\\)"
    with pytest.raises(kv.InvalidArgumentError, match=expected):
        orchestrator(cost=cost(bandwidth={"disk": 1e9}))


# ---- 6, 7. what a measurement may move -----------------------------------------------------------
def test_non_finite_or_negative_observations_are_dropped_and_counted():
    c = cost()
    for nbytes, seconds in [(1 << 20, NAN), (1 << 20, INF), (1 << 20, -1e-3), (NAN, 1e-3), (-5, 1e-3), (10**400, 1.0)]:
        c.observe("cpu", nbytes, seconds)
    assert c.observations_dropped == 6 and c.bandwidth == {"cpu": 10e9, "disk": 1e9}
    c.observe("cpu", 1 << 20, 1e-3)  # a good one still moves it
    assert c.bandwidth["cpu"] == pytest.approx(0.8 * 10e9 + 0.2 * (1 << 20) / (1e-3 - 50e-6))
    with pytest.raises(kv.InvalidArgumentError, match="`hop`"):
        c.observe("gpu", 1 << 20, 1e-3)
    with pytest.raises(kv.InvalidArgumentError, match="`seconds`"):
        c.observe("cpu", 1 << 20, "1e-3")


def test_a_copy_within_twice_the_fixed_latency_carries_no_bandwidth_information():
    c = cost(prefill_tokens_per_s=1_000_000)  # defaults: cpu 10 GB/s, 50 us fixed
    c.observe("cpu", 64 << 10, 20e-6)  # 64 KiB in 20 us: faster than the fixed latency alone
    c.observe("cpu", 64 << 10, 99e-6)  # just under 2x: (seconds - latency) is mostly noise
    c.observe("cpu", 0, 1.0)  # nothing moved
    assert c.bandwidth["cpu"] == 10e9 and c.observations_skipped == 3
    assert not c.worth_loading("cpu", 2000), "2 GiB at 10 GB/s is still slower than recomputing"
    c.observe("cpu", 64 << 10, 100e-6)  # from 2x on: at most twice the raw 655 MB/s
    assert c.bandwidth["cpu"] == pytest.approx(0.8 * 10e9 + 0.2 * (64 << 10) / 50e-6)
    assert (64 << 10) / 50e-6 <= 2 * (64 << 10) / 100e-6


# ---- 5. region groups: one observation per part ----------------------------------------------------
class QueuedEngine(CpuTransferEngine):
    """Reports each load job as a FIFO copy engine would: job k of a burst starts copying when
    job k-1 is done and takes `per_job` seconds, so its seconds since submission include the
    queueing behind the earlier ones. The copies themselves are real, inline, so a whole burst
    is in one poll."""

    per_job = 1e-3

    def __init__(self, layout, pool):
        super().__init__(layout, pool, inline=True)

    def poll(self):
        out = super().poll()
        timed, end = {}, -math.inf
        for r in sorted((r for r in out if r.direction == "h2d"), key=lambda r: r.job_id):
            submitted = r.finished_at - r.seconds
            start = max(r.started_at, end)
            end = start + self.per_job
            timed[id(r)] = dataclasses.replace(r, started_at=start, finished_at=end, seconds=end - submitted)
        return [timed.get(id(r), r) for r in out]


class SpyCost(CostModel):
    def __post_init__(self) -> None:
        super().__post_init__()
        self.calls: list[tuple[str, int, float]] = []

    def observe(self, hop, nbytes, seconds):
        self.calls.append((hop, nbytes, seconds))
        super().observe(hop, nbytes, seconds)


@pytest.mark.parametrize("layers", [1, 8, 32])
def test_a_load_split_into_region_groups_is_one_observation_of_all_its_bytes(layers):
    bpb = 2 * 8 * 32 * 4 * layers
    spy = SpyCost(
        prefill_tokens_per_s=1.0,  # recomputing is slow: every load is worth it
        tokens_per_block=16,
        block_bytes=bpb,
        latency_s={"cpu": 0.0, "disk": 0.0},
    )
    orch = orchestrator(layers=layers, engine_cls=QueuedEngine, cost=spy)
    keys = [f"b{i}".encode() for i in range(8)]
    orch.offload(keys, list(range(8)))
    orch.drain()
    groups = [[g] for g in range(layers)]
    orch.load(keys, list(range(8, 16)), request_id="r", region_groups=groups)
    (res,) = orch.drain()
    assert res.loaded_cpu == 8
    (call,) = spy.calls  # one observation for the whole part, not one per layer
    hop, nbytes, seconds = call
    assert (hop, nbytes) == ("cpu", 8 * bpb)
    # The burst took `layers` job times back to back, as one job of the same bytes would report;
    # per-job folding saw job k as k+1 job times for 1/layers of the bytes.
    burst = layers * QueuedEngine.per_job
    # (a + d) - a may round below d, by up to an ulp of a per job at a large perf_counter value
    # (the machine's uptime): 1 us is far above that and far below one job time (1 ms).
    assert burst - CLOCK_TOLERANCE_S <= seconds <= burst + res.seconds + CLOCK_TOLERANCE_S
    assert spy.bandwidth["cpu"] == pytest.approx(0.8 * 10e9 + 0.2 * nbytes / seconds)
    # A load of the same bytes as one job reads the same bandwidth as the per-layer burst.
    spy.calls.clear()
    orch.load(keys, list(range(16, 24)), request_id="whole")
    orch.drain()
    ((_, whole_bytes, whole_s),) = spy.calls
    assert whole_bytes == nbytes and whole_s >= QueuedEngine.per_job - CLOCK_TOLERANCE_S


def test_the_cost_model_measures_a_load_from_when_its_copies_started(monkeypatch):
    """A load queued behind other work (here a store whose copy holds the CPU engine's copy
    thread for 0.25 s; on a GPU, the step its copies are ordered after) waits before its copies
    start. That wait is the engine's latency, not the hop's bandwidth: counted from the
    submission, a busy engine read as a slow hop and the cost model refused loads that paid."""
    # A clock that moves only when the held store says so: the copies themselves take no time
    # on it, however slow this machine is, so the wait (0.25 s) and the hop (0 s) are exact.
    now = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])

    class HeldStores(CpuTransferEngine):
        gate: threading.Event | None = None

        def _submit(self, job, block_ids, slots, after_stream):
            job.submitted = time.perf_counter()  # on the test's clock, like every other time here
            super()._submit(job, block_ids, slots, after_stream)

        def copy_now(self, direction, block_ids, slots, sub_blocks=None, regions=None):
            if direction == "d2h" and self.gate is not None:
                # Held until the load is queued behind it, then 0.25 s pass on the clock.
                assert self.gate.wait(60)
                now[0] += 0.25
            super().copy_now(direction, block_ids, slots, sub_blocks, regions)

    spy = SpyCost(prefill_tokens_per_s=1.0, tokens_per_block=16, block_bytes=4096)
    orch = orchestrator(engine_cls=HeldStores, cost=spy)
    orch.offload([b"a", b"b"], [0, 1])
    orch.drain()
    orch.engine.gate = threading.Event()
    orch.offload([b"c"], [2])  # its copy holds the copy thread
    orch.load([b"a", b"b"], [8, 9], request_id="r")  # queued behind it
    orch.engine.gate.set()
    (res,) = orch.drain()
    assert res.loaded_cpu == 2 and res.seconds >= 0.25, "the load waited for the store"
    ((hop, _, seconds),) = spy.calls
    assert hop == "cpu" and seconds < 0.1, f"the cost model measured the wait: {seconds:.3f} s"


def test_a_failed_part_measures_nothing():
    class FailingEngine(CpuTransferEngine):
        def copy_now(self, direction, block_ids, slots, sub_blocks=None, regions=None):
            if direction == "h2d" and regions == [1]:
                raise RuntimeError("injected")
            super().copy_now(direction, block_ids, slots, sub_blocks, regions)

    spy = SpyCost(prefill_tokens_per_s=1.0, tokens_per_block=16, block_bytes=4096)
    orch = orchestrator(engine_cls=FailingEngine, cost=spy)
    orch.offload([b"a"], [0])
    orch.drain()
    orch.load([b"a"], [1], request_id="r", region_groups=[[0], [1]])
    (res,) = orch.drain()
    assert res.failed == 1 and spy.calls == []


# ---- 8. what a load's latency measures ----------------------------------------------------------
def test_load_latency_runs_to_the_copy_not_to_the_poll_that_notices_it(monkeypatch):
    """An engine polls once a step: a latency taken when poll() sees the completion would time
    the engine's step, and a guard on it would turn off a tier whose copies take microseconds."""
    now = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    tensors = [torch.randn(8, 2, 8, 32) for _ in range(2)]
    layout = BlockLayout.per_layer(tensors)
    host = kv.HostTier(kv.TierConfig(8 * 8192, layout.bytes_per_block))
    engine = CpuTransferEngine(layout, host.pool, inline=True)  # copies finish inside load()
    orch = TierOrchestrator(host, engine, guards={"cpu": GuardRule(p99_ms=50, min_samples=1)})
    orch.offload([b"a"], [0])
    orch.drain()
    orch.load([b"a"], [1], request_id="r")  # bound, copied and finished at t = 100 s
    now[0] += 10.0  # a 10 s step before the engine polls
    (res,) = orch.drain()
    assert res.loaded_cpu == 1
    assert orch.stats()["tiers"]["cpu"]["load_latency"]["p99"] == 0.0
    assert orch.guards["cpu"].state()["state"] == "active"


# ---- 9. trips: bounded, and in stats() -----------------------------------------------------------
def test_only_the_most_recent_trips_are_kept_and_all_are_counted():
    clock = FakeClock()
    orch = orchestrator(guards={"cpu": GuardRule(p99_ms=1, window_s=1, recover_s=1, min_samples=1)})
    g = orch.guards["cpu"]
    g._clock = clock
    g._wall_clock = lambda: 1.7e9 + clock.t
    for i in range(SloGuard.MAX_TRIPS + 50):
        clock.t += 2  # past recover_s: on probation; the sample started after the last trip
        g.record(1.0 + i / 1000)  # well over 1 ms, and started after the last trip
    st = orch.stats()["guards"]["cpu"]
    assert st["trips"] == SloGuard.MAX_TRIPS + 50
    assert len(st["recent_trips"]) == len(g.trips) == SloGuard.MAX_TRIPS
    assert st["recent_trips"][-1] == {"at": clock.t, "at_unix": 1.7e9 + clock.t, "p99_ms": pytest.approx(1149.0)}
    assert st["recent_trips"][0]["p99_ms"] == pytest.approx(1050.0), "the oldest kept is the 51st"
    st["recent_trips"].clear()
    assert len(g.trips) == SloGuard.MAX_TRIPS, "stats() hands out a copy"
    assert math.isclose(st["bypassed_for_s"], 1.0)


# ---- 10. what the guard sees: failures, stalls, and its state while bypassed -----------------------
def test_a_failed_load_is_a_sample_for_the_guard():
    """A load whose copy fails cost the engine its wait all the same: a tier failing slowly must
    be able to trip its guard (before, only loads that landed were samples)."""

    class FailingEngine(CpuTransferEngine):
        def copy_now(self, direction, block_ids, slots, sub_blocks=None, regions=None):
            if direction == "h2d":
                raise RuntimeError("injected")
            super().copy_now(direction, block_ids, slots, sub_blocks, regions)

    orch = orchestrator(engine_cls=FailingEngine, guards={"cpu": GuardRule(p99_ms=1e6, min_samples=10**9)})
    orch.offload([b"a"], [0])
    orch.drain()
    orch.load([b"a"], [1], request_id="r")
    (res,) = orch.drain()
    assert res.failed == 1
    assert orch.guards["cpu"].state()["samples"] == 1
    assert orch.stats()["tiers"]["cpu"]["load_latency"]["p99"] == 0.0, "the histogram is of loads that landed"


def test_a_load_that_hangs_trips_the_guard_and_its_late_completion_is_not_counted_again():
    """A stuck tier produces no completions: a promotion the engine has waited on for longer than
    the threshold is a slow sample while still in flight, once."""

    class HeldEngine(CpuTransferEngine):
        gate: threading.Event

        def copy_now(self, direction, block_ids, slots, sub_blocks=None, regions=None):
            if direction == "h2d":
                assert self.gate.wait(120)  # opened by the test after its waits below
            super().copy_now(direction, block_ids, slots, sub_blocks, regions)

    # Two slow samples trip it; a window and a bypass longer than any run, so a slow machine
    # cannot age a sample out between the checks.
    rule = GuardRule(p99_ms=20, window_s=3600, recover_s=3600, min_samples=2)
    orch = orchestrator(engine_cls=HeldEngine, guards={"cpu": rule})
    orch.engine.gate = threading.Event()
    orch.offload([b"a", b"b"], [0, 1])
    orch.drain()
    guard = orch.guards["cpu"]
    try:
        orch.load([b"a"], [2], request_id="hung")
        deadline = time.monotonic() + 60  # the stall comes 20 ms after bind; this only stops a hang
        while guard.state()["samples"] == 0 and time.monotonic() < deadline:
            orch.poll()
            time.sleep(0.005)
        assert guard.state()["samples"] == 1, "the stalled load was taken as a sample"
        for _ in range(5):
            orch.poll()  # still stalled: not counted again
        assert guard.state()["samples"] == 1
    finally:
        orch.engine.gate.set()
    (res,) = orch.drain()
    assert res.loaded_cpu == 1
    assert guard.state()["samples"] == 1, "its completion was already counted as slow"
    assert guard.allows(), "one slow sample does not trip a guard asking for two"
    # A second stall trips it; the plan then refuses the tier for the guard.
    orch.engine.gate.clear()
    try:
        orch.load([b"b"], [3], request_id="hung-2")
        deadline = time.monotonic() + 60
        while guard.allows() and time.monotonic() < deadline:
            orch.poll()
            time.sleep(0.005)
        assert not guard.allows() and guard.state()["trips"] == 1
        assert orch.plan([b"a"]).refused == {"cpu": {"guard": 1}}
    finally:
        orch.engine.gate.set()
    orch.drain()


def test_while_bypassed_the_guard_reports_the_p99_that_tripped_it_and_trips_carry_unix_time():
    clock = FakeClock()
    g = SloGuard("disk", GuardRule(p99_ms=10, recover_s=5, min_samples=2), clock=clock, wall_clock=lambda: 1.8e9)
    g.record(0.3)
    g.record(0.5)
    st = g.state()
    assert st["state"] == "bypassed" and st["samples"] == 0
    assert st["p99_ms"] == pytest.approx(g.trips[-1]["p99_ms"]) and st["p99_ms"] > 400, "not 0 ms"
    assert st["recent_trips"][-1]["at_unix"] == 1.8e9 and st["recent_trips"][-1]["at"] == clock.t
    clock.t += 5  # probation: the window's own p99 again (empty)
    assert g.state()["state"] == "active" and g.state()["p99_ms"] == 0.0


# ---- the cost model recovers after a slow spell --------------------------------------------------
def test_a_fast_copy_raises_an_estimate_below_its_raw_throughput():
    """Copies within twice the fixed latency carry a lower bound (bytes / seconds): an estimate
    lowered by a slow spell must rise again from them, or it could only ever fall."""
    c = cost(prefill_tokens_per_s=1_000_000)
    for _ in range(40):
        c.observe("cpu", 1 << 20, 0.2)  # 1 MiB in 200 ms: ~5 MB/s
    low = c.bandwidth["cpu"]
    assert low < 10e6
    c.observe("cpu", 64 << 10, 40e-6)  # 64 KiB in 40 us: at least 1.6 GB/s
    assert c.bandwidth["cpu"] == pytest.approx(0.8 * low + 0.2 * (64 << 10) / 40e-6)
    assert c.observations_skipped == 0


def test_a_tier_refused_for_cost_is_probed_and_comes_back():
    """After a slow spell the model refuses the CPU tier; once every probe_every_s one load goes
    ahead anyway, its (fast) transfers are measured, and the tier is loaded from again."""
    clock = FakeClock()
    model = cost(prefill_tokens_per_s=1e6, block_bytes=8192, probe_every_s=5.0, clock=clock)
    orch = orchestrator(cost=model)
    keys = [f"k{i}".encode() for i in range(8)]
    orch.offload(keys, list(range(8)))
    orch.drain()
    model.bandwidth["cpu"] = 1e3  # what a slow spell left behind: loading looks hopeless
    assert orch.plan(keys).load_cpu == 0
    clock.t += 4.9
    assert orch.plan(keys).refused == {"cpu": {"cost": 8}}
    clock.t += 0.2
    probe = orch.plan(keys)
    assert probe.load_cpu == 8 and model.probes == 1
    orch.load(keys, list(range(16, 24)), request_id="probe", plan=probe)
    orch.drain()
    for _ in range(30):  # fast copies (like the probe's) pull the estimate back up
        model.observe("cpu", 1 << 20, 1e-3)
    assert orch.plan(keys).load_cpu == 8
    assert orch.plan(keys).load_cpu == 8 and model.probes == 1, "no probe is needed while loads pay"
    assert orch.stats()["cost_model"]["probes"] == 1


# ---- 11. reads that no load waits for any more still measure the disk --------------------------
def test_a_disk_read_given_up_on_is_still_measured_by_the_cost_model(tmp_path, monkeypatch):
    """A load gives its disk part up after disk_read_timeout_s; its read lands later, owned by
    no load. Those are the slowest reads: if the cost model never sees them, a disk whose reads
    all take longer than the timeout is never measured, its estimate never falls, and every plan
    keeps sending loads to wait out the timeout (before, such reads were not observed)."""
    now = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    spy = SpyCost(prefill_tokens_per_s=1.0, tokens_per_block=16, block_bytes=4096)
    tensors = [torch.randn(8, 2, 8, 32)]
    layout = BlockLayout.per_layer(tensors)
    host = kv.HostTier(kv.TierConfig(4 * 4096, layout.bytes_per_block))
    disk = kv.DiskTier(str(tmp_path / "disk"), 64 * 4096 * 2, host.pool.slot_bytes, admission="always", engine="pool")
    orch = TierOrchestrator(
        host, CpuTransferEngine(layout, host.pool, inline=True), disk=disk, cost=spy, disk_read_timeout_s=1.0
    )
    orch.offload([b"a"], [0])
    orch.drain()
    orch.host.index.clear()
    orch.stager.disk = HeldReads(orch.stager.disk)
    spy.calls.clear()
    orch.load([b"a"], [1], request_id="r")
    deadline = time.monotonic() + 60  # the read completes whatever the load; this only stops a hang
    while not orch.stager.disk.held and time.monotonic() < deadline:  # the read has completed
        assert orch.poll() == []
        time.sleep(0.001)
    now[0] += 2.0  # past disk_read_timeout_s: the load gives its disk part up
    (res,) = orch.poll()
    assert res.failed == 1 and orch.stats()["load_timed_out"] == 1
    orch.stager.disk.release = True  # the read lands, owned by no load
    orch.drain()
    assert [hop for hop, _, _ in spy.calls] == ["disk"], "the late read was measured"


# ---- 12. the orchestrator's guard rules and cost model are checked at construction -------------
@pytest.mark.parametrize(
    "kw, name",
    [
        ({"guards": {"cpu": {"p99_ms": 5}}}, r"guards\['cpu'\]"),  # a rule's fields, not a GuardRule
        ({"guards": {"disk": 5.0}}, r"guards\['disk'\]"),
        ({"guards": {"cpu": None}}, r"guards\['cpu'\]"),
        ({"guards": [GuardRule(p99_ms=5)]}, "guards"),
        ({"cost": {"prefill_tokens_per_s": 1e4}}, "cost"),
        ({"cost": 1e4}, "cost"),
    ],
)
def test_guard_rules_and_the_cost_model_of_the_wrong_type_are_refused_naming_them(kw, name):
    """Before, any value was taken and the first poll(), plan() or stats() raised a bare
    AttributeError on the engine thread (or failed every metrics scrape)."""
    with pytest.raises(kv.InvalidArgumentError, match=f"invalid argument `{name}`"):
        orchestrator(**kw)


def test_a_slo_guard_refuses_a_rule_that_is_not_a_guard_rule():
    with pytest.raises(kv.InvalidArgumentError, match="invalid argument `rule`"):
        SloGuard("cpu", {"p99_ms": 5})


# ---- 13. a measurement too fast to be a number does not make a hop free for good ----------------
@pytest.mark.parametrize("latency", [0.0, 50e-6])
def test_a_transfer_timed_at_almost_nothing_cannot_pin_the_estimate_at_infinity(latency):
    """bytes / seconds overflows to inf for a tiny positive time (finite and non-negative, so
    not dropped); folded in, the average became inf and no later measurement could lower it:
    the hop was taken as free for the life of the process."""
    c = cost(latency_s={"cpu": latency, "disk": latency})
    c.observe("cpu", 1 << 30, 1e-300)
    c.observe("disk", 1 << 30, 5e-324)
    assert c.bandwidth == {"cpu": 10e9, "disk": 1e9} and c.observations_skipped == 2
    c.observe("cpu", 1 << 20, 1.0)  # an ordinary measurement still moves it
    assert c.bandwidth["cpu"] == pytest.approx(0.8 * 10e9 + 0.2 * (1 << 20) / (1.0 - latency))


# ---- 14. a load in flight at the trip and noticed late is still not a probation sample ------------
def test_a_load_in_flight_at_the_trip_noticed_only_after_probation_is_not_a_sample(monkeypatch):
    """The guard took a sample's start as (now - latency). A latency ends at the copy's
    completion, not at the poll that notices it, so a load bound before the trip, finished
    during the bypass and noticed only after probation began (an idle engine polls no more)
    looked as if it had started after the trip: a stale slow sample in the probation window."""
    now = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])

    class OneSecondCopies(CpuTransferEngine):  # copies inline, each reported as taking 1 s
        def poll(self):
            return [dataclasses.replace(r, seconds=1.0) if r.direction == "h2d" else r for r in super().poll()]

    tensors = [torch.randn(8, 2, 8, 32)]
    layout = BlockLayout.per_layer(tensors)
    host = kv.HostTier(kv.TierConfig(8 * 8192, layout.bytes_per_block))
    orch = TierOrchestrator(
        host,
        OneSecondCopies(layout, host.pool, inline=True),
        guards={"cpu": GuardRule(p99_ms=50, recover_s=30, min_samples=2)},
    )
    guard = orch.guards["cpu"]
    guard._clock = lambda: now[0]  # the guard's clock and the orchestrator's agree here
    orch.offload([b"a"], [0])
    orch.drain()
    orch.load([b"a"], [1], request_id="r")  # bound at t=100, its copy done at t=101
    now[0] += 0.01
    guard.trip_hung(0.5)  # tripped at t=100.01, while the load is in flight
    now[0] += 40.0  # the engine idles past recover_s: on probation from t=130.01
    (res,) = orch.poll()
    assert res.loaded_cpu == 1
    st = guard.state()
    assert (st["state"], st["samples"]) == ("active", 0), "the stale load is not a probation sample"


def test_a_sample_s_age_decides_whether_it_started_before_the_trip():
    clock = FakeClock()
    g = tripped_guard(clock)  # tripped at clock.t, recover_s=5
    clock.t += 6  # on probation
    g.record(0.5, started_s_ago=7.0)  # ended long before it was recorded: started before the trip
    assert g.state()["samples"] == 0
    g.record(0.5, started_s_ago=2.0)  # started after the trip
    g.record(0.5, started_s_ago=NAN)  # a bad age: the latency (it ended now) decides
    assert g.state()["samples"] == 2 and g.dropped_samples == 0
