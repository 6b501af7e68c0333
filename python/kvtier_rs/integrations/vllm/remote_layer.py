"""The shared remote tier behind kvtier's CPU tier (and the disk tier), driven from vLLM's scheduler
thread: the disk tier's layer (write-through, promotion into CPU slots, reservations, the gate)
over ``tiers.remote.RemoteTier``, plus what a store on other machines needs:

* **Lookups never wait on the network.** A chunk the tier knows nothing about (or whose answer
  expired) answers RETRY and is queued; when the request's lookups end, its queued chunks go to
  the store in one batched existence probe (``flush_probes``). vLLM asks again on a later step:
  a chunk found is promoted (HIT_PENDING, then HIT once the read verified), one absent is a MISS.
* **A hit is taken only when loading beats recomputing**: the gate's cost rule weighs the
  remote hop's measured bandwidth and latency (``cost_model``).
* **A cache reset** (vLLM's, e.g. after new weights) switches the tier off for this process under
  ``disk_on_reset="clear"``: the shared store may hold blocks of the old weights, which this
  process can neither tell apart nor delete for every replica. ``"keep"`` keeps it on.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.kv_offload.base import Locality, LookupResult, OffloadKey

from kvtier_rs import defaults as D
from kvtier_rs._core import BlockIndex, HostPool
from kvtier_rs.integrations.vllm import metrics as m
from kvtier_rs.integrations.vllm.disk_layer import DiskLayer
from kvtier_rs.integrations.vllm.options import KvtierOptions
from kvtier_rs.integrations.vllm.tier_identity import layout_identity
from kvtier_rs.orchestrator.gate import LoadGate
from kvtier_rs.tiers.remote.breaker import BreakerState
from kvtier_rs.tiers.remote.build import open_remote_tier
from kvtier_rs.tiers.remote.tier import RemoteTier
from kvtier_rs.tiers.shared_region import SlotSeals

log = logging.getLogger("vllm." + __name__)

_MISS = LookupResult.MISS
_RETRY = LookupResult.RETRY


class RemoteLayer(DiskLayer):
    tier = "remote"
    locality = Locality.REMOTE
    counts_reuse = True  # its admission (uses:K) wants reuse evidence

    def __init__(self, remote: RemoteTier, *args: Any, **kwargs: Any) -> None:
        super().__init__(remote, *args, **kwargs)
        self.remote = remote
        # Chunks this step's lookups asked about and the tier knows nothing of: probed together
        # when the request's lookups end.
        self._to_probe: list[OffloadKey] = []
        self._last_remote: dict[str, int] = {}

    @classmethod
    def open_remote(
        cls,
        options: KvtierOptions,
        config: Any,
        *,
        host: HostPool,
        cpu_index: BlockIndex,
        tokens_per_chunk: int,
        seals: SlotSeals | None = None,
        gate: LoadGate | None = None,
    ) -> RemoteLayer:
        assert options.remote is not None  # opened only with a remote tier
        remote = open_remote_tier(options.remote, host.slot_bytes, layout_identity(config, host.slot_bytes))
        # Not disk_max_write_backlog: the remote tier bounds its writes in flight by bytes itself.
        return cls(
            remote,
            host,
            cpu_index,
            options,
            tokens_per_chunk,
            max_write_backlog=D.DISK_MAX_WRITE_BACKLOG,
            seals=seals,
            gate=gate,
        )

    # ---- called by the manager ------------------------------------------------------------------

    def lookup_and_promote(self, key: OffloadKey, req_context: Any, protect: Any = None) -> LookupResult:
        if self.off_reason is not None:
            return _MISS
        known = self.remote.known(key)
        if known is None:
            if self.remote.breaker.state is BreakerState.OPEN:
                return _MISS  # not asking a store that is not answering
            if not self.remote.probing(key):
                self._to_probe.append(key)
            self.counters.remote_lookups_deferred += 1
            return _RETRY
        if not known:
            return _MISS
        return super().lookup_and_promote(key, req_context, protect)

    def flush_probes(self) -> None:
        """Send the probe of the chunks queued by the lookups so far (one batch)."""
        if self._to_probe:
            keys, self._to_probe = self._to_probe, []
            self.remote.probe(keys)

    def has_pending_work(self) -> bool:
        # A probe in flight: keep the engine stepping, so that the deferred request is asked again.
        return super().has_pending_work() or bool(self._to_probe) or self.remote.probes_in_flight > 0

    def reset(self) -> None:
        self.drain()
        self.generation += 1
        self.remote.forget()
        if self.options.disk_on_reset != "clear" or self.off_reason is not None:
            return
        self.off_reason = "a cache reset: the shared store may hold blocks computed before it (old weights)"
        log.warning("kvtier: remote tier switched off for this process: %s", self.off_reason)

    def stats(self) -> dict[str, Any]:
        d = super().stats()
        d["switched_off"] = int(self.off_reason is not None)
        return d

    def emit_stats(self, stats: Any) -> None:
        now = {k: v for k, v in self.remote.stats().items() if isinstance(v, int)}
        now["switched_off"] = int(self.off_reason is not None)
        m.emit_remote_stats(stats, now, self._last_remote, self.remote.take_latencies())
        self._last_remote = now
        m.emit_write_drops(stats, self.tier, self.stager.counters, self._last_drops)

    def shutdown(self) -> None:
        self.drain()
        self.remote.close()
