"""The remote tier over TLS (`rediss://` with `remote_tls_ca_file`) against a real cluster whose
nodes listen for TLS only, with a certificate from a throwaway CA: blocks round-trip when the
CA is given; a tier that does not trust the certificate, or speaks plain text to a TLS port,
gets errors counted and misses, never an exception into the engine."""

from __future__ import annotations

import pytest
from support.valkey import (
    BLOCK,
    IDENTITY,
    Host,
    bkeys,
    block_payload,
    make_tier,
    make_tls_files,
    read,
    running_cluster,
    write,
)

from kvtier_rs.settings import read_settings
from kvtier_rs.tiers.remote import RemoteTier
from kvtier_rs.tiers.remote.build import open_remote_tier
from kvtier_rs.tiers.remote.values import Miss


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory):
    work = tmp_path_factory.mktemp("tls")
    files = make_tls_files(work / "certs")
    with running_cluster(work / "cluster", tls=files) as cluster:
        yield cluster, files


def test_blocks_round_trip_over_tls_with_the_ca_file_from_the_settings(tls_cluster) -> None:
    cluster, files = tls_cluster
    assert cluster.url.startswith("rediss://")
    raw = {"cpu_bytes": "1MiB", "remote_url": cluster.url, "remote_tls_ca_file": str(files.ca)}
    settings = read_settings({**raw, "remote_admission": "always"})
    assert settings.remote is not None
    tier = open_remote_tier(settings.remote, BLOCK, IDENTITY)
    host = Host(32)
    try:
        keys = bkeys(8, b"tls")
        ticket, res = write(tier, host, keys)
        assert res.success and res.ok_keys == keys
        got, slots = read(tier, host, keys, first_slot=16)
        assert got.success and [host.get(s) for s in slots] == [block_payload(k) for k in keys]
    finally:
        tier.close()


@pytest.mark.parametrize(
    ("scheme", "ca", "why"),
    [
        ("rediss", False, "the system's CAs do not vouch for the node's certificate"),
        ("redis", False, "plain text to a port that speaks TLS only"),
    ],
)
def test_a_connection_tls_refuses_is_errors_and_misses(tls_cluster, scheme, ca, why) -> None:
    cluster, files = tls_cluster
    url = cluster.url.replace("rediss://", f"{scheme}://")
    tier: RemoteTier = make_tier(url, timeout_s=2.0, tls_ca_file=str(files.ca) if ca else None)
    host = Host(16)
    try:
        keys = bkeys(3, b"no")
        _, res = write(tier, host, keys)
        assert not res.success and res.failed_keys == keys, why
        got, _ = read(tier, host, keys, first_slot=8)
        assert not got.success and got.failed_keys == keys
        st = tier.stats()
        assert st["write_errors"] >= 1 and st["read_errors"] + st[f"miss_{Miss.ERROR.value}"] >= 1
        assert st["hits"] == 0
    finally:
        tier.close()
