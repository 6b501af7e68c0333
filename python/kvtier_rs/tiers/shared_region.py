"""The CPU tier's host memory shared by every process of one engine, and the seals that say
which block each slot's bytes belong to.

A serving engine runs its scheduler and its model workers in separate processes (vLLM's
multiprocess executor, tensor and pipeline parallelism). The scheduler owns the tiers' index
and the disk tier's I/O; the workers copy between device memory and host slots. Both must
read and write the *same* bytes: private allocations in each process silently diverge (the
scheduler writes to disk, and promotes into, memory no worker ever fills). So the host memory
is one file in ``/dev/shm`` that every process maps:

    [ header page | seals: rows x ranks x u64, page-padded | rows: rows x row_bytes ]

* The header names the geometry (rows, row bytes, ranks) and records, per worker rank, the
  pid that mapped it: the scheduler checks that every rank is attached before it serves, so a
  layout in which the workers' memory is not the scheduler's (another machine, another
  engine) is refused at start, not discovered as wrong tokens.
* A row is one host slot (one block of every rank: rank r's part starts at ``r *
  rank_bytes``), page-aligned for O_DIRECT and for pinning.
* A seal is a 64-bit tag of the block key whose bytes a rank's part of a row holds, written
  by whoever completed the write (a worker after its device -> host copy, the scheduler after
  a verified disk read) and checked by whoever reads the row (a worker before a host -> device
  copy, the scheduler before a disk write-through). A row whose seal does not match the key
  it is read for is never served or persisted: this catches any layout bug of the kind above
  even where the start-up check cannot.

The file's name is unlinked once the scheduler has checked every rank (mappings outlive the
name), so no exit path, SIGKILL included, leaves it behind after start-up; the creator also
unlinks it when it closes.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import re
import struct
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from kvtier_rs._core import HostPool, KvTierError
from kvtier_rs.checks import invalid_argument
from kvtier_rs.tiers.keys import Key

log = logging.getLogger(__name__)

_PAGE = mmap.PAGESIZE
_MAGIC = b"KVTSHM01"
# magic, header version, rows, row_bytes, ranks, rank_bytes
_HEAD = struct.Struct("<8sQQQQQ")
_VERSION = 1
_ATTACH_AT = 512  # the attach table (one u64 pid a rank) starts here in the header page
_MAX_RANKS = (_PAGE - _ATTACH_AT) // 8
#: How long a process that finds the file waits for its creator to size and describe it.
JOIN_TIMEOUT_S = 60.0


def default_dir() -> Path:
    """Where regions live: ``/dev/shm`` (memory, not disk), else the temporary directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))


def seal_of(key: Key) -> int:
    """The 64-bit seal of a block key (never 0, which means "nothing sealed")."""
    raw = key if isinstance(key, bytes) else int(key).to_bytes(8, "little", signed=False)
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") | 1


def seals_of(keys: Iterable[Key]) -> np.ndarray:
    return np.fromiter((seal_of(k) for k in keys), dtype=np.uint64)


class SlotSeals:
    """The seal table of a region: ``table[row, rank]`` is the seal of the key whose bytes
    rank's part of the row holds (0: none)."""

    def __init__(self, table: np.ndarray) -> None:
        self.table = table
        self.ranks = table.shape[1]

    def seal(self, rows: Sequence[int] | np.ndarray, seals: np.ndarray, rank: int | None = None) -> None:
        """Record that `rows` now hold the blocks sealed `seals`: one rank's part, or every
        rank's (`rank=None`: a whole row written at once, as a disk read does)."""
        idx = np.asarray(rows, dtype=np.int64)
        if rank is None:
            self.table[idx, :] = np.asarray(seals, dtype=np.uint64)[:, None]
        else:
            self.table[idx, rank] = seals

    def clear(self, rows: Sequence[int]) -> None:
        """Forget what `rows` held: they are about to be written for other blocks."""
        self.table[np.asarray(rows, dtype=np.int64), :] = 0

    def matches(self, rows: Sequence[int] | np.ndarray, seals: np.ndarray, rank: int | None = None) -> np.ndarray:
        """Per row: whether it holds the block sealed so (in `rank`'s part, or in every rank's)."""
        idx = np.asarray(rows, dtype=np.int64)
        want = np.asarray(seals, dtype=np.uint64)
        if rank is None:
            return np.all(self.table[idx, :] == want[:, None], axis=1)
        return self.table[idx, rank] == want


