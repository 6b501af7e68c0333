"""Moving KV blocks between device memory and the host pool.

`auto(layout, pool)` picks the CUDA engine for CUDA tensors (when a device and cuda-python are
present) and the CPU engine otherwise; both implement `TransferEngine`.
"""

from __future__ import annotations

from kvtier_rs._core import HostPool
from kvtier_rs.transfer.base import TransferEngine, TransferResult, coalesce_runs
from kvtier_rs.transfer.cpu import CpuTransferEngine
from kvtier_rs.transfer.layout import BlockLayout, Region

__all__ = [
    "BlockLayout",
    "CpuTransferEngine",
    "Region",
    "TransferEngine",
    "TransferResult",
    "auto",
    "coalesce_runs",
]


def auto(layout: BlockLayout, pool: HostPool, *, cpu_inline: bool = False) -> TransferEngine:
    """The best engine for where `layout` lives. `cpu_inline`: for CPU tensors, copy on the
    submitting thread (see CpuTransferEngine: right when the model's compute uses every core)."""
    if layout.device.type == "cuda":
        from kvtier_rs.transfer.cuda import CudaTransferEngine

        return CudaTransferEngine(layout, pool)
    return CpuTransferEngine(layout, pool, inline=cpu_inline)
