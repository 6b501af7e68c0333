"""Fixtures shared across test folders: a real 3-primary Redis Cluster for the remote tier's tests
(tests/support/valkey.py), started once per module that asks for it and emptied before each
test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.valkey import Cluster, start_cluster


@pytest.fixture(scope="module")
def cluster_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = start_cluster(Path(tmp_path_factory.mktemp("cluster")))
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def cluster(cluster_module: Cluster) -> Cluster:
    cluster_module.wait_ok()
    cluster_module.flushall()
    return cluster_module
