"""Load or recompute: a hit is only worth taking when moving its bytes beats recomputing its
tokens. Bandwidth per tier starts from a configured guess and follows measured transfers (an
exponential moving average), so the decision adapts to the machine it runs on."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier_rs._core import InvalidArgumentError


@dataclass
class CostModel:
    prefill_tokens_per_s: float
    tokens_per_block: int
    block_bytes: int
    #: bytes/s per promotion hop: "cpu" = host -> device, "disk" = disk -> host.
    bandwidth: dict[str, float] = field(default_factory=lambda: {"cpu": 10e9, "disk": 1e9})
    #: fixed seconds per promotion job (submission, completion polling) per hop.
    latency_s: dict[str, float] = field(default_factory=lambda: {"cpu": 50e-6, "disk": 200e-6})
    alpha: float = 0.2

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "tokens_per_block", "block_bytes"):
            if not getattr(self, name) > 0:
                raise InvalidArgumentError(f"invalid argument `{name}`: must be positive, got {getattr(self, name)!r}")
        for tier, bw in self.bandwidth.items():
            if not bw > 0:
                raise InvalidArgumentError(f"invalid argument `bandwidth[{tier!r}]`: must be positive, got {bw!r}")
        if not 0 < self.alpha <= 1:
            raise InvalidArgumentError(f"invalid argument `alpha`: must be in (0, 1], got {self.alpha!r}")

    def observe(self, hop: str, nbytes: int, seconds: float) -> None:
        """Fold one measured transfer into the hop's bandwidth estimate."""
        if nbytes <= 0 or seconds <= 0:
            return
        measured = nbytes / max(seconds - self.latency_s.get(hop, 0.0), 1e-9)
        old = self.bandwidth.get(hop, measured)
        self.bandwidth[hop] = (1 - self.alpha) * old + self.alpha * measured

    def load_seconds(self, tier: str, n_blocks: int) -> float:
        """Estimated time to bring n blocks from `tier` to the device (disk goes through CPU)."""
        if n_blocks <= 0:
            return 0.0
        hops = ["cpu"] if tier == "cpu" else ["disk", "cpu"]
        nbytes = n_blocks * self.block_bytes
        return sum(self.latency_s.get(h, 0.0) + nbytes / self.bandwidth[h] for h in hops)

    def recompute_seconds(self, n_blocks: int) -> float:
        return n_blocks * self.tokens_per_block / self.prefill_tokens_per_s

    def worth_loading(self, tier: str, n_blocks: int) -> bool:
        return self.load_seconds(tier, n_blocks) < self.recompute_seconds(n_blocks)
