"""Opening the disk tier for the engine adapters: one place that opens it and logs what the tier
noted at open (slabs left sparse, buffered I/O, the I/O engine it fell back to, blocks it could
not vouch for), which an operator otherwise only sees by reading `DiskTier.notes`."""

from __future__ import annotations

import logging
import os
import re
from typing import Any

from kvtier_rs._core import FAULT_INJECTION, DiskTier, InvalidArgumentError
from kvtier_rs.checks import invalid_argument

log = logging.getLogger("kvtier_rs.disk")


def open_disk_tier(path: str | os.PathLike[str], capacity_bytes: int, block_bytes: int, **options: Any) -> DiskTier:
    """`DiskTier(path, capacity_bytes, block_bytes, **options)` (which creates the directory,
    0700), with its recovery summary logged at INFO and each of its notes at WARNING."""
    disk = DiskTier(str(path), capacity_bytes, block_bytes, **options)
    _arm_fault_from_environment(disk)
    s = disk.stats()
    log.info(
        "kvtier disk tier %s: %d blocks recovered, %d discarded; %s I/O on %s",
        disk.path,
        s["recovered_blocks"],
        s["recovery_discarded"],
        disk.io_mode,
        disk.engine,
    )
    for note in disk.notes:
        log.warning("kvtier disk tier %s: %s", disk.path, note)
    return disk


#: Test hook of the development build: ``<kind>[*<count>]``, a fault (``DiskTier._inject_fault``)
#: that every disk tier opened in this process arms at open, e.g. ``read_delay_ms:400*2``. For
#: tests of an engine whose tiers live in processes of their own (``vllm serve``).
FAULT_ENV = "KVTIER_DISK_FAULT"


def _arm_fault_from_environment(disk: DiskTier) -> None:
    """Arm the fault FAULT_ENV names; a bad one closes `disk` and is refused naming FAULT_ENV."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    kind, _, count = spec.partition("*")
    reason = None
    if not FAULT_INJECTION:
        reason = "this kvtier build has no fault injection (a development build has)"
    elif count and not count.isdigit():
        reason = "the count after '*' must be a whole number"
    else:
        try:
            disk._inject_fault(kind, int(count or 1))
        except InvalidArgumentError as e:
            reason = str(e)
    if reason is not None:
        disk.close()
        raise invalid_argument(FAULT_ENV, reason, message=f"{FAULT_ENV}={spec!r}: {reason}")
    log.warning("kvtier disk tier %s: test fault %s armed from %s", disk.path, spec, FAULT_ENV)


#: The host format in the name of a vLLM per-model tier directory, "<model>_f2_<digest>": a row
#: of one shared host region holding every rank's part, written to disk only while sealed for its
#: block. Directories of earlier releases ("<model>_<digest>") may hold blocks a scheduler wrote
#: from private memory that no worker filled (zeros, with valid checksums): never opened.
DIR_FORMAT = "f2"
_PER_MODEL_DIR = re.compile(r".+_[0-9a-f]{12}")


def earlier_format(name: str) -> bool:
    """Whether `name` is a vLLM per-model tier directory of an earlier kvtier format."""
    return _PER_MODEL_DIR.fullmatch(name) is not None and f"_{DIR_FORMAT}_" not in name
