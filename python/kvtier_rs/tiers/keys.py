"""Batch arguments of the Python facade (key chains, device block ids) checked and listed once,
so every entry point refuses the same shapes with the same words as the Rust core."""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import Any

from kvtier_rs.checks import integer, invalid_argument

Key = int | bytes

# Iterating one of these yields ints (or characters): a digest passed where a chain is expected
# would silently become one int key per byte, so they are refused as single values.
_SINGLE = (bytes, bytearray, memoryview, str, numbers.Integral)


def as_list(values: Any, name: str, item: str) -> list[Any]:
    """`values` (any iterable but a single value, see _SINGLE) as a new list, or an error naming
    argument `name`, whose items are `item`s."""
    if isinstance(values, _SINGLE):
        raise invalid_argument(
            name,
            f"expected a sequence of {item}s, got a single {item} ({type(values).__name__}); pass a list of {item}s",
        )
    try:
        return list(values)
    except TypeError:
        raise invalid_argument(name, f"expected a sequence of {item}s, got {type(values).__name__}") from None


def key_list(keys: Iterable[Key], name: str = "keys") -> list[Key]:
    """`keys` as a list; a single key (or any bytes-like or str object) is refused, as the Rust
    core's batch methods do. The keys themselves are checked by the core."""
    return as_list(keys, name, "key")


def index_list(values: Iterable[int], name: str, item: str = "block id") -> list[int]:
    """`values` as a list of Python ints (`integer`)."""
    return [integer(v, name, f"{item}s must be integers") for v in as_list(values, name, item)]
