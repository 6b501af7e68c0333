"""kvtier: a KV-cache tier manager for long-context LLM serving.

The Rust core (``kvtier_rs._core``) holds the block index, eviction and admission policies and
the host pool; this package is the typed Python face over it. Dependency direction:
engine adapters -> this facade -> the Rust core.
"""

from kvtier_rs._core import (
    DEFAULT_PRIORITY,
    MAX_KEY_BYTES,
    BlockIndex,
    HostPool,
    InvalidArgumentError,
    KvTierError,
    NoSpaceError,
    NotPinnedError,
    NotReadyError,
    StoreOutcome,
    policy_names,
    version,
)
from kvtier_rs.config import TierConfig
from kvtier_rs.host_tier import HostTier

__all__ = [
    "DEFAULT_PRIORITY",
    "MAX_KEY_BYTES",
    "BlockIndex",
    "HostPool",
    "HostTier",
    "InvalidArgumentError",
    "KvTierError",
    "NoSpaceError",
    "NotPinnedError",
    "NotReadyError",
    "StoreOutcome",
    "TierConfig",
    "policy_names",
    "version",
]

__version__ = version()
