"""The tiers behind kvtier's CPU tier, as the manager sees them: the disk tier and the shared
remote tier, each a ``DiskLayer`` (the remote one a ``RemoteLayer``), consulted in that order on a
CPU miss. One object, so the manager's code is the same with one lower tier or two:

* a CPU miss asks each tier that the request's ``kv_load_tiers`` allow, in order, and takes the
  first answer that is not a MISS;
* a chunk that became ready in the CPU tier is written through to every tier (each applies its
  own admission); a chunk loaded from the CPU tier is offered again to the tiers that count
  reuse (the remote tier's ``uses:K``: the shared store receives blocks with reuse evidence);
* every tier shares one ``PromotedChunks`` record, one load gate (guards, back-pressure and the
  cost rule per tier) and the manager's counters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.v1.kv_offload.base import LookupResult, Medium, OffloadingEvent, OffloadKey

from kvtier_rs.integrations.vllm import metrics as m
from kvtier_rs.integrations.vllm.disk_layer import DiskLayer, PromotedChunks
from kvtier_rs.orchestrator.gate import LoadGate

_MISS = LookupResult.MISS


class LowerTiers:  # noqa: PLR0904 - the manager's whole interface to the lower tiers
    def __init__(self, layers: Sequence[DiskLayer]) -> None:
        assert layers, "at least one lower tier"
        self.layers = tuple(layers)
        self.tiers = tuple(layer.tier for layer in self.layers)
        #: The gate whose guard states are reported (every layer's, shared).
        self.gate: LoadGate = self.layers[0].gate
        self.promoted = PromotedChunks()
        for layer in self.layers:
            layer.promoted = self.promoted
        self._counters = self.layers[0].counters
        self._reuse_counted = [layer for layer in self.layers if layer.counts_reuse]

    def layer(self, tier: str) -> DiskLayer:
        """The layer of `tier` ("disk" or "remote")."""
        for layer in self.layers:
            if layer.tier == tier:
                return layer
        raise KeyError(f"no {tier} tier here; the lower tiers are {', '.join(self.tiers)}")

    @property
    def counters(self) -> m.ManagerCounters:
        return self._counters

    @counters.setter
    def counters(self, counters: m.ManagerCounters) -> None:
        self._counters = counters
        for layer in self.layers:
            layer.counters = counters

    @property
    def events_enabled(self) -> bool:
        return self.layers[0].events_enabled

    @events_enabled.setter
    def events_enabled(self, on: bool) -> None:
        for layer in self.layers:
            layer.events_enabled = on

    def lookup_and_promote(self, key: OffloadKey, req_context: Any, protect: Any = None) -> LookupResult:
        allows = req_context.load_tier_filter.allows
        for layer in self.layers:
            if allows(Medium.STORAGE, layer.locality):
                res = layer.lookup_and_promote(key, req_context, protect)
                if res is not _MISS:
                    return res
        return _MISS

    def write_through(self, keys: Sequence[OffloadKey]) -> None:
        for layer in self.layers:
            layer.write_through(keys)

    def offer_reuse(self, keys: Sequence[OffloadKey]) -> None:
        """Chunks loaded from the CPU tier: a use the remote tier's admission counts."""
        for layer in self._reuse_counted:
            layer.write_through(keys)

    def end_lookups(self) -> None:
        for layer in self.layers:
            layer.flush_probes()

    def poll(self) -> None:
        for layer in self.layers:
            layer.poll()

    def release(self, keys: Sequence[OffloadKey] | None, req_context: Any) -> None:
        for layer in self.layers:
            layer.release(keys, req_context)

    def has_pending_work(self) -> bool:
        return any(layer.has_pending_work() for layer in self.layers)

    def drain(self) -> None:
        for layer in self.layers:
            layer.drain()

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()

    def take_events(self) -> list[OffloadingEvent]:
        return [ev for layer in self.layers for ev in layer.take_events()]

    def stats(self) -> dict[str, Any]:
        return {layer.tier: layer.stats() for layer in self.layers}

    def emit_stats(self, stats: Any) -> None:
        for layer in self.layers:
            layer.emit_stats(stats)

    def shutdown(self) -> None:
        for layer in self.layers:
            layer.shutdown()
