"""The CUDA transfer engine's host-side bookkeeping, on a stand-in for cuda-python's runtime.

No GPU here, so these tests do not copy a byte: the stand-in takes the same calls as
`cuda.bindings.runtime` (with its real enums and error codes), tracks streams, events and pinned
ranges, and fails or delays where a test says. They check what the engine does around the
copies: a failed job is reported only after the copies it issued have finished, a pool shared
by several engines stays pinned until the last one closes, `wait(timeout=...)` never blocks in
a call that cannot time out, and events are destroyed exactly once. The copies themselves are
tested and measured on a GPU by `benches/gpu_check.py`.
"""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch

import kvtier_rs as kv
import kvtier_rs.transfer.cuda as cuda_engine
from kvtier_rs.transfer import BlockLayout

rt = pytest.importorskip("cuda.bindings.runtime", reason="SKIPPED LOUDLY: cuda-python is not installed")
OK = rt.cudaError_t.cudaSuccess

#: How far two readings of one instant may differ through float rounding alone: perf_counter
#: values (seconds since boot) plus device times keep about 1e-13 s at a day's uptime; 1 us is
#: far below every effect a test here checks (10 ms or more), and far above the rounding.
CLOCK_TOLERANCE_S = 1e-6


class StandInRuntime:
    """The calls CudaTransferEngine makes, with bookkeeping instead of a device."""

    cudaError_t = rt.cudaError_t
    cudaMemcpyKind = rt.cudaMemcpyKind
    cudaMemcpySrcAccessOrder = rt.cudaMemcpySrcAccessOrder
    cudaMemcpyAttributes = rt.cudaMemcpyAttributes
    cudaHostRegisterDefault = rt.cudaHostRegisterDefault
    cudaStreamNonBlocking = rt.cudaStreamNonBlocking
    cudaEventDisableTiming = rt.cudaEventDisableTiming
    cudaEventDefault = rt.cudaEventDefault

    def __init__(self) -> None:
        self._handles = itertools.count(1)
        self.pinned: set[int] = set()
        self.events: set[int] = set()  # live
        self.log: list[tuple] = []  # (call, handle) in call order
        self.misuse: list[str] = []  # calls on destroyed events, double destroys
        self.fail_copy_number: int | None = None  # the n-th copy call (1-based) fails
        self.fail_record_on: int | None = None  # cudaEventRecord on this stream fails
        self.events_done = True  # what cudaEventQuery answers for a live event
        self.on_query = None  # called once, inside the first cudaEventQuery
        self.copies = 0
        self.batch_calls = 0
        # A device clock of its own, which only a test moves (`device_now`, seconds): each copy
        # keeps its stream busy for `copy_seconds` from when it is queued (device_now) or from
        # the end of the stream's previous copy; an event completes, by this clock, when its
        # stream's queued copies are done. Host time plays no part, so a busy machine cannot
        # change what the engine reads from the events.
        self.device_now = 0.0
        self.copy_seconds = 0.0
        self.busy_until: dict[int, float] = {}
        self.recorded_at: dict[int, float] = {}
        # CUDA's current device is per thread: the device of its current context (none until
        # set; cudaGetDevice then says 0). Streams and events belong to the device that was
        # current when they were created. A device's primary context exists once a thread set it.
        self.current: dict[int, int] = {}
        self.device_of: dict[int, int] = {}
        self.contexts: set[int] = set()

    def _device(self) -> int:
        return self.current.get(threading.get_ident(), 0)

    def cudaGetErrorString(self, err):
        return OK, b"stand-in error"

    def cudaSetDevice(self, device):
        self.current[threading.get_ident()] = device
        self.contexts.add(device)  # since CUDA 12, setting a device initializes its context
        return (OK,)

    # Driver API: a context is named here by its device; None is no context.
    def cuCtxGetCurrent(self):
        return OK, self.current.get(threading.get_ident())

    def cuCtxSetCurrent(self, ctx):
        if ctx is None:
            self.current.pop(threading.get_ident(), None)
        else:
            self.current[threading.get_ident()] = ctx
        return (OK,)

    def cudaGetDevice(self):
        return OK, self._device()

    def cudaHostRegister(self, ptr, nbytes, flags):
        if ptr in self.pinned:
            return (rt.cudaError_t.cudaErrorHostMemoryAlreadyRegistered,)
        self.pinned.add(ptr)
        return (OK,)

    def cudaHostUnregister(self, ptr):
        self.pinned.discard(ptr)
        return (OK,)

    def cudaStreamCreateWithFlags(self, flags):
        stream = next(self._handles)
        self.device_of[stream] = self._device()
        return OK, stream

    def cudaStreamDestroy(self, stream):
        return (OK,)

    def cudaStreamSynchronize(self, stream):
        self.log.append(("sync", stream))
        return (OK,)

    def cudaEventCreateWithFlags(self, flags):
        ev = next(self._handles)
        self.events.add(ev)
        self.device_of[ev] = self._device()
        return OK, ev

    def _live(self, call: str, ev: int):
        if ev not in self.events:
            self.misuse.append(f"{call} on destroyed event {ev}")
            return rt.cudaError_t.cudaErrorInvalidResourceHandle
        return OK

    def cudaEventDestroy(self, ev):
        err = self._live("cudaEventDestroy", ev)
        self.events.discard(ev)
        return (err,)

    def cudaEventRecord(self, ev, stream):
        if stream == self.fail_record_on:
            return (rt.cudaError_t.cudaErrorInvalidResourceHandle,)
        if stream in self.device_of and self.device_of[stream] != self.device_of.get(ev):
            # As CUDA: an event and the stream it is recorded on must be on the same device.
            self.misuse.append(
                f"cudaEventRecord of a device-{self.device_of.get(ev)} event "
                f"on a device-{self.device_of[stream]} stream"
            )
            return (rt.cudaError_t.cudaErrorInvalidResourceHandle,)
        err = self._live("cudaEventRecord", ev)
        if err == OK:
            self.recorded_at[ev] = max(self.device_now, self.busy_until.get(stream, 0.0))
        return (err,)

    def cudaEventElapsedTime(self, start, end):
        for ev in (start, end):
            err = self._live("cudaEventElapsedTime", ev)
            if err != OK or ev not in self.recorded_at:
                return rt.cudaError_t.cudaErrorInvalidResourceHandle, 0.0
        return OK, (self.recorded_at[end] - self.recorded_at[start]) * 1e3

    def cudaStreamWaitEvent(self, stream, ev, flags):
        err = self._live("cudaStreamWaitEvent", ev)
        if err == OK:
            # The stream's later work starts once the event has completed.
            self.busy_until[stream] = max(self.busy_until.get(stream, 0.0), self.recorded_at.get(ev, 0.0))
        return (err,)

    def cudaEventQuery(self, ev):
        hook, self.on_query = self.on_query, None
        if hook is not None:
            hook()
        err = self._live("cudaEventQuery", ev)
        if err == OK and not self.events_done:
            return (rt.cudaError_t.cudaErrorNotReady,)
        return (err,)

    def cudaEventSynchronize(self, ev):
        self.log.append(("event_sync", ev))
        return (self._live("cudaEventSynchronize", ev),)

    def cudaMemcpyAsync(self, *args):
        self.copies += 1
        stream = args[-1]
        self.busy_until[stream] = max(self.device_now, self.busy_until.get(stream, 0.0)) + self.copy_seconds
        self.log.append(("copy", stream))
        if self.copies == self.fail_copy_number:
            return (rt.cudaError_t.cudaErrorInvalidValue,)
        return (OK,)

    cudaMemcpy2DAsync = cudaMemcpyAsync

    def cudaMemcpyBatchAsync(self, *args):
        self.batch_calls += 1
        return rt.cudaError_t.cudaErrorNotSupported, 0  # a runtime that has the call, a driver that refuses it


