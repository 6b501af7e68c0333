"""Batch arguments of the Python facade (key chains, device block ids) checked and listed once,
so every entry point refuses the same shapes with the same words as the Rust core."""

from __future__ import annotations

import numbers
import operator
from collections.abc import Iterable
from typing import Any

from kvtier_rs._core import InvalidArgumentError

Key = int | bytes

# Iterating one of these yields ints (or characters): a digest passed where a chain is expected
# would silently become one int key per byte, so they are refused as single values.
_SINGLE = (bytes, bytearray, memoryview, str, numbers.Integral)


def _as_list(values: Any, name: str, item: str) -> list[Any]:
    if isinstance(values, _SINGLE):
        raise InvalidArgumentError(
            f"invalid argument `{name}`: expected a sequence of {item}s, got a single {item} "
            f"({type(values).__name__}); pass a list of {item}s"
        )
    try:
        return list(values)
    except TypeError:
        raise InvalidArgumentError(
            f"invalid argument `{name}`: expected a sequence of {item}s, got {type(values).__name__}"
        ) from None


def key_list(keys: Iterable[Key], name: str = "keys") -> list[Key]:
    """`keys` as a list; a single key (or any bytes-like or str object) is refused, as the Rust
    core's batch methods do. The keys themselves are checked by the core."""
    return _as_list(keys, name, "key")


def index_list(values: Iterable[int], name: str, item: str = "block id") -> list[int]:
    """`values` as a list of Python ints. Only integers are taken (ints, numpy/torch integer
    scalars: operator.index), never floats, which int() would silently truncate, nor bools."""
    out = []
    for v in _as_list(values, name, item):
        try:
            i = None if isinstance(v, bool) else operator.index(v)
        except TypeError:
            i = None
        if i is None:
            raise InvalidArgumentError(
                f"invalid argument `{name}`: {item}s must be integers, got {type(v).__name__} {v!r}"
            )
        out.append(i)
    return out
