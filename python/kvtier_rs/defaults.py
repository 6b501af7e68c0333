"""The defaults every entry point shares (the Python API, the vLLM and TensorRT-LLM keys, the
planner's options), in one place, so that the same option means the same thing wherever it is
set. The Rust core's own defaults (``DiskTier``, ``BlockIndex``) are the same values; a test
holds them together.

Engine-specific defaults stay with their adapter: TensorRT-LLM's tiers default to the
``priority`` policy, which carries its retention semantics.
"""

from __future__ import annotations

#: Admission of the CPU tier: every offered block is stored.
CPU_ADMISSION = "always"
#: Admission of the disk tier: every block the CPU tier writes through is stored. ``uses:2``
#: (store a block on its second offer) spares the device on workloads with little reuse; the
#: planner says where it pays.
DISK_ADMISSION = "always"
#: Eviction policy of either tier, unless the engine's adapter says otherwise.
POLICY = "lru"
#: The disk tier's I/O engine: chosen at open by a short measurement where io_uring works.
DISK_IO_ENGINE = "auto"
#: Disk I/O requests in flight.
DISK_QUEUE_DEPTH = 16
#: Write-through blocks queued for the disk tier at most: each pins its CPU slot until written,
#: so a slow disk cannot pin the CPU tier without bound; beyond it write-throughs are dropped.
DISK_MAX_WRITE_BACKLOG = 1024