@pytest.fixture
def runtime(monkeypatch) -> StandInRuntime:
    stand_in = StandInRuntime()
    monkeypatch.setattr(cuda_engine, "_runtime", lambda: stand_in)
    monkeypatch.setattr(cuda_engine, "_driver", lambda: stand_in)
    return stand_in


def cuda_layout(device: int = 0) -> BlockLayout:
    """Two regions, so a job is two copies; CPU tensors under a CUDA device label (the
    stand-in never touches the addresses)."""
    layout = BlockLayout.per_layer([torch.zeros(8, 4096, dtype=torch.uint8) for _ in range(2)])
    layout.device = torch.device("cuda", device)
    return layout


def engine(
    pool: kv.HostPool, layout: BlockLayout | None = None, use_batch: bool = False
) -> cuda_engine.CudaTransferEngine:
    return cuda_engine.CudaTransferEngine(layout or cuda_layout(), pool, use_batch=use_batch)


def host_pool() -> kv.HostPool:
    return kv.HostPool(8 * 8192, 8192)


def job_events(runtime: StandInRuntime, eng: cuda_engine.CudaTransferEngine) -> set[int]:
    """Live events other than the engine's clock reference (which lives as long as it)."""
    return runtime.events - ({eng._clock.event} if eng._clock is not None else set())


