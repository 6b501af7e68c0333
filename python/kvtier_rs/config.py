"""Validated configuration for one tier.

Validation happens here, at construction, so a bad value is reported with the field's name
before any memory is allocated; the Rust core validates again (it is also used directly).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from kvtier_rs._core import HostPool, parse_admission, policy_names
from kvtier_rs.checks import invalid_argument, show

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}

#: The largest size taken (4 EiB): far beyond any real tier, and sums and offsets of sizes up
#: to it stay within the Rust core's 64-bit integers.
MAX_BYTES = 2**62


def parse_bytes(value: int | str, *, name: str = "size") -> int:
    """Parse 4096, "64MiB", "1.5 GB" into bytes (exactly: a size must come to whole bytes);
    raise InvalidArgumentError naming `name`."""
    if isinstance(value, bool):
        raise invalid_argument(name, f"expected a byte size, got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        if not m or m.group(2).lower() not in _UNITS:
            raise invalid_argument(name, f"{value!r} is not a byte size (e.g. 4096, '64MiB', '2GB')")
        try:
            # Fraction, not float: "2.01KB" is 2010 bytes, and a 17-digit count is not rounded.
            exact = Fraction(m.group(1)) * _UNITS[m.group(2).lower()]
        except ValueError:  # more digits than Python converts (sys.int_max_str_digits)
            raise invalid_argument(name, f"a byte size of {len(m.group(1))} digits is too long") from None
        if exact.denominator != 1:
            raise invalid_argument(name, f"{value!r} is not a whole number of bytes")
        n = exact.numerator
    else:
        raise invalid_argument(name, f"expected int or str, got {type(value).__name__}")
    if n <= 0:
        raise invalid_argument(name, f"must be positive, got {show(value)}")
    if n > MAX_BYTES:
        raise invalid_argument(name, f"{show(value)} is more than the maximum, 2**62 bytes (4 EiB)")
    return n


@dataclass(frozen=True)
class TierConfig:
    """Size, policy and admission of a host (CPU DRAM) tier.

    capacity_bytes: total bytes of the pool (int or "64GiB").
    block_bytes: bytes of one KV block (all layers); slots are rounded up to 4 KiB.
    policy: one of fifo, lru, arc, priority, s3fifo, lhd.
    admission: "always", "uses:K" or "priority:T".
    """

    capacity_bytes: int | str
    block_bytes: int | str
    policy: str = "lru"
    admission: str = "always"

    def __post_init__(self) -> None:
        cap = parse_bytes(self.capacity_bytes, name="capacity_bytes")
        blk = parse_bytes(self.block_bytes, name="block_bytes")
        object.__setattr__(self, "capacity_bytes", cap)
        object.__setattr__(self, "block_bytes", blk)
        stride = HostPool.stride_for(blk)
        if cap < stride:
            raise invalid_argument("capacity_bytes", f"{cap} bytes cannot hold one block of {blk} bytes")
        if not isinstance(self.policy, str) or self.policy.lower() not in policy_names():
            raise invalid_argument(
                "policy", f"unknown policy {self.policy!r}; expected one of " + ", ".join(policy_names())
            )
        if not isinstance(self.admission, str):
            raise invalid_argument("admission", "expected a string such as 'uses:2'")
        parse_admission(self.admission)  # the core's own parser; its error names `admission`

    @property
    def num_blocks(self) -> int:
        return int(self.capacity_bytes) // HostPool.stride_for(int(self.block_bytes))
