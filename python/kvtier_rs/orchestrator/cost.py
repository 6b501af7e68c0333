"""Load or recompute: a hit is only worth taking when moving its bytes beats recomputing its
tokens. Bandwidth per tier starts from a configured guess and follows measured transfers (an
exponential moving average), so the decision adapts to the machine it runs on.

Every setting is checked at construction, naming it: rates and sizes positive, both hops
("cpu", "disk") given in `bandwidth` and `latency_s`. A bandwidth of `math.inf` means the hop
costs nothing (and stays so: measurements cannot lower an infinite average).

What a measurement may move (`observe`):

- a transfer whose seconds or bytes are NaN, inf or negative is dropped and counted
  (`observations_dropped`): a NaN folded into the average would stay there for good and
  every later plan would refuse;
- a transfer that took less than twice the hop's fixed `latency_s` is not a measurement: its
  time is mostly the fixed cost, so the time left for the bytes (seconds - latency_s) is timer
  noise, and dividing by it gives any bandwidth at all (a 64 KiB copy in 20 us with 50 us of
  fixed latency read as 1.3e13 B/s). From twice the latency on, the estimate is at most twice
  the transfer's raw throughput. But its raw throughput (bytes / seconds, the latency
  included) is a lower bound on the hop's bandwidth: an estimate below it is raised toward it,
  as by a measurement. Otherwise (or when nothing moved) it is skipped and counted
  (`observations_skipped`). Without this, fast transfers were all skipped and slow ones all
  counted, so the estimate could only fall;
- a transfer whose time is so small that bytes / seconds overflows to inf is skipped and counted
  too: an infinite measurement would make the estimate infinite for good.

A tier the model refuses is not loaded from, so nothing would ever measure it again: one slow
spell would switch it off for good. So a refused tier is probed: at most one load every
`probe_every_s` seconds goes ahead anyway (`take_probe`, counted in `probes`), and its transfer
is measured like any other.
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from kvtier_rs.checks import check_count, check_number, invalid_argument, usable_sample

#: Promotion hops: "cpu" = host -> device, "disk" = disk -> host, always set.
HOPS = ("cpu", "disk")
#: "remote" = the shared store -> host: set when given, else from these first estimates (a
#: round trip to another machine, and a network's rate) until transfers measure it.
OPTIONAL_HOPS = {"remote": (1e9, 1e-3)}
#: The hops a load from each tier crosses: a block from disk or a remote store lands in host
#: memory first, then crosses PCIe like a CPU hit.
PATHS = {"cpu": ("cpu",), "disk": ("disk", "cpu"), "remote": ("remote", "cpu")}


def _per_hop(name: str, value: object, *, zero_ok: bool, inf_ok: bool) -> dict[str, float]:
    """A {hop: number} setting naming the hops (and optionally "remote"), as a new dict (the
    model updates its own copy; the caller's dict is never changed behind its back)."""
    if not isinstance(value, Mapping) or not set(HOPS) <= set(value) <= {*HOPS, *OPTIONAL_HOPS}:
        got = f"keys {sorted(value, key=repr)!r}" if isinstance(value, Mapping) else repr(value)
        raise invalid_argument(name, f"expected a dict with keys 'cpu' and 'disk' (and optionally 'remote'), got {got}")
    return {hop: check_number(f"{name}[{hop!r}]", value[hop], zero_ok=zero_ok, inf_ok=inf_ok) for hop in value}


@dataclass
class CostModel:
    #: The disk's first read-rate estimate, before any read is measured.
    DEFAULT_DISK_BYTES_PER_S: ClassVar[float] = 1e9

    prefill_tokens_per_s: float
    tokens_per_block: int
    block_bytes: int
    #: bytes/s per promotion hop: "cpu" = host -> device, "disk" = disk -> host (inf: free).
    bandwidth: dict[str, float] = field(
        default_factory=lambda: {"cpu": 10e9, "disk": CostModel.DEFAULT_DISK_BYTES_PER_S}
    )
    #: fixed seconds per promotion job (submission, completion polling) per hop.
    latency_s: dict[str, float] = field(default_factory=lambda: {"cpu": 50e-6, "disk": 200e-6})
    alpha: float = 0.2
    #: a tier refused for cost gets one load through (a probe) at most this often, in seconds.
    probe_every_s: float = 5.0
    #: the probes' clock (a test's fake, or time.monotonic).
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    #: measurements refused as NaN, inf or negative (see the module docstring).
    observations_dropped: int = field(default=0, init=False)
    #: measurements that carried no bandwidth information (nothing moved, within 2x latency_s
    #: and no faster than the estimate, or a time too small for bytes / seconds to be finite).
    observations_skipped: int = field(default=0, init=False)
    #: loads let through to re-measure a tier refused for cost.
    probes: int = field(default=0, init=False)
    _refused_since: dict[str, float] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.prefill_tokens_per_s = check_number("prefill_tokens_per_s", self.prefill_tokens_per_s)
        self.tokens_per_block = check_count("tokens_per_block", self.tokens_per_block)
        self.block_bytes = check_count("block_bytes", self.block_bytes)
        self.bandwidth = _per_hop("bandwidth", self.bandwidth, zero_ok=False, inf_ok=True)
        self.latency_s = _per_hop("latency_s", self.latency_s, zero_ok=True, inf_ok=False)
        for hop in OPTIONAL_HOPS:
            if hop in self.bandwidth or hop in self.latency_s:
                self._ensure(hop)  # given one of its two settings: the other from the defaults
        a = self.alpha
        if isinstance(a, bool) or not isinstance(a, numbers.Real) or not 0 < a <= 1:  # NaN fails 0 < a
            raise invalid_argument("alpha", f"must be a number in (0, 1], got {a!r}")
        self.alpha = float(a)
        self.probe_every_s = check_number("probe_every_s", self.probe_every_s, inf_ok=True)
        if not callable(self.clock):
            raise invalid_argument("clock", f"expected a callable, got {self.clock!r}")

    def observe(self, hop: str, nbytes: int, seconds: float) -> None:
        """Fold one measured transfer into the hop's bandwidth estimate, unless it carries no
        bandwidth information (dropped or skipped and counted, see the module docstring)."""
        if hop not in HOPS and hop not in OPTIONAL_HOPS:
            raise invalid_argument("hop", f"expected 'cpu', 'disk' or 'remote', got {hop!r}")
        self._ensure(hop)
        if not (usable_sample(nbytes, "nbytes") and usable_sample(seconds, "seconds")):
            self.observations_dropped += 1
            return
        fixed = self.latency_s[hop]
        if nbytes == 0 or seconds == 0:
            self.observations_skipped += 1
            return
        if seconds < 2 * fixed:
            at_least = nbytes / seconds  # raw throughput: the hop is at least this fast
            if at_least <= self.bandwidth[hop]:
                self.observations_skipped += 1
                return
            measured = at_least
        else:
            measured = nbytes / (seconds - fixed)
        if measured == math.inf:
            # A positive time so small that bytes / seconds overflows (a timer glitch): folded in,
            # the average would be inf for good (no measurement lowers it), the hop free forever.
            self.observations_skipped += 1
            return
        self.bandwidth[hop] = (1 - self.alpha) * self.bandwidth[hop] + self.alpha * measured

    def _ensure(self, hop: str) -> None:
        """An optional hop's first estimates, on first use."""
        if hop in OPTIONAL_HOPS:
            self.bandwidth.setdefault(hop, OPTIONAL_HOPS[hop][0])
            self.latency_s.setdefault(hop, OPTIONAL_HOPS[hop][1])

    def load_seconds(self, tier: str, n_blocks: int) -> float:
        """Estimated time to bring n blocks from `tier` to the device (disk and remote go
        through CPU)."""
        if n_blocks <= 0:
            return 0.0
        hops = PATHS.get(tier)
        if hops is None:
            raise invalid_argument("tier", f"expected one of {', '.join(map(repr, PATHS))}, got {tier!r}")
        self._ensure(tier)
        nbytes = n_blocks * self.block_bytes
        return sum(self.latency_s[h] + nbytes / self.bandwidth[h] for h in hops)

    def recompute_seconds(self, n_blocks: int) -> float:
        return n_blocks * self.tokens_per_block / self.prefill_tokens_per_s

    def worth_loading(self, tier: str, n_blocks: int) -> bool:
        return self.load_seconds(tier, n_blocks) < self.recompute_seconds(n_blocks)

    def take_probe(self, tier: str) -> bool:
        """For a load `worth_loading` refused: whether to let it through anyway to re-measure
        the tier. The first refusal starts the clock; then one probe every `probe_every_s`."""
        now = self.clock()
        since = self._refused_since.setdefault(tier, now)
        if now - since < self.probe_every_s:
            return False
        self._refused_since[tier] = now
        self.probes += 1
        return True

    def admitted(self, tier: str) -> None:
        """A load from `tier` was found worth loading: the next refusal starts a new wait."""
        self._refused_since.pop(tier, None)
