"""The shared remote tier: blocks in a Valkey/Redis Cluster, staged through host slots.

It fulfils the staging contract (``orchestrator.disk_contract.StagingDisk``) that the disk tier
does, so the same ``DiskStager`` writes blocks through to it and promotes them back. What differs
from a local disk:

* **Nothing blocks the caller.** Every store operation runs on the tier's worker threads (redis-py
  releases the GIL on the socket, hiredis parses in C); the scheduler thread only queues jobs and
  collects results in `poll`.
* **Presence is learned, not owned.** Other replicas write and the server evicts, so `contains`
  answers from what this process learned: its own writes and batched existence probes
  (`probe`), which expire. A stale answer costs a read that misses (counted), never wrong bytes.
* **Every read is verified** (`values.ValueFormat.open`) before a byte reaches a host slot.
* **Deadlines.** A job not finished `deadline_s` after it started (plus a second per 256 MiB it
  moves) is abandoned by `poll`: a read reports its blocks failed and never touches its slots
  afterwards; a write's slots are released once its bytes were copied out. A circuit breaker
  stops calling a store that keeps failing.
* **Capacity is the server's** (``maxmemory`` with ``allkeys-lru``, or a TTL): with many writers
  no client can account for it. A full server refuses writes (counted); reads go on.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.cluster import RedisCluster

from kvtier_rs._core import MAX_KEY_BYTES as CORE_KEY_BYTES
from kvtier_rs._core import Admission, ClosedError, HostPool
from kvtier_rs.checks import check_count, check_number
from kvtier_rs.orchestrator.latency import LatencyRecorder
from kvtier_rs.tiers.keys import Key, key_list
from kvtier_rs.tiers.remote.breaker import BreakerState, CircuitBreaker
from kvtier_rs.tiers.remote.values import CHECK_BYTES, MAX_KEY_BYTES, Miss, ValueFormat, store_key

log = logging.getLogger("kvtier_rs.remote")

_PAGE = 4096
#: Bytes of values per pipeline round trip: bounds what one connection has in flight.
PIPELINE_BYTES = 64 << 20
#: A job's deadline grows by a second per this many bytes it moves (see `_deadline`).
DEADLINE_FLOOR_BYTES_PER_S = 256 << 20
#: Latency samples kept between two `take_latencies` calls, per operation.
_LATENCIES_KEPT = 4096
#: Presence answers kept (oldest dropped first): ~100 B each.
PRESENCE_ENTRIES = 1 << 20


@dataclass
class RemoteJobResult:
    """A finished job, as ``DiskJobResult`` describes one."""

    job_id: int
    kind: str  # "read" | "write"
    success: bool
    ok_keys: list[Key]
    failed_keys: list[Key]
    bytes: int
    seconds: float


@dataclass
class RemoteWriteTicket:
    """What `submit_write` accepted, as ``DiskWriteTicket`` describes it. The server evicts, so
    `evicted` is always empty."""

    job_id: int
    keys: list[Key]
    skipped: list[Key]
    refused: list[Key]
    evicted: list[Key] = field(default_factory=list)


@dataclass
class _Job:
    job_id: int
    kind: str
    keys: list[Key]
    offsets: list[int]
    started: float
    deadline: float  # on the tier's clock
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Set under `lock`: `abandoned` by poll past the deadline, `slots_done` once the worker is
    # done with the host slots (copied out of them, or into them).
    abandoned: bool = False
    slots_done: bool = False


@dataclass(frozen=True)
class RemoteOptions:
    """How a `RemoteTier` uses its store."""

    #: First part of every key (one per deployment). Default: "kvtier".
    prefix: str = "kvtier"
    #: Seconds a job may take before `poll` abandons it. Default: 1.0.
    deadline_s: float = 1.0
    #: Seconds a stored value lives (SET EX), or None for the server's eviction. Default: None.
    ttl_s: float | None = None
    #: Which offered blocks are written (see `Admission`). Default: "always".
    admission: str = "always"
    #: Bytes of writes in flight at most; beyond them writes are dropped. Default: 1 GiB.
    max_write_bytes: int = 1 << 30
    #: Seconds an "absent" answer is trusted (another replica may store the block). Default: 2.0.
    absent_ttl_s: float = 2.0
    #: Seconds a "present" answer is trusted (the server may evict it). Default: 60.0.
    present_ttl_s: float = 60.0
    #: Worker threads (connections in use at once). Default: 4.
    workers: int = 4

    def __post_init__(self) -> None:
        check_number("deadline_s", self.deadline_s)
        if self.ttl_s is not None:
            check_number("ttl_s", self.ttl_s)
        check_count("max_write_bytes", self.max_write_bytes)
        check_number("absent_ttl_s", self.absent_ttl_s, zero_ok=True)
        check_number("present_ttl_s", self.present_ttl_s, zero_ok=True)
        check_count("workers", self.workers)


def _counted_as(key: Key) -> Key:
    """`key` as the core's admission counts it: a block key longer than the core's keys (the
    value format takes up to MAX_KEY_BYTES) by a 16-byte digest of it."""
    if isinstance(key, bytes) and len(key) > CORE_KEY_BYTES:
        return hashlib.blake2b(key, digest_size=16).digest()
    return key


class RemoteTier:  # noqa: PLR0904 - the staging contract plus probes
    def __init__(
        self,
        connect: Callable[[], RedisCluster],
        fmt: ValueFormat,
        block_bytes: int,
        options: RemoteOptions | None = None,
        *,
        breaker: CircuitBreaker | None = None,
        clock: Callable[[], float] = time.monotonic,
        description: str = "",
    ) -> None:
        o = options or RemoteOptions()
        # The cluster client, made on first use by a worker: redis-py's connects (and
        # authenticates) in its constructor, and a store that is down at start-up must cost
        # misses, not a failed engine start or a blocked scheduler.
        self._connect = connect
        self._client: RedisCluster | None = None
        self._connect_lock = threading.Lock()
        self.format = fmt
        self.block_bytes = check_count("block_bytes", block_bytes)
        self.prefix = o.prefix
        self.deadline_s = o.deadline_s
        self.ttl_s = o.ttl_s
        # The core's rule and use counter, as the index's tiers have them; `uses:K` counts in a
        # fixed-size sketch, not one entry per key offered.
        self.admission = Admission(o.admission, PRESENCE_ENTRIES)
        self.max_write_bytes = o.max_write_bytes
        self.absent_ttl_s = o.absent_ttl_s
        self.present_ttl_s = o.present_ttl_s
        self.breaker = breaker or CircuitBreaker(clock=clock)
        self.description = description
        self._clock = clock
        self._pool = ThreadPoolExecutor(max_workers=o.workers, thread_name_prefix="kvtier-remote")
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # guards what the workers and the caller share below
        self._jobs: dict[int, _Job] = {}
        self._done: list[RemoteJobResult] = []
        self._idle = threading.Condition(self._lock)
        self._write_bytes = 0
        # key -> (present, when learned); oldest first
        self._presence: OrderedDict[Key, tuple[bool, float]] = OrderedDict()
        self._probing: set[Key] = set()
        self._probes_in_flight = 0
        self._closed = False
        self.counters: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self._counter_lock = threading.Lock()  # workers and the caller both count
        self.read_latency = LatencyRecorder()
        self.write_latency = LatencyRecorder()
        self.probe_latency = LatencyRecorder()
        # Seconds per operation since the last `take_latencies` (an engine's metrics histograms).
        self._new_latencies: dict[str, list[float]] = {"read": [], "write": [], "probe": []}

    # ---- the staging contract -------------------------------------------------------------------

    @property
    def slot_stride(self) -> int:
        """As the disk tier's: the payload rounded up to 4 KiB, plus a header page (the host slot
        must hold ``slot_stride - 4096`` bytes)."""
        return -(-self.block_bytes // _PAGE) * _PAGE + _PAGE

    def submit_write(
        self,
        keys: Sequence[Key],
        pool: HostPool,
        slots: Sequence[int],
        *,
        priority: int = 35,
        duration_s: float | None = None,
    ) -> RemoteWriteTicket:
        """Queue a write of each admitted block not known to be in the store already. The slots
        must not be rewritten until the job's result is taken: the worker copies out of them."""
        self._check_open()
        keys = key_list(keys)
        job_id = next(self._ids)
        take: list[Key] = []
        offsets: list[int] = []
        skipped: list[Key] = []
        refused: list[Key] = []
        too_long: list[Key] = []
        now = self._clock()
        for k, s in zip(keys, slots, strict=True):
            if self._known(k, now) is True:
                skipped.append(k)
            elif isinstance(k, bytes) and len(k) > MAX_KEY_BYTES:
                # The value format cannot hold it: refused here, not raised by a worker (which
                # would leave the job unreported until its deadline).
                too_long.append(k)
            elif not self.admission.offer(_counted_as(k), priority):
                refused.append(k)
            else:
                take.append(k)
                offsets.append(pool.slot_offset(s))
        self._count("writes_skipped_present", len(skipped))
        self._count("writes_refused_admission", len(refused))
        self._count("writes_failed", len(too_long))
        refused += too_long
        with self._lock:
            # As many as the bytes in flight allow (the leading blocks of a chain first); the
            # rest are dropped, never queued.
            room = max(0, self.max_write_bytes - self._write_bytes) // self.block_bytes
            if len(take) > room:
                self._count("writes_dropped_backlog", len(take) - room)
                refused += take[room:]
                take, offsets = take[:room], offsets[:room]
            # Asked last, only for a job that goes to the store: past a cool-down `allows` hands
            # out the breaker's one probe, and a probe that sends nothing would never be answered
            # (the breaker would stay probing, refusing everything, for good).
            if take and not self.breaker.allows():
                self._count("writes_refused_breaker", len(take))
                refused += take
                take, offsets = [], []
            nbytes = len(take) * self.block_bytes
            job = _Job(job_id, "write", take, offsets, now, self._deadline(now, nbytes))
            if take:
                self._write_bytes += nbytes
                self._jobs[job_id] = job
            else:
                self._done.append(RemoteJobResult(job_id, "write", True, [], [], 0, 0.0))
        if take:
            self._pool.submit(self._run_write, job, memoryview(pool))
        return RemoteWriteTicket(job_id, take, skipped, refused)

    def submit_read(self, keys: Sequence[Key], pool: HostPool, slots: Sequence[int]) -> int:
        """Start reading block ``keys[i]`` into host slot ``slots[i]``; each value is verified
        before its payload is copied into the slot."""
        self._check_open()
        keys = key_list(keys)
        now = self._clock()
        offsets = [pool.slot_offset(s) for s in slots]
        job = _Job(next(self._ids), "read", keys, offsets, now, self._deadline(now, len(keys) * self.block_bytes))
        with self._lock:
            self._jobs[job.job_id] = job
        self._pool.submit(self._run_read, job, memoryview(pool))
        return job.job_id

    def poll(self) -> list[RemoteJobResult]:
        """Finished jobs since the last call, and jobs past their deadline, abandoned."""
        self._abandon_late()
        with self._lock:
            done, self._done = self._done, []
        return done

    def try_take(self, job_id: int) -> RemoteJobResult | None:
        with self._lock:
            for i, r in enumerate(self._done):
                if r.job_id == job_id:
                    return self._done.pop(i)
        return None

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no job or probe runs; False on timeout."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._idle:
                if not self._jobs and not self._probes_in_flight:
                    return True
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(0.05 if left is None else min(left, 0.05))
            # A job past its deadline is abandoned here, as poll would.
            self._abandon_late()

    def contains(self, keys: Sequence[Key]) -> list[bool]:
        """Whether each block is known to be in the store (learned from writes and probes, not
        expired). Never calls the store; False while the breaker is open."""
        if self._closed or self.breaker.state is BreakerState.OPEN:
            return [False] * len(keys)
        now = self._clock()
        return [self._known(k, now) is True for k in keys]

    def lookup_prefix(self, keys: Sequence[Key]) -> int:
        n = 0
        for held in self.contains(keys):
            if not held:
                break
            n += 1
        return n

    def renew(self, keys: Sequence[Key], *, priority: int = 35, duration_s: float | None = None) -> int:
        """Retention is the server's (its LRU, or the TTL): nothing to renew from here."""
        return 0

    # ---- probes ---------------------------------------------------------------------------------

    def known(self, key: Key) -> bool | None:
        """What this process knows of `key`: True (in the store), False (absent), None (not
        known, or the answer expired)."""
        return self._known(key, self._clock())

    @property
    def probes_in_flight(self) -> int:
        """Probes sent and not answered yet (a plain read: the engine asks at every step)."""
        return self._probes_in_flight

    def probing(self, key: Key) -> bool:
        return key in self._probing

    def probe(self, keys: Sequence[Key]) -> bool:
        """Ask the store, in one batched round trip per shard, which of `keys` it holds; the
        answers reach `contains` when the probe finishes. Returns False if nothing was asked (all
        known or being asked already, the breaker open, or closed)."""
        if self._closed:
            return False
        now = self._clock()
        ask = [k for k in key_list(keys) if k not in self._probing and self._known(k, now) is None]
        if not ask or not self.breaker.allows():
            return False
        self._probing.update(ask)
        with self._lock:
            self._probes_in_flight += 1
        self._count("probes")
        self._count("probe_keys", len(ask))
        self._pool.submit(self._run_probe, ask)
        return True

    def wait_answered(self, keys: Sequence[Key], timeout: float) -> bool:
        """Wait up to `timeout` seconds until no probe of `keys` is in flight; whether none is
        (their answers then reach `contains`)."""
        end = time.monotonic() + timeout
        with self._idle:
            while any(k in self._probing for k in keys):
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    # ---- workers --------------------------------------------------------------------------------

    def _run_probe(self, keys: list[Key]) -> None:
        t0 = time.monotonic()
        try:
            pipe = self._cluster().pipeline(transaction=False)
            for k in keys:
                pipe.exists(self._store_key(k))
            found = pipe.execute(raise_on_error=True)
        except _STORE_ERRORS as e:
            self._failed("probe", e)
            found = None
        else:
            self.breaker.succeeded()
            self._observe("probe", time.monotonic() - t0)
        now = self._clock()
        with self._lock:
            # A failed probe answers "absent" until absent_ttl_s: the lookups that wait on it
            # go on as misses, rather than asking a failing store again at every step.
            for k, n in zip(keys, found or [0] * len(keys), strict=True):
                self._learn(k, bool(n), now)
            self._probing.difference_update(keys)
            self._probes_in_flight -= 1
            self._idle.notify_all()

    def _run_write(self, job: _Job, view: memoryview) -> None:
        t0 = time.monotonic()
        n = self.block_bytes
        fmt = self.format
        with job.lock:
            if job.abandoned:
                return
            # The checks are taken from the slots while they cannot change: they stay pinned
            # until this job is reported. Once poll abandons it they may be rewritten, and a
            # payload copied from them below may be another block's: such a value fails its
            # check on every read (a counted miss), never verifies.
            heads = [fmt.header(_key_bytes(k), n) for k in job.keys]
            checks = [fmt.check(h, view[o : o + n]) for h, o in zip(heads, job.offsets, strict=True)]
            job.slots_done = True
        ok: list[Key] = []
        failed: list[Key] = []
        full = 0
        try:
            for lo, hi in _batches(len(job.keys), n):
                if not self._still_running(job):
                    break  # abandoned: its slots are no longer this job's to read
                # Each value is assembled (header, check, payload: the one copy of the payload)
                # in this worker's send buffer, reused from one pipeline to the next.
                sizes = [len(heads[i]) + CHECK_BYTES + n for i in range(lo, hi)]
                buf = _send_buffer(sum(sizes))
                pipe = self._cluster().pipeline(transaction=False)
                pos = 0
                for i, size in zip(range(lo, hi), sizes, strict=True):
                    head, body = heads[i], pos + len(heads[i]) + CHECK_BYTES
                    buf[pos : pos + len(head)] = head
                    buf[pos + len(head) : body] = checks[i]
                    buf[body : pos + size] = view[job.offsets[i] : job.offsets[i] + n]
                    value = buf[pos : pos + size]
                    pos += size
                    key = self._store_key(job.keys[i])
                    if self.ttl_s:
                        pipe.set(key, value, nx=True, ex=max(1, round(self.ttl_s)))
                    else:
                        pipe.set(key, value, nx=True)
                replies = pipe.execute(raise_on_error=False)
                for k, r in zip(job.keys[lo:hi], replies, strict=True):
                    full += self._count_write(k, r, ok, failed)
        except _STORE_ERRORS as e:
            self._failed("write", e)
            failed = [k for k in job.keys if k not in set(ok)]
        else:
            # Every job reports an outcome (it may carry the breaker's probe, which must not go
            # unanswered): a full server (OOM) answers, and reads go on; writes all refused
            # otherwise are a failure.
            if ok or not failed or full:
                self.breaker.succeeded()
            else:
                self.breaker.failed()
        now = self._clock()
        with self._lock:
            for k in ok:
                self._learn(k, True, now)
        self._finish(job, ok, failed, len(ok) * n, time.monotonic() - t0)

    def _count_write(self, key: Key, reply: object, ok: list[Key], failed: list[Key]) -> bool:
        """Count one SET NX reply; True if the server refused it for being full."""
        if reply is True:
            ok.append(key)
            self._count("writes_ok")
            self._count("bytes_written", self.block_bytes)
        elif reply is None:
            # SET NX found a value: another replica stored the block first.
            ok.append(key)
            self._count("writes_skipped_present")
        else:
            failed.append(key)
            # "OOM command not allowed when used memory > 'maxmemory'": the server is full.
            # redis-py's parser takes the "OOM" code off the message and raises this class.
            full = isinstance(reply, redis.exceptions.OutOfMemoryError) or (
                isinstance(reply, redis.ResponseError) and str(reply).startswith("OOM")
            )
            self._count("writes_refused_full" if full else "writes_failed")
            return full
        return False

    def _run_read(self, job: _Job, view: memoryview) -> None:
        t0 = time.monotonic()
        n = self.block_bytes
        ok: list[Key] = []
        failed: list[tuple[Key, Miss]] = []
        batches = _batches(len(job.keys), n)
        try:
            for lo, hi in batches:
                pipe = self._cluster().pipeline(transaction=False)
                for k in job.keys[lo:hi]:
                    pipe.get(self._store_key(k))
                values = pipe.execute(raise_on_error=True)
                # Each pipeline's values are verified and copied as they arrive, then dropped:
                # a job holds one pipeline's values at a time (64 MiB), not all of its own.
                if not self._take_values(job, view, lo, values, ok, failed, last=hi == len(job.keys)):
                    return  # abandoned: poll reported (and counted) its keys already
        except _STORE_ERRORS as e:
            self._failed("read", e)
            with job.lock:
                if job.abandoned:
                    return  # poll reported (and counted) its keys already
                job.slots_done = True  # reported by this worker: poll leaves it alone
            self._miss(Miss.ERROR, len(job.keys))
            self._finish(job, [], list(job.keys), 0, time.monotonic() - t0)
            return
        self.breaker.succeeded()
        now = self._clock()
        with self._lock:
            for k, _ in failed:
                self._learn(k, False, now)
        for _, reason in failed:
            self._miss(reason, 1)
        self._count("hits", len(ok))
        self._count("bytes_read", len(ok) * n)
        self._finish(job, ok, [k for k, _ in failed], len(ok) * n, time.monotonic() - t0)

    def _take_values(
        self,
        job: _Job,
        view: memoryview,
        lo: int,
        values: list[bytes | None],
        ok: list[Key],
        failed: list[tuple[Key, Miss]],
        *,
        last: bool,
    ) -> bool:
        """Verify one pipeline's values (of keys `lo`...) and copy each that verifies into its
        slot; False, touching no slot, once `poll` has abandoned the job."""
        n = self.block_bytes
        keys = job.keys[lo : lo + len(values)]
        opened = [self.format.open(_key_bytes(k), v, n) for k, v in zip(keys, values, strict=True)]
        with job.lock:
            if job.abandoned:
                return False
            for k, off, got in zip(keys, job.offsets[lo : lo + len(values)], opened, strict=True):
                if isinstance(got, Miss):
                    failed.append((k, got))
                else:
                    view[off : off + n] = got
                    ok.append(k)
            if last:
                job.slots_done = True
        return True

    def _finish(self, job: _Job, ok: list[Key], failed: list[Key], nbytes: int, seconds: float) -> None:
        self._observe(job.kind, seconds)
        with self._lock:
            if self._jobs.pop(job.job_id, None) is None:
                return  # abandoned: its result was reported already
            if job.kind == "write":
                self._write_bytes -= len(job.keys) * self.block_bytes
            self._done.append(RemoteJobResult(job.job_id, job.kind, not failed, ok, failed, nbytes, seconds))
            self._idle.notify_all()

    def _abandon_late(self) -> None:
        now = self._clock()
        with self._lock:
            late = [j for j in self._jobs.values() if now > j.deadline]
        for job in late:
            self._abandon(job, now)

    def _abandon(self, job: _Job, now: float) -> None:
        """Report a job past its deadline as failed. Waits for a worker copying into or out of
        its slots: after this, no worker touches them."""
        with job.lock:
            if job.kind == "read" and job.slots_done:
                return  # verified and copied: about to be reported by its worker
            job.abandoned = job.kind == "read" or not job.slots_done
        with self._lock:
            if self._jobs.pop(job.job_id, None) is None:
                return
            if job.kind == "write":
                self._write_bytes -= len(job.keys) * self.block_bytes
            self._count("deadline_exceeded")
            if job.kind == "read":
                self._miss(Miss.ERROR, len(job.keys))
            self._done.append(RemoteJobResult(job.job_id, job.kind, False, [], list(job.keys), 0, now - job.started))
            self._idle.notify_all()
        self.breaker.failed()

    # ---- helpers --------------------------------------------------------------------------------

    def _deadline(self, now: float, nbytes: int) -> float:
        """When a job moving `nbytes` is abandoned: `deadline_s`, plus the time the bytes take at
        the slowest link the tier is meant for (big batches of big blocks take seconds)."""
        return now + self.deadline_s + nbytes / DEADLINE_FLOOR_BYTES_PER_S

    def _still_running(self, job: _Job) -> bool:
        with self._lock:
            return job.job_id in self._jobs

    def _cluster(self) -> RedisCluster:
        with self._connect_lock:
            if self._client is None:
                self._client = self._connect()
            return self._client

    def _store_key(self, key: Key) -> bytes:
        return store_key(self.prefix, self.format.namespace, _key_bytes(key))

    def _known(self, key: Key, now: float) -> bool | None:
        got = self._presence.get(key)
        if got is None:
            return None
        present, when = got
        if now - when > (self.present_ttl_s if present else self.absent_ttl_s):
            return None
        return present

    def _learn(self, key: Key, present: bool, now: float) -> None:
        """Record an answer (caller holds `_lock`)."""
        self._presence.pop(key, None)
        self._presence[key] = (present, now)
        if len(self._presence) > PRESENCE_ENTRIES:
            self._presence.popitem(last=False)

    def _observe(self, op: str, seconds: float) -> None:
        {"read": self.read_latency, "write": self.write_latency, "probe": self.probe_latency}[op].observe(seconds)
        with self._counter_lock:
            recent = self._new_latencies[op]
            if len(recent) < _LATENCIES_KEPT:
                recent.append(seconds)

    def take_latencies(self) -> dict[str, list[float]]:
        """Seconds per read, write and probe since the last call (at most a few thousand of
        each between two calls: the rest are only in the recorders)."""
        with self._counter_lock:
            out, self._new_latencies = self._new_latencies, {"read": [], "write": [], "probe": []}
        return out

    def _count(self, name: str, n: int = 1) -> None:
        with self._counter_lock:
            self.counters[name] += n

    def _miss(self, reason: Miss, n: int) -> None:
        self._count(f"miss_{reason.value}", n)

    def _failed(self, op: str, e: BaseException) -> None:
        self._count(f"{op}_errors")
        self.breaker.failed()
        if self.counters[f"{op}_errors"] == 1:
            log.warning("kvtier remote tier %s: %s failed (%s); later failures are counted", self.description, op, e)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("remote tier: used after close()")

    def forget(self) -> None:
        """Drop what this process learned of the store (after a cache reset)."""
        with self._lock:
            self._presence.clear()

    def stats(self) -> dict[str, Any]:
        with self._counter_lock:
            d: dict[str, Any] = dict(self.counters)
        d["breaker_state"] = int(self.breaker.state)
        d["breaker_trips"] = self.breaker.trips
        d["jobs_in_flight"] = len(self._jobs)
        d["probes_in_flight"] = self._probes_in_flight
        d["write_bytes_in_flight"] = self._write_bytes
        d["known_blocks"] = len(self._presence)
        return d

    def close(self) -> None:
        if self._closed:
            return
        self.wait_idle(self.deadline_s * 2)
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._client is not None:
            self._client.close()


