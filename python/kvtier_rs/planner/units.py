"""Tier sizes as `kvtier plan` takes them (bytes with a unit, or a block count) and the
report's byte and block formatting. Sizes in bytes go through the package's one byte-size
parser, `kvtier_rs.config.parse_bytes`."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvtier_rs._core import InvalidArgumentError
from kvtier_rs.config import parse_bytes
from kvtier_rs.planner.errors import PlanError

# A sanity bound, far beyond any real deployment, that keeps block counts well inside the core's
# 64-bit integers and the cost model's floats.
MAX_BLOCKS = 10**12

_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


@dataclass
class Size:
    """A tier size: bytes, or a block count when given with the `blocks` suffix."""

    value: int
    in_blocks: bool

    def blocks(self, block_bytes: int | None, arg: str) -> int:
        if self.in_blocks:
            return self.value
        if not block_bytes:
            raise PlanError(
                f"{arg}: a size in bytes needs --bytes-per-token or --model-config (or give it in "
                "blocks, e.g. 4000blocks)"
            )
        return self.value // block_bytes


def parse_size(text: str, arg: str) -> Size:
    m = _SIZE.match(text)
    if not m:
        raise PlanError(f"{arg}: cannot read {text!r}; expected e.g. 40GiB, 2TB or 5000blocks")
    num, unit = m.group(1), m.group(2).lower()
    if unit in ("block", "blocks", "blk"):
        shown = num if len(num) <= 30 else f"a number of {len(num)} digits"
        # Bounded by its digit count before int(): int() refuses a string of more than 4300
        # digits (ValueError, leading zeros included), and so long a count is not echoed.
        digits = num.lstrip("0") or "0"
        if "." in num or digits == "0":
            raise PlanError(f"{arg}: a block count must be a positive integer, got {shown}")
        if len(digits) > len(str(MAX_BLOCKS)) or int(digits) > MAX_BLOCKS:
            raise PlanError(f"{arg}: at most {MAX_BLOCKS} (10^12) blocks, got {shown}")
        return Size(int(digits), True)
    if unit == "":
        raise PlanError(f"{arg}: {text!r} has no unit; write bytes with a unit (40GiB, 512MB) or blocks (5000blocks)")
    try:
        value = parse_bytes(text, name=arg)  # the one byte-size parser (kvtier_rs.config)
    except InvalidArgumentError as e:
        # The CLI's style is "--cpu: what is wrong": the parser's reason under the option's name.
        raise PlanError(f"{arg}: {e.reason}") from None
    return Size(value, False)  # parse_bytes bounds sizes (config.MAX_BYTES)


def fmt_blocks(n: int) -> str:
    """`n` blocks, in words that read right for one block too."""
    return f"{n} block" if n == 1 else f"{n} blocks"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n:.0f} B"
