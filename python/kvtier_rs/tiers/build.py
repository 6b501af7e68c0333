"""Tiers from the configuration tree: the one place that turns ``settings.Settings`` into a CPU
tier, a disk tier, a remote tier and the data path over them, for the Python API and the engine
adapters.

What only a tier can check (a capacity that holds no slot of the engine's block size, a
directory it cannot open) is reported under the tree's key, or the name the user wrote for it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvtier_rs._core import DiskTier
from kvtier_rs.config import TierConfig
from kvtier_rs.options import OptionReader
from kvtier_rs.settings import API_READER, Settings
from kvtier_rs.tiers.disk import open_disk_tier

if TYPE_CHECKING:
    from kvtier_rs.orchestrator.orchestrator import TierOrchestrator
    from kvtier_rs.tiers.host import HostTier
    from kvtier_rs.tiers.remote.tier import RemoteTier
    from kvtier_rs.transfer import TransferEngine

#: The CPU tier's constructor arguments (TierConfig's, HostPool's) -> the tree's keys.
CPU_TIER_ARGS = {
    "capacity_bytes": "cpu_bytes",
    "total_bytes": "cpu_bytes",
    "policy": "cpu_policy",
    "admission": "cpu_admission",
}
#: The disk tier's constructor arguments -> the tree's keys.
DISK_TIER_ARGS = {
    "capacity_bytes": "disk_bytes",
    "policy": "disk_policy",
    "admission": "disk_admission",
    "engine": "disk_io_engine",
    "queue_depth": "disk_queue_depth",
}


def as_written(args: Mapping[str, str], written: Mapping[str, str]) -> dict[str, str]:
    """`args` (constructor argument -> the tree's key) with each key replaced by the name the
    user wrote for it (``settings.written_names``)."""
    return {arg: written.get(key, key) for arg, key in args.items()}


def open_host_tier(
    settings: Settings, block_bytes: int, *, reader: OptionReader = API_READER, written: Mapping[str, str] = {}
) -> HostTier:
    """The CPU tier of `settings` for blocks of `block_bytes`."""
    from kvtier_rs.tiers.host import HostTier

    cpu = settings.cpu
    with reader.naming(as_written(CPU_TIER_ARGS, written)):
        return HostTier(TierConfig(cpu.bytes, block_bytes, policy=cpu.policy, admission=cpu.admission))


def open_disk(
    settings: Settings,
    slot_bytes: int,
    *,
    path: str | os.PathLike[str] | None = None,
    reader: OptionReader = API_READER,
    written: Mapping[str, str] = {},
) -> DiskTier | None:
    """The disk tier of `settings` (None when it is off) for slots of `slot_bytes`, in `path`
    (default: the disk_root itself; an adapter passes a directory per engine under it)."""
    disk = settings.disk
    if disk is None:
        return None
    with reader.naming(as_written(DISK_TIER_ARGS, written), path_key=written.get("disk_root", "disk_root")):
        return open_disk_tier(
            disk.root if path is None else path,
            disk.bytes,
            slot_bytes,
            policy=disk.policy,
            admission=disk.admission,
            engine=disk.io_engine,
            queue_depth=disk.queue_depth,
        )


def open_remote(settings: Settings, block_bytes: int, identity: str) -> RemoteTier | None:
    """The remote tier of `settings` (None when it is off) for blocks of `block_bytes` whose
    meaning `identity` names: every replica of a deployment must give the same text (the model,
    KV geometry, dtype and byte layout; nothing per-process), since it is the store's namespace."""
    if settings.remote is None:
        return None
    from kvtier_rs.tiers.remote.build import open_remote_tier

    return open_remote_tier(settings.remote, block_bytes, identity)


def open_data_path(
    settings: Settings,
    host: HostTier,
    engine: TransferEngine,
    *,
    tokens_per_block: int,
    block_bytes: int,
    disk: DiskTier | None = None,
    remote: RemoteTier | None = None,
) -> TierOrchestrator:
    """The data path over `host`, `disk` and `remote` with `settings`' cost rule (for blocks of
    `tokens_per_block` tokens and `block_bytes` bytes), guards and caps on promotions in
    flight."""
    from kvtier_rs.orchestrator.cost import CostModel
    from kvtier_rs.orchestrator.orchestrator import TierOrchestrator

    path = settings.data_path
    cost = None
    if path.cost is not None:
        cost = CostModel(path.cost.prefill_tokens_per_s, tokens_per_block, block_bytes)
        if path.cost.disk_read_bytes_per_s is not None:
            cost.bandwidth["disk"] = path.cost.disk_read_bytes_per_s  # the first estimate; reads refine it
    return TierOrchestrator(
        host,
        engine,
        disk=disk,
        remote=remote,
        cost=cost,
        guards=dict(path.guards),
        max_promotions_in_flight=dict(path.max_promotions_in_flight),
        max_disk_write_backlog=path.max_disk_write_backlog,
    )