def test_a_job_failing_midway_is_reported_after_its_issued_copies_finished(runtime):
    pool = host_pool()
    with engine(pool) as eng:
        runtime.fail_copy_number = 2  # the first region's copy is queued, the second fails
        job = eng.store([0], [0])
        d2h = eng._streams["d2h"]
        [result] = eng.wait([job])
        assert not result.success and "cudaMemcpyAsync failed" in result.error
        # The stream was drained after the failed copy and before the result was reported.
        assert runtime.log[-1] == ("sync", d2h), runtime.log
        assert runtime.log[-3:-1] == [("copy", d2h), ("copy", d2h)]


def test_a_failed_event_record_drains_the_stream_and_leaks_no_event(runtime):
    pool = host_pool()
    with engine(pool) as eng:
        runtime.fail_record_on = eng._streams["h2d"]
        [result] = eng.wait([eng.load([0], [1])])
        assert not result.success and "cudaEventRecord failed" in result.error
        assert runtime.log[-1] == ("sync", eng._streams["h2d"])
        assert job_events(runtime, eng) == set(), "an event was left behind"


def test_the_after_stream_event_is_destroyed_when_ordering_fails(runtime):
    pool = host_pool()
    with engine(pool) as eng:
        runtime.fail_record_on = 777  # the compute stream the copy should follow
        [result] = eng.wait([eng.store([0], [0], after_stream=777)])
        assert not result.success and "cudaEventRecord failed" in result.error
        assert job_events(runtime, eng) == set()


def test_a_pool_shared_by_engines_stays_pinned_until_the_last_one_closes(runtime):
    pool = host_pool()
    first, second = engine(pool), engine(pool)
    assert pool.ptr in runtime.pinned
    first.close()
    assert pool.ptr in runtime.pinned, "closing one engine unpinned memory the other still copies from"
    job = second.store([0], [0])
    assert [r.success for r in second.wait([job])] == [True]
    second.close()
    assert pool.ptr not in runtime.pinned
    # And pinned again by the next engine on it.
    with engine(pool):
        assert pool.ptr in runtime.pinned
    assert pool.ptr not in runtime.pinned


def test_memory_pinned_by_someone_else_is_never_unpinned(runtime):
    pool = host_pool()
    runtime.pinned.add(pool.ptr)  # e.g. the engine's own cudaHostRegister of a shared region
    with engine(pool):
        pass
    assert pool.ptr in runtime.pinned