#: What an operation on the store may raise: the client's errors (a timeout, a node down, a
#: refused login; cluster discovery's are not RedisErrors) and the socket's.
_STORE_ERRORS = (redis.RedisError, redis.exceptions.RedisClusterException, OSError)

_COUNTERS = (
    "hits",
    "bytes_read",
    "bytes_written",
    "writes_ok",
    "writes_skipped_present",
    "writes_refused_admission",
    "writes_refused_breaker",
    "writes_refused_full",
    "writes_dropped_backlog",
    "writes_failed",
    "probes",
    "probe_keys",
    "probe_errors",
    "read_errors",
    "write_errors",
    "deadline_exceeded",
    *(f"miss_{m.value}" for m in Miss),
)


#: Each worker thread's send buffer (see `_send_buffer`).
_WORKER = threading.local()


def _send_buffer(nbytes: int) -> memoryview:
    """This worker's buffer of at least `nbytes`, kept from one pipeline to the next: a fresh
    allocation per value costs as much as the copy into it (its pages fault in one by one). It
    holds one pipeline's values: PIPELINE_BYTES, or one block if a block is larger."""
    buf: bytearray | None = getattr(_WORKER, "buf", None)
    if buf is None or len(buf) < nbytes:
        buf = _WORKER.buf = bytearray(nbytes)
    return memoryview(buf)


def _key_bytes(key: Key) -> bytes:
    """A block key as the store and the value format take it: bytes as they are, an int key (a
    u64, as the core takes it) as its 8 little-endian bytes."""
    return key if isinstance(key, bytes) else int(key).to_bytes(8, "little")


def _batches(count: int, value_bytes: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of at most PIPELINE_BYTES of values each (at least one value)."""
    per = max(1, PIPELINE_BYTES // max(value_bytes, 1))
    return [(lo, min(lo + per, count)) for lo in range(0, count, per)]
