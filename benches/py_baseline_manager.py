"""The strongest pure-Python baseline for the index benchmarks: a block manager with the same
semantics as kvtier's index (ready/writing states, pins, all-or-nothing stores that never evict
pinned or in-flight blocks, LRU or ARC order), written for speed the way a Python engine would
write it: one dict of small lists plus OrderedDicts, no per-call allocation beyond what the
operation needs.
"""

from __future__ import annotations

from collections import OrderedDict

WRITING, READY = 0, 1


class NoSpace(Exception):
    pass


class PyLruManager:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: dict[bytes, list[int]] = {}  # key -> [state, pins, slot]
        self.order: OrderedDict[bytes, None] = OrderedDict()
        self.free = list(range(capacity - 1, -1, -1))

    def lookup_one(self, key: bytes) -> bool:
        e = self.entries.get(key)
        return e is not None and e[0] == READY

    def lookup_prefix(self, keys) -> int:
        entries = self.entries
        n = 0
        for k in keys:
            e = entries.get(k)
            if e is None or e[0] != READY:
                break
            n += 1
        return n

    def _victims(self, n: int) -> list[bytes]:
        entries = self.entries
        out = []
        for k in self.order:
            e = entries[k]
            if e[0] == READY and e[1] == 0:
                out.append(k)
                if len(out) == n:
                    return out
        raise NoSpace

    def _drop(self, k: bytes) -> None:
        self.free.append(self.entries.pop(k)[2])
        del self.order[k]

    def _insert(self, k: bytes, slot: int) -> None:
        self.order[k] = None

    def prepare_store(self, keys) -> tuple[list[int], list[bytes]]:
        entries = self.entries
        new = [k for k in dict.fromkeys(keys) if k not in entries]
        evicted = []
        if len(new) > len(self.free):
            evicted = self._victims(len(new) - len(self.free))
            for v in evicted:
                self._drop(v)
        slots = [self.free.pop() for _ in new]
        for k, s in zip(reversed(new), reversed(slots), strict=True):
            entries[k] = [WRITING, 0, s]
            self._insert(k, s)
        return slots, evicted

    def complete_store(self, keys, success: bool = True) -> None:
        entries = self.entries
        for k in keys:
            e = entries.get(k)
            if e is not None and e[0] == WRITING:
                if success:
                    e[0] = READY
                else:
                    self._drop(k)

    def touch(self, keys) -> None:
        order = self.order
        for k in reversed(keys):
            if k in order:
                order.move_to_end(k)


class PyArcManager(PyLruManager):
    """Same bookkeeping, ARC order (T1/T2 resident, B1/B2 ghosts, adaptive target p)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.t1: OrderedDict[bytes, None] = OrderedDict()
        self.t2: OrderedDict[bytes, None] = OrderedDict()
        self.b1: OrderedDict[bytes, None] = OrderedDict()
        self.b2: OrderedDict[bytes, None] = OrderedDict()
        self.p = 0

    def _trim(self) -> None:
        c = self.capacity
        while len(self.t1) + len(self.b1) > c and self.b1:
            self.b1.popitem(last=False)
        while len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * c and self.b2:
            self.b2.popitem(last=False)

    def _first(self, lst) -> bytes | None:
        entries = self.entries
        for k in lst:
            e = entries[k]
            if e[0] == READY and e[1] == 0:
                return k
        return None

    def _victims(self, n: int) -> list[bytes]:
        entries = self.entries
        evictable = 0
        for lst in (self.t1, self.t2):
            for k in lst:
                e = entries[k]
                if e[0] == READY and e[1] == 0:
                    evictable += 1
                    if evictable == n:
                        break
            if evictable == n:
                break
        if evictable < n:  # all-or-nothing: refuse before touching any list
            raise NoSpace
        out = []
        while len(out) < n:
            a, b = (self.t1, self.t2) if len(self.t1) > self.p else (self.t2, self.t1)
            k, src = self._first(a), a
            if k is None:
                k, src = self._first(b), b
            del src[k]
            (self.b1 if src is self.t1 else self.b2)[k] = None
            self._trim()
            out.append(k)
        return out

    def _drop(self, k: bytes) -> None:
        self.free.append(self.entries.pop(k)[2])
        self.t1.pop(k, None)
        self.t2.pop(k, None)

    def _insert(self, k: bytes, slot: int) -> None:
        if k in self.b1:
            self.p = min(self.p + max(1, len(self.b2) // len(self.b1)), self.capacity)
            del self.b1[k]
            self.t2[k] = None
        elif k in self.b2:
            self.p = max(self.p - max(1, len(self.b1) // len(self.b2)), 0)
            del self.b2[k]
            self.t2[k] = None
        else:
            self.t1[k] = None
        self._trim()

    def touch(self, keys) -> None:
        for k in reversed(keys):
            if k in self.t1:
                del self.t1[k]
                self.t2[k] = None
            elif k in self.t2:
                self.t2.move_to_end(k)
