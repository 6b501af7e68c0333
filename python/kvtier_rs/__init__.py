"""kvtier: a KV-cache tier manager for long-context LLM serving.

The Rust core (``kvtier_rs._core``) holds the block index, eviction and admission policies and
the host pool; this package is the typed Python face over it. Dependency direction:
engine adapters -> this facade -> the Rust core.
"""

from typing import TYPE_CHECKING

from kvtier_rs._core import (
    DEFAULT_PRIORITY,
    MAX_KEY_BYTES,
    BlockIndex,
    ClosedError,
    DirectoryLockedError,
    DiskIoError,
    DiskJobResult,
    DiskTier,
    HostPool,
    IndexFailedError,
    InvalidArgumentError,
    KvTierError,
    NoSpaceError,
    NotPinnedError,
    NotReadyError,
    StoreOutcome,
    disk_status,
    policy_names,
    version,
)
from kvtier_rs.config import TierConfig

if TYPE_CHECKING:
    from kvtier_rs.tiers.host import HostTier

__all__ = [
    "DEFAULT_PRIORITY",
    "MAX_KEY_BYTES",
    "BlockIndex",
    "ClosedError",
    "DirectoryLockedError",
    "DiskIoError",
    "DiskJobResult",
    "DiskTier",
    "HostPool",
    "HostTier",
    "IndexFailedError",
    "InvalidArgumentError",
    "KvTierError",
    "NoSpaceError",
    "NotPinnedError",
    "NotReadyError",
    "StoreOutcome",
    "TierConfig",
    "disk_status",
    "policy_names",
    "version",
]

__version__ = version()


def __getattr__(name: str) -> object:
    # HostTier needs numpy: it is imported on first use, so that `import kvtier_rs` for the index
    # alone (a scheduler, the benchmarks) pays neither numpy's import (~0.25 s here) nor the CPU
    # its BLAS threads spin at start-up (~0.1 s, measured on the 2-core dev VM).
    if name == "HostTier":
        from kvtier_rs.tiers.host import HostTier

        return HostTier
    raise AttributeError(f"module 'kvtier_rs' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
