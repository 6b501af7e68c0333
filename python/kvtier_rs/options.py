"""Validation of engine adapters' option dicts (vLLM's kv_connector_extra_config, TensorRT-LLM's
KVTIER_TRTLLM_CONFIG): one set of checks, so every adapter accepts the same values and reports a
bad one the same way, naming the key: `<where>['<key>']: <what is wrong>`."""

from __future__ import annotations

from typing import Any

from kvtier_rs._core import InvalidArgumentError, parse_admission, policy_names
from kvtier_rs.config import parse_bytes


class OptionReader:
    def __init__(self, where: str) -> None:
        self.where = where  # e.g. "kv_connector_extra_config"

    def error(self, key: str, msg: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"{self.where}[{key!r}]: {msg}")

    def policy(self, key: str, value: Any) -> str:
        names = policy_names()
        if not isinstance(value, str) or value.lower() not in names:
            raise self.error(key, f"unknown eviction policy {value!r}; kvtier has " + ", ".join(names))
        return value.lower()

    def admission(self, key: str, value: Any) -> str:
        """An admission rule in canonical form ("always", "uses:K", "priority:T"), checked by
        the core's own parser."""
        if not isinstance(value, str):
            raise self.error(key, f'expected a string such as "always", "uses:2" or "priority:50", got {value!r}')
        try:
            return parse_admission(value)
        except InvalidArgumentError as e:
            raise self.error(key, str(e).split(": ", 1)[-1]) from None

    def size(self, key: str, value: Any) -> int:
        try:
            return parse_bytes(value, name=key)
        except InvalidArgumentError as e:
            raise self.error(key, str(e).split(": ", 1)[-1]) from None

    def int_in(self, key: str, value: Any, lo: int, hi: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise self.error(key, f"expected an int in {lo}..{hi}, got {value!r}")
        return value