def test_wait_with_a_timeout_polls_instead_of_blocking_in_the_driver(runtime):
    pool = host_pool()
    with engine(pool) as eng:
        runtime.events_done = False  # the copies never finish
        job = eng.store([0], [0])
        with pytest.raises(TimeoutError, match="still running"):
            eng.wait([job], timeout=0.02)
        # cudaEventSynchronize cannot time out: a hung copy would have hung wait() forever.
        assert not [c for c in runtime.log if c[0] == "event_sync" and c[1] != eng._clock.event]
        runtime.events_done = True
        assert [r.success for r in eng.wait([job])] == [True]


def test_a_job_is_finished_and_its_event_destroyed_once_when_polls_race(runtime):
    pool = host_pool()
    with engine(pool) as eng:
        job = eng.store([0], [0])
        seen = []
        # Another thread polls while this one is between its query and taking the job: it is
        # seen to have started collecting (however slow this machine), then given 0.2 s, in
        # which an engine that did not hold it off would let it take the job first.
        other = threading.Thread(target=lambda: seen.extend(eng.poll()))
        collecting = threading.Event()
        collect = eng._collect_events

        def observed_collect():
            if threading.current_thread() is other:
                collecting.set()
            collect()

        eng._collect_events = observed_collect
        runtime.on_query = lambda: (other.start(), collecting.wait(60), other.join(timeout=0.2))
        seen.extend(eng.poll())
        other.join()
        assert [r.job_id for r in seen] == [job]
        assert runtime.misuse == []
        assert job_events(runtime, eng) == set()


def test_an_engine_fed_and_polled_from_another_thread_works_on_its_own_device(runtime):
    """CUDA's current device is per thread: an engine for device 1 built on one thread and used
    from another (vLLM's worker thread, a poll thread) must make its device current there, or it
    creates its events on device 0 and cannot record them on its device-1 streams."""
    pool = host_pool()
    with engine(pool, cuda_layout(device=1)) as eng:
        results = []
        worker = threading.Thread(target=lambda: results.extend(eng.wait([eng.store([0], [0]), eng.load([1], [1])])))
        worker.start()
        worker.join(60)
        assert [r.success for r in results] == [True, True], [r.error for r in results]
        assert runtime.misuse == []


def test_a_refused_batch_call_is_not_retried_for_every_job(runtime):
    pool = host_pool()
    with engine(pool, use_batch=True) as eng:
        results = eng.wait([eng.store([0], [0]), eng.store([1], [1]), eng.load([2], [2])])
        assert [r.success for r in results] == [True, True, True], "the copies went through one by one"
        assert runtime.batch_calls == 1 and eng.batch_refusals == 1
        assert runtime.copies == 6, "two regions a job, each copied once"


def test_a_job_is_timed_to_its_copies_completion_not_to_the_poll_that_notices_it(runtime):
    """An engine polled once a step must not time its own step: a load whose two copies take
    10 ms each on the device, noticed 200 ms or more later, took 20 ms on the device, and its
    completion is placed before the poll, not at it."""
    pool = host_pool()
    with engine(pool) as eng:
        runtime.copy_seconds = 0.01
        called = time.perf_counter()
        load = eng.load([0], [1])
        returned = time.perf_counter()
        time.sleep(0.2)  # a lower bound: a busy machine only makes the poll later
        [r] = eng.poll()
        assert r.job_id == load and r.success
        assert r.finished_at - r.started_at == pytest.approx(0.02, abs=CLOCK_TOLERANCE_S)
        # The clock reference was taken before load() returned, and the copies ended 20 ms of
        # device time after it: that is before the poll, which came 200 ms after the return.
        assert r.finished_at <= returned + 0.02 + CLOCK_TOLERANCE_S, r.finished_at - returned
        assert 0.02 - CLOCK_TOLERANCE_S <= r.seconds <= returned - called + 0.02 + CLOCK_TOLERANCE_S, r.seconds
        # Jobs are timed against clock references that outlive them, and nothing is left.
        assert job_events(runtime, eng) == set() and runtime.misuse == []
    assert runtime.events == set(), "the clock reference outlived the engine"


