"""The interface every transfer engine implements (CPU and CUDA), and the job bookkeeping they share."""

from __future__ import annotations

import itertools
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvtier_rs._core import ClosedError, HostPool
from kvtier_rs.checks import invalid_argument
from kvtier_rs.tiers.keys import index_list
from kvtier_rs.transfer.layout import BlockLayout

_VERB = {"d2h": "store", "h2d": "load"}


@dataclass(frozen=True)
class TransferResult:
    job_id: int
    direction: str  # "d2h" (store/offload) or "h2d" (load/promote)
    success: bool
    num_blocks: int
    bytes: int
    seconds: float
    error: str | None = None
    #: perf_counter time at which the job's copies started: on a device, once the work they were
    #: ordered after (`after_stream`) and the copies queued before them had finished; on the CPU
    #: engine, when its copy thread took the job. The submission time when the engine cannot tell.
    #: A hop's bandwidth is bytes over the time from here to completion: `seconds` (from the
    #: submission) also holds the waits, which say nothing about the hop.
    started_at: float = 0.0
    #: perf_counter time at which its copies completed (submission + `seconds`).
    finished_at: float = 0.0


@dataclass
class _Job:
    job_id: int
    direction: str
    num_blocks: int
    submitted: float = field(default_factory=time.perf_counter)
    #: Per block, which sub-block of its host slot it uses (layouts with blocks_per_slot > 1);
    #: None means sub-block 0 for every block.
    sub_blocks: list[int] | None = None
    #: Indices of the layout's regions to copy (e.g. one layer, for per-layer waits); None = all.
    regions: list[int] | None = None


