"""Handing a batch of completions to their handlers without losing any."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")


def handle_each(items: Iterable[T], handle: Callable[[T], object]) -> Exception | None:
    """Hand every item to `handle`, even after one of them raises; return the first error.

    Completions are handed over once (an engine's or the disk tier's `poll` forgets what it
    returned), so a handler that raises must not lose the ones after it: their pins, slots and
    requests would wait for good. The caller raises the error once the batch is done."""
    first = None
    for item in items:
        try:
            handle(item)
        except Exception as e:  # kept, and raised by the caller once the batch is done
            if first is None:
                first = e
    return first
