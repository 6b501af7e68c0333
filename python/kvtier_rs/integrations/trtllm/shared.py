"""The tiers of one engine, shared by its scheduler and worker objects in one process.

TensorRT-LLM builds the worker on every rank and the scheduler on rank 0. kvtier's tiers (the
CPU tier's index and host memory, the disk tier) are built by the worker when the engine
registers its KV pool (only then are the block bytes known); the scheduler finds them here to
answer lookups. This is the single-process assumption: tensor parallelism 1 (one rank, which
holds both objects). With several ranks each rank holds a different shard of every block, so
each would need its own host pool mirrored slot for slot; that is not built, and the worker
refuses to start on a rank other than 0 or in a world larger than one (``KvtierWorker``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtier_rs._core import KvTierError
from kvtier_rs.orchestrator import TierOrchestrator
from kvtier_rs.transfer import BlockLayout


@dataclass
class EngineTiers:
    orchestrator: TierOrchestrator
    layout: BlockLayout
    num_layers: int
    tokens_per_block: int
    #: Set by the scheduler once it parks a request: gives back the reservations of parked
    #: requests the engine has finished. The worker calls it from every get_finished, also on
    #: an idle engine, before it reports async loads.
    drop_finished_parked: Callable[[], None] | None = None


_lock = threading.Lock()
_engines: dict[str, EngineTiers] = {}


def publish(name: str, tiers: EngineTiers) -> None:
    with _lock:
        if name in _engines:
            raise KvTierError(f"kvtier: KV caches for engine {name!r} are already registered in this process")
        _engines[name] = tiers


def lookup(name: str) -> EngineTiers | None:
    with _lock:
        return _engines.get(name)


def withdraw(name: str) -> EngineTiers | None:
    with _lock:
        return _engines.pop(name, None)


def engine_name(llm_args: Any, namespace: str | None) -> str:
    """The registry key both sides derive from the same llm_args."""
    if namespace:
        return namespace
    return str(getattr(llm_args, "model", None) or "default")
