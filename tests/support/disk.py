"""Shared helpers for the disk-tier tests: deterministic payloads, a host pool, and
write/read round trips through the asynchronous API; and a way to run a call while another
thread waits for the GIL (the binding's GIL tests use it too)."""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import itertools
import operator
import os
import sys
import threading
import time

import numpy as np
import pytest

from kvtier_rs._core import DiskTier, HostPool, io_uring_probe

ENGINES = ["pool", "io_uring"]
PAGE = 4096
# Not a multiple of 4 KiB on purpose: the padding path is exercised everywhere.
BLOCK = 12_000


def stride(block: int = BLOCK) -> int:
    return -(-block // PAGE) * PAGE + PAGE


def require_engine(engine: str) -> None:
    """Skip loudly, with the probe's own reason, when io_uring is forbidden here."""
    if engine == "io_uring":
        why = io_uring_probe()
        if why is not None:
            pytest.skip(f"SKIPPED LOUDLY: io_uring unavailable on this machine: {why}")


def make_tier(path, engine: str, blocks: int = 16, block: int = BLOCK, **kw) -> DiskTier:
    kw.setdefault("admission", "always")
    kw.setdefault("queue_depth", 4)
    return DiskTier(str(path), blocks * stride(block), block, engine=engine, **kw)


def make_pool(slots: int, block: int = BLOCK) -> HostPool:
    return HostPool(slots * (-(-block // PAGE) * PAGE), block)


def payload(key: int | bytes, n: int = BLOCK) -> bytes:
    seed = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    rng = np.random.default_rng(int.from_bytes(seed, "little"))
    return rng.integers(0, 256, n, dtype=np.uint8).tobytes()


class Host:
    """A host pool with helpers to fill and read slot payloads."""

    def __init__(self, slots: int, block: int = BLOCK) -> None:
        self.block = block
        self.pool = make_pool(slots, block)
        self.mem = np.frombuffer(self.pool, dtype=np.uint8)

    def put(self, slot: int, data: bytes) -> None:
        off = self.pool.slot_offset(slot)
        self.mem[off : off + self.block] = np.frombuffer(data, dtype=np.uint8)

    def get(self, slot: int) -> bytes:
        off = self.pool.slot_offset(slot)
        return self.mem[off : off + self.block].tobytes()

    def scribble(self, slot: int) -> None:
        off = self.pool.slot_offset(slot)
        self.mem[off : off + self.block] = 0xEE


def write(tier: DiskTier, host: Host, keys: list, first_slot: int = 0):
    """Write payload(key) for each key; returns (ticket, result)."""
    slots = list(range(first_slot, first_slot + len(keys)))
    for k, s in zip(keys, slots, strict=True):
        host.put(s, payload(k, host.block))
    ticket = tier.submit_write(keys, host.pool, slots)
    return ticket, tier.wait(ticket.job_id, timeout=60)


def read(tier: DiskTier, host: Host, keys: list, first_slot: int = 0) -> dict:
    """Read keys into host slots; returns {key: bytes} for the keys reported ok, after
    checking that every ok key is byte-exact (the property all fault tests rely on)."""
    slots = list(range(first_slot, first_slot + len(keys)))
    for s in slots:
        host.scribble(s)
    job = tier.submit_read(keys, host.pool, slots)
    res = tier.wait(job, timeout=60)
    assert res is not None, "read job did not finish within 60 s"
    got = {}
    ok = set(res.ok_keys)
    assert ok.isdisjoint(res.failed_keys)
    assert len(ok) + len(res.failed_keys) == len(keys)
    for k, s in zip(keys, slots, strict=True):
        if k in ok:
            data = host.get(s)
            assert data == payload(k, host.block), f"wrong bytes served for key {k!r}"
            got[k] = data
        else:
            # A failed read must not leave the stale or unverified bytes in place.
            assert host.get(s) != payload(k, host.block)
    return got


def tier_threads_and_fds() -> tuple[list[str], int]:
    """The disk tier threads alive in this process (by name) and the number of open fds."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that exited meanwhile
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
    return sorted(n for n in names if n.startswith("kvtier")), len(os.listdir("/proc/self/fd"))


def assert_back_to(before: tuple[list[str], int], what: str) -> None:
    """Wait (at most 60 s) for the tier threads and fd count to be back at `before`: a joined
    thread may still be listed for a moment."""
    deadline = time.monotonic() + 60
    while tier_threads_and_fds() != before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tier_threads_and_fds() == before, f"{what}: threads or fds leaked"


class HeldReads:
    """A disk tier whose read completions are held back (a stuck or slow device) until
    `release` is set; everything else goes to the tier itself."""

    def __init__(self, disk) -> None:
        self._disk = disk
        self.held: list = []
        self.release = False

    def __getattr__(self, name):
        return getattr(self._disk, name)

    def poll(self):
        out = []
        for r in self._disk.poll():
            (out if r.kind != "read" else self.held).append(r)
        if self.release:
            out, self.held = out + self.held, []
        return out


_NEVER = object()


def call_once_the_gil_is_asked_for(call, waiter: threading.Thread, in_call: list) -> None:
    """Run `call()` once `waiter`, waiting for the GIL, has asked for it, with an item in
    `in_call` from just before the call until it returns (left there if it raises) and no
    bytecode run in between (C iterators only: the interpreter hands the GIL over only between
    bytecodes, or where C code releases it). A thread that releases the GIL another has asked
    for waits until that one has it (CPython's forced switch), so `waiter` gets it while
    `in_call` holds the item exactly when the call releases the GIL, however late the OS
    schedules it. `waiter` must already be in a loop that reads `in_call` and makes no call:
    such a loop gives the GIL up only at its jump back, so it acts on the item before it can
    lose the GIL again."""
    cpu = functools.partial(time.clock_gettime, time.pthread_getcpuclockid(waiter.ident))
    now, first = itertools.tee(iter(cpu, None))
    # The waiter's CPU time since the first reading. While this thread holds the GIL the waiter
    # can only be waiting for it, and it asks for it after each switch interval of that wait:
    # 200 us of its CPU time is dozens of intervals (a few us each).
    waited = map(operator.sub, now, itertools.accumulate(first, min))
    steps = itertools.chain(
        iter(functools.partial(in_call.append, True), None),  # append returns None: stops at once
        itertools.takewhile(functools.partial(operator.gt, 200e-6), waited),
        itertools.islice(iter(call, _NEVER), 1),  # call() once
        iter(in_call.clear, None),
    )
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # the waiter asks often, so its 200 us come quickly
    try:
        collections.deque(steps, maxlen=0)
    finally:
        sys.setswitchinterval(old)
