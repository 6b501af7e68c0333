"""What the data path needs of a disk tier: the contract ``DiskStager`` and ``TierOrchestrator``
are written against. ``kvtier_rs.DiskTier`` (the Rust core's) is the implementation; the remote
tier (``tiers.remote.RemoteTier``) keeps the same contract, so the same stager drives it.

Every method is called from the engine's scheduler thread; none may block on I/O except
``wait_idle``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from kvtier_rs._core import HostPool
from kvtier_rs.tiers.keys import Key


class WriteTicket(Protocol):
    """What a write submission accepted (``DiskWriteTicket``, or the remote tier's)."""

    @property
    def job_id(self) -> int: ...
    @property
    def keys(self) -> list[Key]: ...
    @property
    def skipped(self) -> list[Key]: ...
    @property
    def refused(self) -> list[Key]: ...
    @property
    def evicted(self) -> list[Key]: ...


class JobResult(Protocol):
    """A finished job (``DiskJobResult``, or the remote tier's)."""

    @property
    def job_id(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def success(self) -> bool: ...
    @property
    def ok_keys(self) -> list[Key]: ...
    @property
    def failed_keys(self) -> list[Key]: ...
    @property
    def bytes(self) -> int: ...
    @property
    def seconds(self) -> float: ...


class StagingDisk(Protocol):
    """A tier of blocks on a local device, staged through a host pool."""

    @property
    def block_bytes(self) -> int:
        """Payload bytes of one block."""
        ...

    @property
    def slot_stride(self) -> int:
        """Bytes one block takes on the device (payload rounded up, plus its header page); a
        host slot must hold ``slot_stride - 4096`` bytes."""
        ...

    def submit_write(
        self,
        keys: Sequence[Key],
        pool: HostPool,
        slots: Sequence[int],
        *,
        priority: int = 35,
        duration_s: float | None = None,
    ) -> WriteTicket:
        """Start writing block ``keys[i]`` from host slot ``slots[i]``.

        Preconditions: the slots hold the blocks' bytes and are not rewritten until the job's
        result is taken (``poll``/``try_take``).

        The implementation is responsible for:
        * applying its admission rule and reporting what it refused, skipped (already held) and
          evicted to make room, in the ticket;
        * making a block readable only once its bytes and checksum are on the device.
        """
        ...

    def submit_read(self, keys: Sequence[Key], pool: HostPool, slots: Sequence[int]) -> int:
        """Start reading block ``keys[i]`` into host slot ``slots[i]``; returns the job id.

        The implementation is responsible for:
        * verifying each block (its full key and payload checksum) before reporting it in
          ``ok_keys``; a block that fails is in ``failed_keys`` and its slot's bytes are not
          to be used;
        * raising ``KvTierError`` (closed, failed) rather than starting a job it cannot run.
        """
        ...

    def poll(self) -> Sequence[JobResult]:
        """The results of the jobs finished since the last call (each once)."""
        ...

    def try_take(self, job_id: int) -> JobResult | None:
        """The result of `job_id` if it has finished (taken: ``poll`` will not return it), else
        None."""
        ...

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no job runs; False on timeout."""
        ...

    def contains(self, keys: Sequence[Key]) -> list[bool]:
        """Whether each key is held (readable or being written)."""
        ...

    def lookup_prefix(self, keys: Sequence[Key]) -> int:
        """How many leading keys are readable now."""
        ...

    def renew(self, keys: Sequence[Key], *, priority: int = 35, duration_s: float | None = None) -> int:
        """Give the held keys this retention priority and duration; returns how many it renewed."""
        ...

    def stats(self) -> Mapping[str, Any]:
        """Counters and gauges, by name."""
        ...

    def close(self) -> None:
        """Finish the jobs in flight and release the device's files; later calls raise
        ``ClosedError``."""
        ...
