"""The remote tier tests' fixtures: a host pool to write from and read into, and tiers over the
cluster (the `cluster` fixture is tests/conftest.py's), each closed after its test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from support.valkey import Cluster, Host, make_tier

from kvtier_rs.tiers.remote import RemoteTier


@pytest.fixture
def host() -> Host:
    return Host(128)


@pytest.fixture
def tiers() -> Iterator[Callable[..., RemoteTier]]:
    """`tiers(cluster, **options)`: a RemoteTier over `cluster` (its password unless given)."""
    made: list[RemoteTier] = []

    def make(cluster: Cluster, **kw: Any) -> RemoteTier:
        kw.setdefault("password", cluster.password)
        t = make_tier(cluster.url, **kw)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()