def test_a_clock_reference_the_runtime_refuses_times_jobs_to_the_poll(runtime, monkeypatch):
    pool = host_pool()
    monkeypatch.setattr(runtime, "cudaEventSynchronize", lambda ev: (rt.cudaError_t.cudaErrorUnknown,))
    with engine(pool) as eng:
        job = eng.store([0], [0])
        time.sleep(0.05)  # a lower bound on the job's time to the poll
        [r] = eng.wait([job])
        assert r.success and r.seconds >= 0.05 - CLOCK_TOLERANCE_S
        assert eng._clock is None and runtime.events == set()


@pytest.mark.parametrize("other", ["poll", "close"])
def test_wait_never_synchronizes_an_event_a_concurrent_poll_or_close_destroyed(runtime, other):
    """wait() blocks in cudaEventSynchronize outside the lock; a poll (or close) on another
    thread that collects the job meanwhile must not destroy the event under it: on a GPU that is
    a call on a freed (or recycled) event handle."""
    pool = host_pool()
    eng = engine(pool)
    runtime.events_done = False  # wait() finds the job still running and blocks on its event
    job = eng.store([0], [0])
    real_sync = runtime.cudaEventSynchronize
    seen = []

    def sync(ev):
        # The copies complete and another thread collects the job before this thread's
        # cudaEventSynchronize reaches the driver.
        runtime.cudaEventSynchronize = real_sync
        runtime.events_done = True
        t = threading.Thread(target=lambda: seen.extend(eng.poll()) if other == "poll" else eng.close())
        t.start()
        t.join(60)
        return real_sync(ev)

    runtime.cudaEventSynchronize = sync
    results = eng.wait([job]) + seen
    eng.close()
    assert [r.success for r in results] == [True]
    assert runtime.misuse == [], runtime.misuse
    assert runtime.events == set(), "an event was left behind"


@pytest.mark.parametrize("failing_stream", [1, 2, 3])
def test_an_engine_that_fails_to_start_unpins_the_pool_and_destroys_its_streams(runtime, monkeypatch, failing_stream):
    """A CUDA call failing in the constructor (here the n-th stream creation) must leave the
    pool as it found it: pinned by no one, and pinned again by the next engine on it."""
    pool = host_pool()
    created, destroyed = [], []
    real_create, real_destroy = runtime.cudaStreamCreateWithFlags, runtime.cudaStreamDestroy

    def create(flags):
        if len(created) + 1 == failing_stream:
            created.append(None)
            return rt.cudaError_t.cudaErrorMemoryAllocation, None
        res = real_create(flags)
        created.append(res[1])
        return res

    monkeypatch.setattr(runtime, "cudaStreamCreateWithFlags", create)
    monkeypatch.setattr(runtime, "cudaStreamDestroy", lambda s: (destroyed.append(s), real_destroy(s))[1])
    with pytest.raises(kv.KvTierError, match="cudaStreamCreateWithFlags failed"):
        engine(pool)
    assert pool.ptr not in runtime.pinned, "the pool stayed pinned by an engine that never started"
    assert sorted(destroyed) == sorted(s for s in created if s is not None), "a stream was leaked"
    monkeypatch.setattr(runtime, "cudaStreamCreateWithFlags", real_create)
    with engine(pool):
        assert pool.ptr in runtime.pinned
    assert pool.ptr not in runtime.pinned