def region_name(engine_id: str) -> str:
    """A file name for an engine id (any string): safe characters, bounded length."""
    return "kvtier-" + re.sub(r"[^A-Za-z0-9._-]+", "_", engine_id)[-100:] + ".region"


def _alive(pid: int) -> int:
    if pid == 0:
        return 0
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return 0
    except PermissionError:
        return pid  # alive, another user's
    return pid


class SharedHostRegion:
    """One engine's host slots in a file every process of the engine maps (see the module).

    Each process opens it with the same geometry: the first creates it (O_EXCL), the others
    wait for it to be described and check that they agree. ``rank``: the worker rank this
    process maps it for (recorded in the attach table), or None for the scheduler.

    Raises InvalidArgumentError (naming `what`, the user's setting) when the memory cannot be
    had: too little room in the region's filesystem, or a region of the same name with another
    geometry.
    """

    def __init__(
        self,
        name: str,
        *,
        rows: int,
        row_bytes: int,
        ranks: int,
        rank_bytes: int,
        rank: int | None,
        directory: Path | None = None,
        what: str = "total_bytes",
        join_timeout_s: float = JOIN_TIMEOUT_S,
    ) -> None:
        if rows <= 0:
            raise invalid_argument(what, f"cannot hold one slot of {row_bytes} bytes")
        if rows > 2**32:
            raise invalid_argument(what, f"more than 2^32 slots of {row_bytes} bytes")
        if row_bytes <= 0 or row_bytes % _PAGE:
            raise invalid_argument("row_bytes", f"{row_bytes} is not a positive multiple of {_PAGE}")
        if not 1 <= ranks <= _MAX_RANKS:
            raise invalid_argument("ranks", f"{ranks} is not in 1..{_MAX_RANKS}")
        if rank_bytes * ranks > row_bytes:
            raise invalid_argument("rank_bytes", f"{ranks} ranks of {rank_bytes} bytes overflow a row of {row_bytes}")
        if rank is not None and not 0 <= rank < ranks:
            raise invalid_argument("rank", f"{rank} is not in 0..{ranks - 1}")
        self.rows, self.row_bytes, self.ranks, self.rank_bytes, self.rank = rows, row_bytes, ranks, rank_bytes, rank
        self.seals_offset = _PAGE
        seal_bytes = -(-rows * ranks * 8 // _PAGE) * _PAGE
        self.rows_offset = _PAGE + seal_bytes
        self.total_bytes = self.rows_offset + rows * row_bytes
        self.path = (directory or default_dir()) / name
        self._what = what
        self._creator = False
        self._fd = self._open(what, join_timeout_s)
        try:
            self._mm = mmap.mmap(self._fd, self.total_bytes, flags=mmap.MAP_SHARED)
        except BaseException:
            self._abandon()
            raise
        if self._creator:
            # Described last: a joiner trusts the geometry once the magic is there.
            self._mm[8 : _HEAD.size] = _HEAD.pack(_MAGIC, _VERSION, rows, row_bytes, ranks, rank_bytes)[8:]
            self._mm[0:8] = _MAGIC
        view = memoryview(self._mm)
        self._seal_view = view[self.seals_offset : self.seals_offset + rows * ranks * 8]
        self.seals = SlotSeals(np.frombuffer(self._seal_view, dtype=np.uint64).reshape(rows, ranks))
        self._rows_view = view[self.rows_offset :]
        self.pool: HostPool | None = HostPool.wrap(self._rows_view, row_bytes)
        if rank is not None:
            self.attach(rank)

    # ---- opening ------------------------------------------------------------------------------

    def _open(self, what: str, join_timeout_s: float) -> int:
        flags = os.O_RDWR | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(self.path, flags | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            fd = os.open(self.path, flags)
            self._wait_for_size(fd, join_timeout_s)
            return fd
        self._creator = True
        try:
            fs = os.statvfs(fd)
            free = fs.f_bavail * fs.f_frsize
            if free < self.total_bytes:
                raise invalid_argument(
                    what,
                    f"the CPU tier needs {self.total_bytes} bytes of shared memory in "
                    f"{self.path.parent}, which has {free} free (in a container, raise its --shm-size, or use "
                    f"a smaller `{what}`)",
                )
            os.ftruncate(fd, self.total_bytes)
        except BaseException:
            self._fd = fd
            self._abandon()
            raise
        return fd

    def _wait_for_size(self, fd: int, timeout_s: float) -> None:
        """A joiner: wait for the creator to size and describe the file, and check that it
        describes this process's geometry (the creator sizes the file whole, then writes the
        header, magic last)."""
        deadline = time.monotonic() + timeout_s
        while True:
            head = os.pread(fd, _HEAD.size, 0)
            if len(head) == _HEAD.size and head[:8] == _MAGIC:
                break
            if os.fstat(fd).st_nlink == 0:
                os.close(fd)
                raise KvTierError(f"kvtier: the process creating {self.path} gave up before describing it")
            if time.monotonic() > deadline:
                os.close(fd)
                raise KvTierError(f"kvtier: {self.path} was not described by its creator in {timeout_s:.0f} s")
            time.sleep(0.005)
        _, version, rows, row_bytes, ranks, rank_bytes = _HEAD.unpack(head)
        mine = (_VERSION, self.rows, self.row_bytes, self.ranks, self.rank_bytes)
        theirs = (version, rows, row_bytes, ranks, rank_bytes)
        if theirs != mine or os.fstat(fd).st_size < self.total_bytes:
            os.close(fd)
            raise invalid_argument(
                self._what,
                f"{self.path} was created by another process with (version, rows, "
                f"row bytes, ranks, rank bytes) = {theirs}, this one needs {mine}; the engine's processes must "
                "agree on the CPU tier's size and layout (a file left by an engine killed during start-up "
                "under the same engine id can be removed)",
            )

    def _abandon(self) -> None:
        os.close(self._fd)
        if self._creator:
            self.unlink()

    # ---- after start-up -----------------------------------------------------------------------

    def attach(self, rank: int) -> None:
        """Record that this process serves worker `rank` on this region."""
        if not 0 <= rank < self.ranks:
            raise invalid_argument("rank", f"{rank} is not in 0..{self.ranks - 1}")
        struct.pack_into("<Q", self._mm, _ATTACH_AT + 8 * rank, os.getpid())

    def attached_pids(self) -> list[int]:
        """Per worker rank, the live pid that mapped the region (0: none, or one that died: a
        file left by an engine killed during start-up and reused under the same engine id)."""
        return [_alive(struct.unpack_from("<Q", self._mm, _ATTACH_AT + 8 * r)[0]) for r in range(self.ranks)]

    def require_attached(self, who: str) -> None:
        """Refuse to serve unless every worker rank mapped this very region: otherwise the
        scheduler's view of host memory is not the workers'."""
        missing = [r for r, pid in enumerate(self.attached_pids()) if pid == 0]
        if missing:
            raise KvTierError(
                f"kvtier: {who}: worker rank(s) {missing} of {self.ranks} have not mapped the CPU tier's shared "
                f"memory {self.path}; kvtier needs the scheduler and every worker of an engine on one machine, "
                "sharing /dev/shm (multi-node engines are not supported)"
            )

    def unlink(self) -> None:
        """Drop the file's name (mappings stay valid until each process closes its own)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            self._creator = False  # gone already
            return
        except OSError as e:
            log.warning("kvtier: could not remove %s: %s", self.path, e)
        self._creator = False

    def close(self) -> None:
        """Unmap (once nothing uses the pool any more); the creator also drops the name."""
        if self._creator:
            self.unlink()
        self.pool = None
        self.seals = SlotSeals(np.zeros((0, self.ranks), dtype=np.uint64))
        # A pool or array over the memory may still be alive somewhere: the mapping then goes
        # with the last of them (or with the process).
        with contextlib.suppress(BufferError):
            self._seal_view.release()
            self._rows_view.release()
            self._mm.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
