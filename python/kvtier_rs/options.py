"""Validation of engine adapters' option dicts (vLLM's kv_connector_extra_config, TensorRT-LLM's
KVTIER_TRTLLM_CONFIG): one set of checks, so every adapter accepts the same values and reports a
bad one the same way, naming the key: `<where>['<key>']: <what is wrong>`.

``OptionReader.naming`` does the same for what only the tier itself can check at start-up (a
capacity that holds no slot of the engine's block size, a directory that cannot be opened): the
core's reason, under the key the user wrote."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from kvtier_rs._core import DirectoryLockedError, DiskIoError, InvalidArgumentError, parse_admission, policy_names
from kvtier_rs.checks import check_number, invalid_argument, show
from kvtier_rs.config import MAX_BYTES, parse_bytes
from kvtier_rs.orchestrator.guard import GuardRule

#: The disk tier's I/O engines, as every adapter spells them.
DISK_IO_ENGINES = ("auto", "io_uring", "pool")
#: Disk I/O requests in flight: the pool engine runs one thread per request.
QUEUE_DEPTH_MAX = 1024
#: An SLO guard's fields, as every adapter spells them (``OptionReader.guard_rule``).
GUARD_FIELDS = ("p99_ms", "window_s", "recover_s", "min_samples")
#: The most samples a guard's window may ask for before it can trip.
MIN_SAMPLES_MAX = 100_000


class OptionReader:
    def __init__(self, where: str) -> None:
        self.where = where  # e.g. "kv_connector_extra_config"

    def error(self, key: Any, msg: str) -> InvalidArgumentError:
        """``<where>['<key>']: <msg>``, with ``.arg`` the key and ``.reason`` the message."""
        arg = key if isinstance(key, str) else repr(key)
        return invalid_argument(arg, msg, message=f"{self.where}[{key!r}]: {msg}")

    def policy(self, key: str, value: Any) -> str:
        names = policy_names()
        if not isinstance(value, str) or value.lower() not in names:
            raise self.error(key, f"unknown eviction policy {show(value)}; kvtier has " + ", ".join(names))
        return value.lower()

    def admission(self, key: str, value: Any) -> str:
        """An admission rule in canonical form ("always", "uses:K", "priority:T"), checked by
        the core's own parser."""
        if not isinstance(value, str):
            raise self.error(key, f'expected a string such as "always", "uses:2" or "priority:50", got {show(value)}')
        try:
            return parse_admission(value)
        except InvalidArgumentError as e:
            raise self.error(key, e.reason) from None

    def size(self, key: str, value: Any) -> int:
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_BYTES:
            raise self.error(key, f"{show(value)} is more than the maximum, 2**62 bytes (4 EiB)")
        try:
            return parse_bytes(value, name=key)
        except InvalidArgumentError as e:
            raise self.error(key, e.reason) from None

    def int_in(self, key: str, value: Any, lo: int, hi: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise self.error(key, f"expected an int in {lo}..{hi}, got {show(value)}")
        return value

    def queue_depth(self, key: str, value: Any) -> int:
        """Disk I/O requests in flight."""
        return self.int_in(key, value, 1, QUEUE_DEPTH_MAX)

    def positive(self, key: str, value: Any, *, field: str | None = None, unit: str = "") -> float:
        """A positive, finite number (int or float) as a float; ``field`` names a sub-field of
        ``key`` (``cost_model``'s rates)."""
        what = f"{field} must be" if field else "expected"
        unit = f" {unit}" if unit else ""
        bad = self.error(key, f"{what} a positive finite number{unit}, got {show(value)}")
        if not isinstance(value, int | float):  # JSON numbers only, not Fractions or numpy
            raise bad
        try:
            return check_number(field or key, value)
        except InvalidArgumentError:
            raise bad from None

    def choice(self, key: str, value: Any, choices: tuple[str, ...]) -> str:
        if not isinstance(value, str) or value not in choices:
            raise self.error(key, f"{show(value)} is not one of " + ", ".join(choices))
        return value

    def disk_io_engine(self, key: str, value: Any) -> str:
        return self.choice(key, value, DISK_IO_ENGINES)

    def directory(self, key: str, value: Any) -> str:
        """A directory path (str or os.PathLike) as a str; whether it can be used is the tier's
        to say at open (see ``naming``)."""
        path = os.fspath(value) if isinstance(value, os.PathLike) else value
        if not isinstance(path, str) or not path:
            raise self.error(key, f"expected a directory path, got {show(value)}")
        if "\0" in path:
            raise self.error(key, f"a path cannot contain a NUL byte, got {show(path)}")
        return path

    @contextmanager
    def naming(self, args: Mapping[str, str], *, path_key: str | None = None) -> Iterator[None]:
        """Build a tier from the options inside this block: an error of the core's naming one of
        its arguments (``args``: core argument -> the user's key) is re-raised naming the user's
        key, with the core's reason; an OS error opening the tier's directory names
        ``path_key`` (as an InvalidArgumentError; a directory another tier holds stays a
        DirectoryLockedError). Any other error passes unchanged."""
        try:
            yield
        except InvalidArgumentError as e:
            # Only an error naming one argument has `.arg`; any other passes unchanged.
            arg: str | None = getattr(e, "arg", None)
            if arg is None or arg not in args:
                raise
            raise self.error(args[arg], e.reason) from None
        except DirectoryLockedError as e:
            if path_key is None:
                raise
            raise DirectoryLockedError(f"{self.where}[{path_key!r}]: {e}") from None
        except DiskIoError as e:
            if path_key is None:
                raise
            raise self.error(path_key, f"cannot open the disk tier there: {e}") from None


def guard_rule(reader: OptionReader, key: str, value: Any) -> GuardRule | None:
    """A tier's SLO guard, the value of `key` in `reader`'s dict: null (off) or a dict with
    ``p99_ms`` (the budget for the p99 wait on the tier's promotions) and optionally
    ``window_s``, ``recover_s`` and ``min_samples`` (``GuardRule``'s defaults otherwise)."""
    if value is None:
        return None
    fields = GUARD_FIELDS
    if not isinstance(value, Mapping):
        raise reader.error(
            key, f"expected null or a dict with p99_ms (and optionally {', '.join(fields[1:])}), got {show(value)}"
        )
    unknown = sorted(map(str, set(value) - set(fields)))
    if unknown:
        raise reader.error(key, f"unknown field(s) {unknown}; expected {', '.join(fields)}")
    if "p99_ms" not in value:
        raise reader.error(key, "p99_ms is required: the budget for the p99 wait on the tier's promotions, in ms")
    rates = {f: reader.positive(key, value[f], field=f) for f in fields[:3] if f in value}
    samples = value.get("min_samples", GuardRule.min_samples)
    if isinstance(samples, bool) or not isinstance(samples, int) or not 1 <= samples <= MIN_SAMPLES_MAX:
        raise reader.error(key, f"min_samples must be an int in 1..{MIN_SAMPLES_MAX}, got {show(samples)}")
    return GuardRule(**rates, min_samples=samples)