class TransferEngine(ABC):
    """Moves whole blocks between device KV memory (a BlockLayout) and host-pool slots.

    `store` copies device blocks into host slots, `load` host slots into device blocks. Both
    return a job id at once; `poll` returns each finished job exactly once; `wait` blocks until
    the given jobs are finished. With a layout of several blocks per host slot, `sub_blocks`
    names each block's place in its slot. A failed job is reported with success=False and an error, never
    raised from `poll`.
    """

    name = "abstract"

    def __init__(self, layout: BlockLayout, pool: HostPool) -> None:
        if layout.slot_extent > pool.slot_bytes:
            raise invalid_argument(
                "pool", f"a host slot of this layout needs {layout.slot_extent} bytes, pool slots are {pool.slot_bytes}"
            )
        self.layout = layout
        self.pool = pool
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._progress = threading.Condition(self._lock)
        self._in_flight: dict[int, _Job] = {}
        self._finished: list[TransferResult] = []
        self._closed = False
        #: close() has finished (jobs drained, resources released): a second close() waits for it.
        self._shut_down = False
        #: a close() is draining the jobs; a second close() waits for it (and takes over if it
        #: was interrupted before shutting the engine down).
        self._closing = False
        #: store/load calls between the closed check and their job's hand-over (see close()).
        self._submitting = 0

    def _validate(
        self, direction: str, block_ids: Sequence[int], slots: Sequence[int], sub_blocks: Sequence[int] | None
    ) -> tuple[list[int], list[int], list[int] | None]:
        """Every check of a copy request, shared by all engines and done before anything is
        registered or copied: ids, slots and sub-blocks as in-range ints, and no destination
        named twice (device blocks for a load, host positions for a store). Returns them as
        lists; sub-blocks None when every block uses sub-block 0."""
        block_ids, slots = index_list(block_ids, "block_ids"), index_list(slots, "slots", "slot")
        if len(block_ids) != len(slots):
            raise invalid_argument("slots", f"{len(slots)} slots for {len(block_ids)} blocks")
        self.layout.check_block_ids(block_ids, distinct=direction == "h2d")
        bad = [s for s in slots if not 0 <= s < self.pool.num_slots]
        if bad:
            raise invalid_argument("slots", f"{bad[:5]} outside 0..{self.pool.num_slots}")
        subs = None
        if sub_blocks is not None:
            subs = index_list(sub_blocks, "sub_blocks", "sub-block")
            if len(subs) != len(block_ids):
                raise invalid_argument("sub_blocks", f"{len(subs)} sub-blocks for {len(block_ids)} blocks")
            self.layout.check_sub_blocks(subs)
            if not any(subs):
                subs = None  # all sub-block 0: the plain path
        if direction == "d2h":
            # A load may read one slot into several blocks; a store may not write one twice.
            self.layout.check_host_destinations(slots, subs)
        return block_ids, slots, subs

    def store(
        self,
        block_ids: Sequence[int],
        slots: Sequence[int],
        *,
        after_stream: object = None,
        sub_blocks: Sequence[int] | None = None,
        regions: Sequence[int] | None = None,
    ) -> int:
        """Device -> host. `after_stream` (CUDA) orders the copy after work queued on that stream;
        `regions` copies only those regions of the layout (by index)."""
        return self._start("d2h", block_ids, slots, after_stream, sub_blocks, regions)

    def load(
        self,
        slots: Sequence[int],
        block_ids: Sequence[int],
        *,
        after_stream: object = None,
        sub_blocks: Sequence[int] | None = None,
        regions: Sequence[int] | None = None,
    ) -> int:
        """Host -> device. `after_stream` (CUDA) orders the copy after work queued on that stream;
        `regions` copies only those regions of the layout (e.g. one layer, so that a per-layer
        wait can return before the other layers have landed)."""
        return self._start("h2d", block_ids, slots, after_stream, sub_blocks, regions)

    def _start(
        self,
        direction: str,
        block_ids: Sequence[int],
        slots: Sequence[int],
        after_stream: object,
        sub_blocks: Sequence[int] | None = None,
        regions: Sequence[int] | None = None,
    ) -> int:
        ids, sl, subs = self._validate(direction, block_ids, slots, sub_blocks)
        picked = None if regions is None else self.layout.check_regions(regions)
        job = _Job(next(self._ids), direction, len(ids), sub_blocks=subs, regions=picked)
        with self._lock:
            # Checked under the lock that close() takes, so a submission either lands before
            # close() starts (and close() waits for it) or is refused: never a job that no
            # copy thread or stream will ever finish.
            if self._closed:
                raise ClosedError(f"closed: {self.name} transfer engine; {_VERB[direction]}() after close() is refused")
            self._in_flight[job.job_id] = job
            self._submitting += 1
        try:
            self._submit(job, ids, sl, after_stream)
        except Exception as e:  # noqa: BLE001 - reported as a failed job, as the contract says
            self._finish(job, f"{type(e).__name__}: {e}")
        finally:
            with self._lock:
                self._submitting -= 1
                self._progress.notify_all()
        return job.job_id

    def _finish(
        self,
        job: _Job,
        error: str | None = None,
        *,
        finished_at: float | None = None,
        started_at: float | None = None,
    ) -> None:
        """Report a job done. `finished_at` (perf_counter time) is when its copies completed,
        for an engine that learns of completions later (the CUDA engine, at its next poll):
        without it the job is timed to now, which would time the caller's polling instead.
        `started_at`: when its copies started (see TransferResult.started_at)."""
        now = time.perf_counter()
        end = now if finished_at is None else min(max(finished_at, job.submitted), now)
        start = job.submitted if started_at is None else min(max(started_at, job.submitted), end)
        result = TransferResult(
            job_id=job.job_id,
            direction=job.direction,
            success=error is None,
            num_blocks=job.num_blocks,
            bytes=job.num_blocks * self.layout.region_bytes(job.regions) if error is None else 0,
            seconds=end - job.submitted,
            error=error,
            started_at=start,
            finished_at=end,
        )
        with self._lock:
            # Once only: close() may already have reported a job it gave up on as failed, and
            # a late completion must not add a second, contradicting result.
            if self._in_flight.pop(job.job_id, None) is None:
                return
            self._finished.append(result)
            self._progress.notify_all()

    def poll(self) -> list[TransferResult]:
        """Finished jobs since the last call, each exactly once."""
        self._collect()
        with self._lock:
            out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> list[TransferResult]:
        """Block until none of `job_ids` is in flight; return (and consume) their results.
        Ids that are unknown or were already returned by `poll` are simply done."""
        wanted = set(job_ids)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._collect()
            with self._lock:
                pending = wanted & self._in_flight.keys()
            if not pending:
                break
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"transfer jobs {sorted(pending)} still running after {timeout} s")
            self._block(pending, deadline)
        with self._lock:
            got = [r for r in self._finished if r.job_id in wanted]
            self._finished = [r for r in self._finished if r.job_id not in wanted]
        return got

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._in_flight)

    # ---- engine-specific ----------------------------------------------------------------
    @abstractmethod
    def _submit(self, job: _Job, block_ids: list[int], slots: list[int], after_stream: object) -> None:
        """Start the copies; call `_finish(job)` (now or later, from any thread) when done."""

    def _collect(self) -> None:  # noqa: B027 - optional hook, a no-op for push-style engines
        """Finish jobs whose completion must be polled (CUDA events)."""

    def _block(self, job_ids: set[int], deadline: float | None) -> None:
        """Wait a little for progress on these jobs, returning by `deadline` (time.monotonic) if
        one is set."""
        pause = 0.05 if deadline is None else min(0.05, max(0.0, deadline - time.monotonic()))
        with self._lock:
            self._progress.wait(timeout=pause)

    def close(self) -> None:
        """Refuse new jobs (ClosedError), let every job already submitted finish, then release
        the engine's resources (threads, streams, pinned registrations). A job the engine could
        not finish is reported failed, so `wait` always returns. Idempotent. Engines extend
        `_shutdown`, not this, so that all of them share these guarantees."""
        with self._lock:
            # Another close() may still be draining the jobs: returning now would let this
            # caller free the pool or the KV memory under copies still running. If that one is
            # interrupted before it shuts the engine down (Ctrl-C), this one takes over.
            while self._closing:
                self._progress.wait()
            if self._shut_down:
                return
            self._closed = True
            self._closing = True
        shutting_down = False
        try:
            with self._lock:
                # A store/load that passed the closed check is still handing its job over (e.g.
                # onto the CPU engine's queue, or copying inline): shutting down under it would
                # strand that job.
                while self._submitting:
                    self._progress.wait()
            shutting_down = True
            self._shutdown()
        finally:
            if shutting_down:
                with self._lock:
                    stranded = list(self._in_flight.values())
                for job in stranded:
                    self._finish(job, f"closed: the {self.name} transfer engine was closed before this job finished")
            with self._lock:
                # Interrupted while waiting for a submission: not shut down, and the next close()
                # does it (new jobs stay refused meanwhile).
                self._shut_down = shutting_down
                self._closing = False
                self._progress.notify_all()

    def _shutdown(self) -> None:  # noqa: B027 - optional hook
        """Finish every submitted job (or leave it to be reported failed), then release engine
        resources. Runs once, after new submissions are refused."""

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def host_runs(
    layout: BlockLayout, block_ids: Sequence[int], slots: Sequence[int], sub_blocks: Sequence[int] | None
) -> list[tuple[int, int, int, int]]:
    """Runs of blocks whose device rows and host positions both advance by one, each within one
    host slot when a slot holds several blocks: (first_block, slot, first_sub_block, length)."""
    bps = layout.blocks_per_slot
    if sub_blocks is None:
        return [(b, s, 0, n) for b, s, n in coalesce_runs(block_ids, slots)]
    # Position h = slot * bps + sub is linear in host order inside a slot; a run is cut where it
    # would cross into the next slot (the host pitch changes there).
    lin = [s * bps + j for s, j in zip(slots, sub_blocks, strict=True)]
    out = []
    for b0, h0, n in coalesce_runs(block_ids, lin):
        while n:
            take = min(n, bps - h0 % bps)
            out.append((b0, h0 // bps, h0 % bps, take))
            b0, h0, n = b0 + take, h0 + take, n - take
    return out


def coalesce_runs(block_ids: Sequence[int], slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """Group (block, slot) pairs into runs where both advance by one: (first_block, first_slot, length).

    Pairs are sorted by block id first, so a batch that names adjacent blocks in any order still
    becomes few large copies.
    """
    pairs = sorted(zip(block_ids, slots, strict=True))
    runs: list[tuple[int, int, int]] = []
    for b, s in pairs:
        if runs:
            b0, s0, n = runs[-1]
            if b == b0 + n and s == s0 + n:
                runs[-1] = (b0, s0, n + 1)
                continue
        runs.append((b, s, 1))
    return runs
