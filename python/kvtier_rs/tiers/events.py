"""A bounded stream of block events for external indexes and routers (which node holds which
prefix blocks, in which tier).

The orchestrator publishes, per batch of blocks:
- ``stored``    blocks became readable in a tier (CPU after an offload copy, disk after a
                write-through, CPU again after a promotion from disk);
- ``removed``   blocks left a tier (``reason``: ``evicted`` to make room, ``failed_read`` when
                the disk dropped a block whose read did not verify);
- ``promoted``  blocks were loaded to the device from a tier (they stay in that tier);
- ``bypassed``  the tier's SLO guard tripped: its hits are recomputed for a while (no keys;
                ``reason``: the p99 wait that tripped it against its budget);
- ``restored``  the tier is back in service after the guard's cool-down (no keys).

Apply ``removed`` idempotently: a disk block evicted between a plan and its load is reported
when evicted and again when its read finds it gone.

Every event carries a sequence number, consecutive from 1 across all kinds, so a consumer can
tell exactly how much it missed. The ring is bounded: when it is full the oldest undrained
event is dropped and counted (``dropped``), so a slow or absent consumer costs memory bounded
by ``capacity`` and never blocks the data path.

Two ways to consume:
- ``drain(max_events)`` takes events out (one consumer, e.g. a publisher thread);
- ``since(seq)`` reads without taking (several consumers, each keeping its own cursor). A
  cursor consumer has lost events exactly when the first event returned has
  ``seq > cursor + 1``; ``missed_since(cursor)`` says how many.

Thread-safe: the orchestrator publishes from the engine's thread while a consumer reads from
another. Publishing is a lock, a deque append and a counter increment.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypedDict

from kvtier_rs.checks import check_count, invalid_argument
from kvtier_rs.tiers.keys import Key, key_list

EVENT_KINDS = ("stored", "removed", "promoted", "bypassed", "restored")
#: Kinds about a whole tier, not blocks: published with no keys.
TIER_EVENT_KINDS = ("bypassed", "restored")
EVENT_TIERS = ("cpu", "disk", "remote")


@dataclass(frozen=True, slots=True)
class BlockEvent:
    seq: int
    kind: str  # one of EVENT_KINDS
    tier: str  # one of EVENT_TIERS
    keys: tuple[Key, ...]  # in chain order where the batch was a chain
    reason: str | None = None  # why a block was removed
    timestamp: float = 0.0  # time.time() at publication


class EventStats(TypedDict):
    published: dict[str, int]  # events published, by kind
    dropped: int  # oldest events dropped from a full ring
    queued: int
    capacity: int
    last_seq: int


class EventStream:
    def __init__(self, capacity: int = 65536) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise invalid_argument("capacity", f"must be a positive int, got {capacity!r}")
        self.capacity = capacity
        self._ring: deque[BlockEvent] = deque()
        self._lock = threading.Lock()
        self._last_seq = 0
        self._dropped = 0
        self._published = dict.fromkeys(EVENT_KINDS, 0)

    # ---- publishing (the orchestrator) ---------------------------------------------------
    def publish(self, kind: str, tier: str, keys: Iterable[Key], reason: str | None = None) -> BlockEvent | None:
        """Append one event for a batch of blocks; an empty batch publishes nothing (but a
        tier event, which has no keys, is published)."""
        if kind not in EVENT_KINDS:
            raise invalid_argument("kind", f"{kind!r}; expected one of {EVENT_KINDS}")
        if tier not in EVENT_TIERS:
            raise invalid_argument("tier", f"{tier!r}; expected one of {EVENT_TIERS}")
        # key_list refuses a single key: a bytes digest iterated as a batch became one int key
        # per byte (a str, one key per character), events for blocks that do not exist.
        keys = tuple(key_list(keys))
        if not keys and kind not in TIER_EVENT_KINDS:
            return None
        with self._lock:
            self._last_seq += 1
            ev = BlockEvent(self._last_seq, kind, tier, keys, reason, time.time())
            if len(self._ring) == self.capacity:
                self._ring.popleft()
                self._dropped += 1
            self._ring.append(ev)
            self._published[kind] += 1
        return ev

    # ---- consuming -----------------------------------------------------------------------
    def drain(self, max_events: int | None = None) -> list[BlockEvent]:
        """Take up to `max_events` oldest events (all when None), in sequence order."""
        max_events = _max_events(max_events)
        with self._lock:
            n = len(self._ring) if max_events is None else min(max_events, len(self._ring))
            return [self._ring.popleft() for _ in range(n)]

    def since(self, seq: int, max_events: int | None = None) -> list[BlockEvent]:
        """Events with a sequence number above `seq` still in the ring, oldest first, without
        taking them."""
        seq = check_count("seq", seq, minimum=0)
        max_events = _max_events(max_events)
        with self._lock:
            if not self._ring or seq >= self._last_seq:
                return []
            # Sequence numbers in the ring are consecutive: index arithmetic, no scan.
            start = max(0, seq + 1 - self._ring[0].seq)
            stop = len(self._ring) if max_events is None else min(len(self._ring), start + max_events)
            return [self._ring[i] for i in range(start, stop)]

    def missed_since(self, seq: int) -> int:
        """How many events after `seq` are no longer in the ring (dropped or drained)."""
        seq = check_count("seq", seq, minimum=0)
        with self._lock:
            first = self._ring[0].seq if self._ring else self._last_seq + 1
            return max(0, first - seq - 1)

    # ---- accounting ----------------------------------------------------------------------
    @property
    def last_seq(self) -> int:
        return self._last_seq

    @property
    def dropped(self) -> int:
        return self._dropped

    def __len__(self) -> int:
        return len(self._ring)

    def stats(self) -> EventStats:
        with self._lock:
            return {
                "published": dict(self._published),
                "dropped": self._dropped,
                "queued": len(self._ring),
                "capacity": self.capacity,
                "last_seq": self._last_seq,
            }


def _max_events(value: int | None) -> int | None:
    """A consumer's `max_events`: None (all) or an int >= 0 (a bool, a negative count or a
    string is refused by name). Every consumer call checks its cursor and count alike."""
    return None if value is None else check_count("max_events", value, minimum=0)