def test_an_empty_job_does_not_turn_the_batch_call_off(runtime, monkeypatch):
    """cudaMemcpyBatchAsync refuses a batch of no copies (numAttrs must not exceed count): an
    empty job has nothing to copy and must not be taken for a runtime without the call, which
    would send every later job through one call per piece."""
    calls = []

    def batch(dsts, srcs, sizes, count, attrs, attr_idxs, num_attrs, stream):  # noqa: PLR0917 - the signature of cudaMemcpyBatchAsync
        calls.append(count)
        if count == 0 or num_attrs > count:
            return (rt.cudaError_t.cudaErrorInvalidValue,)
        return (OK,)

    monkeypatch.setattr(runtime, "cudaMemcpyBatchAsync", batch)
    pool = host_pool()
    with engine(pool, use_batch=True) as eng:
        results = eng.wait([eng.store([], []), eng.load([], [])])
        assert [(r.success, r.bytes) for r in results] == [(True, 0), (True, 0)]
        assert [r.success for r in eng.wait([eng.store([0], [0])])] == [True]
        assert eng.batch_refusals == 0 and eng.batch_calls == 1, calls
        assert runtime.copies == 0, "the store went through one call per piece"


def test_the_engine_leaves_the_callers_current_device_as_it_found_it(runtime):
    """A thread working on device 0 that drives an engine for device 1 (one process, several
    GPUs) must still be on device 0 after each call: CUDA's current device is the thread's
    state (torch allocates `device="cuda"` tensors and picks its current stream by it)."""
    pool = host_pool()
    me = threading.get_ident()
    runtime.cudaSetDevice(0)
    eng = engine(pool, cuda_layout(device=1))
    assert runtime.current[me] == 0, "the constructor left device 1 current"
    job = eng.store([0], [0])
    assert runtime.current[me] == 0, "store() left device 1 current"
    eng.wait_on(job, 5)
    assert runtime.current[me] == 0, "wait_on() left device 1 current"
    assert [r.success for r in eng.wait([job])] == [True]
    assert runtime.current[me] == 0, "wait() left device 1 current"
    eng.poll()
    assert runtime.current[me] == 0, "poll() left device 1 current"
    eng.close()
    assert runtime.current[me] == 0, "close() left device 1 current"
    assert runtime.misuse == []


def test_a_thread_that_never_chose_a_device_is_left_without_one(runtime):
    """A helper thread with no current context (cudaGetDevice says 0) drives an engine for
    device 1: afterwards it still has none, and device 0's context was never created (giving
    back "device 0" created it: hundreds of MB on a GPU the process may not use)."""
    pool = host_pool()
    eng = engine(pool, cuda_layout(device=1))
    errors: list[str] = []

    def helper():
        me = threading.get_ident()
        for call in (lambda: eng.wait([eng.store([0], [0])]), eng.poll):
            call()
            if me in runtime.current:
                errors.append(f"left device {runtime.current[me]}'s context current")

    t = threading.Thread(target=helper)
    t.start()
    t.join(60)
    eng.close()
    assert errors == [] and 0 not in runtime.contexts, (errors, runtime.contexts)


def test_a_job_ordered_after_a_busy_stream_says_when_its_copies_started(runtime):
    """The copies of a load ordered after the compute stream start once the step queued there is
    done (100 ms of device time here): the job's time from submission holds that wait, and
    `started_at` says when its own copies (two of 10 ms) began, which is what a bandwidth is
    measured over."""
    compute = 999  # a stream of the engine's caller
    pool = host_pool()
    with engine(pool) as eng:
        runtime.copy_seconds = 0.01
        runtime.busy_until[compute] = runtime.device_now + 0.1
        t0 = time.perf_counter()
        load = eng.load([0], [1], after_stream=compute)
        time.sleep(0.3)  # a lower bound: the copies end 120 ms of device time after submission
        [r] = eng.poll()
        assert r.job_id == load and r.success
        # The clock reference is taken after t0, so its host time is t0 or later.
        assert r.started_at - t0 >= 0.1 - CLOCK_TOLERANCE_S, r.started_at - t0
        assert r.seconds >= 0.12 - CLOCK_TOLERANCE_S, r.seconds
        assert r.finished_at - r.started_at == pytest.approx(0.02, abs=CLOCK_TOLERANCE_S)
        assert job_events(runtime, eng) == set() and runtime.misuse == [], "the start event outlived its job"
    assert runtime.events == set()
