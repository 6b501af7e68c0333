"""The CUDA transfer engine: cudaMemcpyAsync through cuda-python on the pinned host pool.

- The host pool is pinned once with cudaHostRegister (page-aligned by construction).
- One non-blocking stream per direction, so offloads never queue behind promotions.
- Ordering against the engine's compute stream: `after_stream` makes the copy stream wait on an
  event recorded there (a store must read KV after the model wrote it); `wait_on(job, stream)`
  makes a compute stream wait for a load (the model must read KV after it landed).
- Copies are coalesced into runs of adjacent blocks and adjacent slots; each (region, run) is one
  2-D copy (rows of `bytes_per_block` with the device row stride and the host slot stride). Where
  the runtime has cudaMemcpyBatchAsync (CUDA 12.8+), all 1-D pieces of a job go in one call.
- Every CUDA return code is checked; a failure raises KvTierError naming the call. A job whose
  copies fail midway is reported failed only once the copies it did issue have finished: the
  caller reuses the job's host slots and device blocks as soon as it learns of the failure.
- Several engines may share one pool (vLLM's worker has one per KV group): the pool is pinned
  by the first and unpinned when the last one closes (`_PINS`).
- The current device is per thread in CUDA: every entry point that makes CUDA calls first makes
  the layout's device current on the calling thread (an engine built on one thread and polled or
  fed from another would otherwise create its events on that thread's device, and fail), and
  gives the thread back its own current context (or none) before it returns.
- A runtime that refuses cudaMemcpyBatchAsync once (a driver without it, or pointers it does not
  take) is not asked again: every later job goes straight to cudaMemcpyAsync/2D.
- A job is timed to when its copies completed on the device, not to the poll that noticed it
  (an engine polling once a step would otherwise time its own step, and the SLO guard and the
  cost model would judge the tier by it): its completion event is a timing event, read
  against a reference event whose host time is known (`_ClockRef`).

This engine needs an NVIDIA GPU; `benches/gpu_check.py` tests and measures it on one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvtier_rs._core import HostPool, KvTierError
from kvtier_rs.checks import invalid_argument
from kvtier_rs.transfer.base import TransferEngine, _Job, host_runs
from kvtier_rs.transfer.layout import BlockLayout


def _runtime() -> Any:
    try:
        from cuda.bindings import runtime as cudart
    except ImportError as e:  # pragma: no cover - cuda-python is a dependency of the dev env
        raise KvTierError("the CUDA transfer engine needs cuda-python (pip install cuda-python)") from e
    return cudart


def _driver() -> Any:
    """cuda-python's driver API: only for the thread's current context (see `_on_device`)."""
    try:
        from cuda.bindings import driver
    except ImportError as e:  # pragma: no cover - cuda-python is a dependency of the dev env
        raise KvTierError("the CUDA transfer engine needs cuda-python (pip install cuda-python)") from e
    return driver


def check(cudart: Any, call: str, result: Any) -> Any:
    """Unpack a cuda-python result tuple; raise KvTierError naming `call` on any error."""
    err, *out = result if isinstance(result, tuple) else (result,)
    if int(err) != int(cudart.cudaError_t.cudaSuccess):
        _, msg = cudart.cudaGetErrorString(err)
        text = msg.decode() if isinstance(msg, bytes) else str(msg)
        raise KvTierError(f"{call} failed: {getattr(err, 'name', err)} ({text})")
    if not out:
        return None
    return out[0] if len(out) == 1 else tuple(out)


def stream_handle(stream: object) -> int:
    """A raw cudaStream_t from a torch stream, an object with __cuda_stream__, or an int."""
    if stream is None:
        return 0
    if isinstance(stream, int):
        return stream
    if hasattr(stream, "cuda_stream"):
        return int(stream.cuda_stream)
    if hasattr(stream, "__cuda_stream__"):
        return int(stream.__cuda_stream__()[1])
    raise invalid_argument("stream", f"cannot get a CUDA stream from {type(stream).__name__}")


def device_available() -> bool:
    try:
        cudart = _runtime()
        err, count = cudart.cudaGetDeviceCount()
        return int(err) == 0 and count > 0
    except Exception:  # noqa: BLE001 - any failure means no usable device
        return False


Piece = tuple[int, int, int, int, int, int]  # (dst, dst_pitch, src, src_pitch, width, height)

#: How long `wait(timeout=...)` sleeps between polls of a job's event.
_POLL_S = 0.0002

#: How long one clock reference times jobs before a new one is taken: cudaEventElapsedTime
#: answers in float32 milliseconds, which keep microseconds over a minute, not over hours.
_CLOCK_REF_S = 60.0


class _ClockRef:
    """A timing event recorded on an idle stream and synchronized, with the host's
    perf_counter just after: a later timing event's host time is `host_s` plus the elapsed time
    between the two (the sync's wake-up makes it later by microseconds, never earlier)."""

    def __init__(self, event: Any, host_s: float) -> None:
        self.event = event
        self.host_s = host_s
        self.jobs = 0  # jobs in flight timed against it: it lives until they are collected


class _PinnedRanges:
    """Host ranges pinned with cudaHostRegister, shared by the engines on them: registered by
    the first user, unregistered when the last one releases it (after it synchronized its
    streams, so no copy of any user is still in flight). A range some other code registered
    (cudaErrorHostMemoryAlreadyRegistered on first use) is used as it is and never unregistered."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users: dict[tuple[int, int], tuple[int, bool]] = {}  # range -> (users, ours)

    def acquire(self, rt: Any, ptr: int, nbytes: int) -> None:
        with self._lock:
            users, ours = self._users.get((ptr, nbytes), (0, False))
            if users == 0:
                err = rt.cudaHostRegister(ptr, nbytes, rt.cudaHostRegisterDefault)[0]
                ours = int(err) != int(rt.cudaError_t.cudaErrorHostMemoryAlreadyRegistered)
                if ours:
                    check(rt, "cudaHostRegister", (err,))
            self._users[(ptr, nbytes)] = (users + 1, ours)

    def release(self, rt: Any, ptr: int, nbytes: int) -> None:
        with self._lock:
            users, ours = self._users.pop((ptr, nbytes))
            if users > 1:
                self._users[(ptr, nbytes)] = (users - 1, ours)
            elif ours:
                check(rt, "cudaHostUnregister", rt.cudaHostUnregister(ptr))


_PINS = _PinnedRanges()


def copy_plan(  # noqa: PLR0917 - the copy's geometry, in the order the engines pass it
    layout: BlockLayout,
    host_ptr: int,
    slot_stride: int,
    direction: str,
    block_ids: list[int],
    slots: list[int],
    sub_blocks: list[int] | None = None,
    regions: list[int] | None = None,
) -> list[Piece]:
    """The 2-D copies that move `block_ids` <-> `slots`: one per region per run of adjacent
    blocks and slots (rows of the region's chunk, device row stride vs host slot stride).
    With `sub_blocks` (layouts of several blocks per slot), a run is adjacent sub-blocks of one
    slot and its host pitch is the region's sub-block stride.
    `regions` restricts the copies to those regions of the layout.
    Pure address arithmetic, so it is tested on CPU memory (tests/transfer/test_copy_plan.py)."""
    out = []
    for b0, s0, j0, n in host_runs(layout, block_ids, slots, sub_blocks):
        for r in range(len(layout.regions)) if regions is None else regions:
            region = layout.regions[r]
            dev = region.data_ptr() + b0 * region.block_stride_bytes
            hst = layout.host_address(r, host_ptr + s0 * slot_stride, j0)
            hpitch = slot_stride if sub_blocks is None else layout.sub_block_strides[r]
            width = region.bytes_per_block
            if direction == "d2h":
                out.append((hst, hpitch, dev, region.block_stride_bytes, width, n))
            else:
                out.append((dev, region.block_stride_bytes, hst, hpitch, width, n))
    return out


def flatten_1d(pieces: list[Piece]) -> tuple[list[int], list[int], list[int]]:
    """The same copies as 1-D (dst, src, size) lists for cudaMemcpyBatchAsync: a piece whose
    rows are contiguous on both sides is one copy, otherwise one copy per row."""
    dsts, srcs, sizes = [], [], []
    for dst, dp, src, sp, width, height in pieces:
        if dp == width and sp == width:
            dsts.append(dst)
            srcs.append(src)
            sizes.append(width * height)
        else:
            for row in range(height):
                dsts.append(dst + row * dp)
                srcs.append(src + row * sp)
                sizes.append(width)
    return dsts, srcs, sizes


class CudaTransferEngine(TransferEngine):
    name = "cuda"

    def __init__(self, layout: BlockLayout, pool: HostPool, *, use_batch: bool = True) -> None:
        if layout.device.type != "cuda":
            raise invalid_argument("layout", f"the CUDA engine needs CUDA tensors, got {layout.device}")
        super().__init__(layout, pool)
        rt = self._rt = _runtime()
        self._drv = _driver()
        self._device = layout.device.index or 0
        with self._on_device():
            _PINS.acquire(rt, pool.ptr, pool.nbytes)
            self._pinned = True
            flags = rt.cudaStreamNonBlocking
            made = []
            try:
                for _ in range(3):
                    made.append(check(rt, "cudaStreamCreateWithFlags", rt.cudaStreamCreateWithFlags(flags)))
            except BaseException:
                # No engine, so no close(): what was taken is given back here. A pin left behind
                # would keep the pool registered for good, and its _PINS entry would make a later
                # pool at the same address count as pinned without ever being registered.
                for s in made:
                    rt.cudaStreamDestroy(s)
                self._pinned = False
                _PINS.release(rt, pool.ptr, pool.nbytes)
                raise
        self._streams = {"d2h": made[0], "h2d": made[1]}
        # The clock reference's own stream: nothing else runs there, so its event completes
        # as soon as it is recorded.
        self._clock_stream = made[2]
        self._clock: _ClockRef | None = None
        self._events: dict[int, tuple[_Job, Any, _ClockRef | None, Any | None]] = {}  # done, ref, start
        #: Job id -> threads blocked in cudaEventSynchronize on its event (wait(), outside the
        #: lock), and the events of such jobs collected meanwhile: the last blocked thread
        #: destroys those, as destroying an event a thread is synchronizing on is a call on a
        #: freed (or recycled) handle.
        self._syncing: dict[int, int] = {}
        self._orphans: dict[int, Any] = {}
        self._use_batch = use_batch and hasattr(rt, "cudaMemcpyBatchAsync")
        self.batch_calls = 0
        self.batch_refusals = 0
        self.copy_calls = 0

    @contextmanager
    def _on_device(self) -> Iterator[None]:
        """Make the layout's device current on the calling thread while the block runs (CUDA's
        current device is per thread), then give the thread back what it had: a caller working
        on another device (one process, several GPUs) would otherwise find its `device="cuda"`
        allocations and torch's current stream moved to this engine's device. Cheap when the
        device already is current (one cudaGetDevice).

        What is given back is the thread's current context, not a device number: a thread that
        never chose a device reads device 0 from cudaGetDevice, and setting device 0 back would
        create device 0's primary context (hundreds of MB) in a process that may not use it, or
        fail where device 0 is reserved for another process."""
        rt = self._rt
        prev = check(rt, "cudaGetDevice", rt.cudaGetDevice())
        if prev == self._device:
            yield
            return
        try:
            err, ctx = self._drv.cuCtxGetCurrent()
        except Exception:  # noqa: BLE001 - a driver API we cannot reach: give the device back instead
            err, ctx = 1, None
        check(rt, "cudaSetDevice", rt.cudaSetDevice(self._device))
        try:
            yield
        finally:
            if int(err) == 0:
                self._drv.cuCtxSetCurrent(ctx)  # a null context: the thread had none
            else:
                rt.cudaSetDevice(prev)

    # ---- copies ---------------------------------------------------------------------------
    def _issue_2d(self, pieces, kind, stream) -> None:
        rt = self._rt
        for dst, dp, src, sp, width, height in pieces:
            if height == 1 or (dp == width and sp == width):
                check(rt, "cudaMemcpyAsync", rt.cudaMemcpyAsync(dst, src, width * height, kind, stream))
            else:
                check(rt, "cudaMemcpy2DAsync", rt.cudaMemcpy2DAsync(dst, dp, src, sp, width, height, kind, stream))
            self.copy_calls += 1

    def _issue_batch(self, pieces, stream) -> bool:
        """All pieces as 1-D copies in one cudaMemcpyBatchAsync; False if the runtime refuses."""
        rt = self._rt
        dsts, srcs, sizes = flatten_1d(pieces)
        attrs = rt.cudaMemcpyAttributes()
        attrs.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        res = rt.cudaMemcpyBatchAsync(dsts, srcs, sizes, len(sizes), [attrs], [0], 1, stream)
        if int(res[0]) != 0:
            # Refused as a whole (unsupported, or pointers it does not take): the caller issues
            # the same copies one by one, and so does every later job, instead of paying a
            # refused call each time.
            self._use_batch = False
            self.batch_refusals += 1
            return False
        self.batch_calls += 1
        return True

    def _order_after(self, stream: Any, after_stream: object) -> None:
        """Make `stream` wait for the work queued on `after_stream` so far."""
        rt = self._rt
        ev = check(rt, "cudaEventCreateWithFlags", rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming))
        try:
            check(rt, "cudaEventRecord", rt.cudaEventRecord(ev, stream_handle(after_stream)))
            check(rt, "cudaStreamWaitEvent", rt.cudaStreamWaitEvent(stream, ev, 0))
        finally:
            # Allowed at once: the wait captured the event's state when it was queued.
            rt.cudaEventDestroy(ev)

    def _submit(self, job: _Job, block_ids: list[int], slots: list[int], after_stream: object) -> None:
        with self._on_device():
            # Taken before any copy is queued, so that it precedes the job's completion event.
            ref = self._take_clock_ref()
            try:
                self._queue(job, block_ids, slots, after_stream, ref)
            except BaseException:
                with self._lock:
                    self._release_ref(ref)
                raise

    def _queue(
        self, job: _Job, block_ids: list[int], slots: list[int], after_stream: object, ref: _ClockRef | None
    ) -> None:
        """Queue a job's copies and its completion event on its direction's stream."""
        rt = self._rt
        stream = self._streams[job.direction]
        if after_stream is not None:
            self._order_after(stream, after_stream)
        kind = (
            rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
            if job.direction == "d2h"
            else rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        )
        pieces = copy_plan(
            self.layout,
            self.pool.ptr,
            self.pool.slot_bytes,
            job.direction,
            block_ids,
            slots,
            job.sub_blocks,
            job.regions,
        )
        # When the copies start: after what they wait for (the compute stream, earlier jobs on
        # this stream), which the job's time from submission also holds. Only with a clock
        # reference to read it against; without one the job counts from its submission.
        start = self._timing_event(stream) if ref is not None else None
        try:
            # An empty job copies nothing; a batch of no copies is refused (numAttrs must not
            # exceed count), and that refusal would turn the batch call off for every later job.
            if pieces and not (self._use_batch and self._issue_batch(pieces, stream)):
                self._issue_2d(pieces, kind, stream)
            done = check(rt, "cudaEventCreateWithFlags", rt.cudaEventCreateWithFlags(rt.cudaEventDefault))
        except KvTierError:
            # Copies issued before the failure still run and would write slots or blocks the
            # caller reuses once told the job failed: let them finish first.
            self._destroy(start)  # allowed while recorded work is pending (CUDA frees it after)
            check(rt, "cudaStreamSynchronize", rt.cudaStreamSynchronize(stream))
            raise
        try:
            check(rt, "cudaEventRecord", rt.cudaEventRecord(done, stream))
        except KvTierError:
            rt.cudaEventDestroy(done)
            self._destroy(start)  # allowed while recorded work is pending (CUDA frees it after)
            check(rt, "cudaStreamSynchronize", rt.cudaStreamSynchronize(stream))
            raise
        with self._lock:
            self._events[job.job_id] = (job, done, ref, start)

    def _timing_event(self, stream: Any) -> Any | None:
        """A timing event recorded on `stream` now, or None if CUDA refuses it (the job is then
        counted from its submission: a timing detail, not a reason to fail the copy)."""
        rt = self._rt
        err, ev = rt.cudaEventCreateWithFlags(rt.cudaEventDefault)
        if int(err) != 0:
            return None
        if int(rt.cudaEventRecord(ev, stream)[0]) != 0:
            rt.cudaEventDestroy(ev)
            return None
        return ev

    def _destroy(self, ev: Any | None) -> None:
        if ev is not None:
            self._rt.cudaEventDestroy(ev)

    def _take_clock_ref(self) -> _ClockRef | None:
        """The clock reference a new job is timed against, held until the job is collected
        (`_release_ref`). Taken anew when there is none or the current one is older than
        _CLOCK_REF_S; one that jobs still use lives until they are collected. None when CUDA
        refuses the reference's calls: the job is then timed to the poll that collects it."""
        rt = self._rt
        with self._lock:
            if self._clock is None or time.perf_counter() - self._clock.host_s >= _CLOCK_REF_S:
                ev = self._timing_event(self._clock_stream)
                if ev is None:
                    return None
                if int(rt.cudaEventSynchronize(ev)[0]) != 0:
                    rt.cudaEventDestroy(ev)
                    return None
                old, self._clock = self._clock, _ClockRef(ev, time.perf_counter())
                if old is not None and old.jobs == 0:
                    rt.cudaEventDestroy(old.event)
            self._clock.jobs += 1
            return self._clock

    def _release_ref(self, ref: _ClockRef | None) -> None:
        """A job timed against `ref` was collected, or never submitted (under the lock)."""
        if ref is None:
            return
        ref.jobs -= 1
        if ref.jobs == 0 and ref is not self._clock:
            self._rt.cudaEventDestroy(ref.event)

    def _completed_at(self, ref: _ClockRef | None, ev: Any) -> float | None:
        """Host time at which a completed job's event completed; None if CUDA cannot say."""
        if ref is None:
            return None
        err, ms = self._rt.cudaEventElapsedTime(ref.event, ev)
        return ref.host_s + ms / 1e3 if int(err) == 0 else None

    def _collect(self) -> None:
        with self._on_device():
            self._collect_events()

    def _collect_events(self) -> None:
        rt = self._rt
        done = []
        with self._lock:
            # Events are queried and destroyed only here, under the lock (cudaEventQuery does
            # not block), so a concurrent poll never uses one after it was destroyed.
            for job_id, (job, ev, ref, start) in list(self._events.items()):
                err = rt.cudaEventQuery(ev)[0]
                if int(err) == int(rt.cudaError_t.cudaErrorNotReady):
                    continue
                del self._events[job_id]
                at = self._completed_at(ref, ev) if int(err) == 0 else None
                # The start event precedes `ev` on its stream, so it has completed too.
                started = self._completed_at(ref, start) if int(err) == 0 and start is not None else None
                self._destroy(start)
                if self._syncing.get(job_id):
                    self._orphans[job_id] = ev  # destroyed by the last thread blocked on it
                else:
                    rt.cudaEventDestroy(ev)
                self._release_ref(ref)
                done.append((job, err, at, started))
        for job, err, at, started in done:
            if int(err) == 0:
                self._finish(job, finished_at=at, started_at=started)
            else:
                self._finish(job, f"cudaEventQuery: {getattr(err, 'name', err)}")

    def _block(self, job_ids: set[int], deadline: float | None) -> None:
        if deadline is not None:
            # cudaEventSynchronize cannot time out: poll instead (wait() checks the deadline).
            time.sleep(min(_POLL_S, max(0.0, deadline - time.monotonic())))
            return
        # The device first: if making it current fails, nothing is registered below.
        with self._on_device():
            with self._lock:
                job_id = next((j for j in job_ids if j in self._events), None)
                if job_id is None:
                    return
                ev = self._events[job_id][1]
                # Registered under the lock, so a concurrent poll or close that collects the
                # job while this thread is in the driver leaves the event alive for it.
                self._syncing[job_id] = self._syncing.get(job_id, 0) + 1
            try:
                # Its result is not checked: a real failure is reported by the query that
                # wait() makes next (_collect), which finishes the job.
                self._rt.cudaEventSynchronize(ev)
            finally:
                with self._lock:
                    left = self._syncing.pop(job_id) - 1
                    if left:
                        self._syncing[job_id] = left
                    elif job_id in self._orphans:
                        self._rt.cudaEventDestroy(self._orphans.pop(job_id))

    def wait_on(self, job_id: int, stream: object) -> None:
        """Make `stream` (e.g. the model's compute stream) wait until a job's copies are done."""
        with self._on_device(), self._lock:
            # Under the lock, so the event cannot be destroyed in between (the wait is only
            # queued, it does not block).
            item = self._events.get(job_id)
            if item is not None:
                check(self._rt, "cudaStreamWaitEvent", self._rt.cudaStreamWaitEvent(stream_handle(stream), item[1], 0))

    def _shutdown(self) -> None:
        # Every job's copies were issued on these streams before close() let no new one in:
        # syncing them finishes all jobs (a job whose event reports an error, or one left when a
        # sync fails, is reported failed by close()).
        with self._on_device():
            self._shutdown_on_device()

    def _shutdown_on_device(self) -> None:
        rt = self._rt
        for s in self._streams.values():
            check(rt, "cudaStreamSynchronize", rt.cudaStreamSynchronize(s))
        self._collect_events()
        for s in self._streams.values():
            rt.cudaStreamDestroy(s)
        self._streams = {}
        with self._lock:
            if self._clock is not None:  # every job was collected above: no reference is in use
                rt.cudaEventDestroy(self._clock.event)
                self._clock = None
        rt.cudaStreamDestroy(self._clock_stream)
        if self._pinned:
            self._pinned = False
            _PINS.release(rt, self.pool.ptr, self.pool.nbytes)
