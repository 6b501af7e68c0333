"""`kvtier status --remote URL`: what the shared store holds per namespace, and its nodes'
memory, read from a real 3-primary cluster; and the one-line errors for a bad URL, a store that
does not answer, and a wrong password."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from support.valkey import BLOCK, Cluster, Host, make_tier, plain_client, start_cluster, write

from kvtier_rs.cli import main
from kvtier_rs.tiers.remote import namespace_digest, store_key
from kvtier_rs.tiers.remote.inventory import match_pattern, parse_key
from kvtier_rs.tiers.remote.values import _FIXED, CHECK_BYTES

#: A stored value's length for a 36-byte block key (header, key, check, payload).
VALUE = _FIXED.size + 36 + CHECK_BYTES + BLOCK


def keys(tag: int, n: int) -> list[bytes]:
    return [bytes([tag, i]) * 18 for i in range(n)]


def status(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(["status", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_blocks_and_bytes_per_namespace(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    host = Host(16)
    for identity, tag, n in (("model-a", 1, 3), ("model-b", 2, 5)):
        tier = make_tier(cluster.url, identity=identity)
        try:
            _, result = write(tier, host, keys(tag, n))
            assert result.success and len(result.ok_keys) == n
        finally:
            tier.close()
    # Not block keys: one under the prefix (counted as "other"), one outside it (not seen).
    raw = plain_client(cluster)
    raw.set(b"kvtier:not-a-block", b"x")
    raw.set(b"elsewhere:" + bytes(16).hex().encode() + b":00", b"x")
    raw.close()

    rc, out, err = status(capsys, "--remote", cluster.url, "--format", "json")
    assert rc == 0, err
    got = json.loads(out)
    by_ns = {u["namespace"]: u for u in got["namespaces"]}
    a, b = namespace_digest("model-a").hex(), namespace_digest("model-b").hex()
    assert set(by_ns) == {a, b}
    assert (by_ns[a]["blocks"], by_ns[a]["bytes"]) == (3, 3 * VALUE)
    assert (by_ns[b]["blocks"], by_ns[b]["bytes"]) == (5, 5 * VALUE)
    assert by_ns[b]["memory_bytes"] >= 5 * VALUE  # the server's overhead on top
    assert got["other_keys"] == 1 and got["scan_errors"] == [] and got["prefix"] == "kvtier"
    nodes = got["nodes"]
    assert sorted(n["node"] for n in nodes) == sorted(f"127.0.0.1:{n.port}" for n in cluster.nodes)
    for n in nodes:
        assert n["role"] == "primary" and n["error"] is None
        assert n["used_memory"] > 0 and n["maxmemory"] == 0 and n["maxmemory_policy"] == "noeviction"

    # The table says the same.
    rc, out, _ = status(capsys, "--remote", cluster.url)
    assert rc == 0
    assert "8 blocks" in out and a in out and b in out and "noeviction" in out


def test_prefix_selects_the_deployment(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    tier = make_tier(cluster.url, prefix="other-deploy")
    try:
        write(tier, Host(4), keys(3, 2))
    finally:
        tier.close()
    rc, out, _ = status(capsys, "--remote", cluster.url, "--json")
    assert rc == 0 and json.loads(out)["namespaces"] == []
    rc, out, _ = status(capsys, "--remote", cluster.url, "--json", "--remote-prefix", "other-deploy")
    assert rc == 0
    (u,) = json.loads(out)["namespaces"]
    assert (u["blocks"], u["bytes"]) == (2, 2 * VALUE)


def test_node_memory_limits(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    # A limit set on the servers shows as such (read from INFO memory, no CONFIG needed).
    cluster.config_set("maxmemory", str(256 << 20))
    cluster.config_set("maxmemory-policy", "allkeys-lru")
    try:
        rc, out, _ = status(capsys, "--remote", cluster.url, "--json")
    finally:
        cluster.config_set("maxmemory", "0")
        cluster.config_set("maxmemory-policy", "noeviction")
    assert rc == 0
    for n in json.loads(out)["nodes"]:
        assert (n["maxmemory"], n["maxmemory_policy"]) == (256 << 20, "allkeys-lru")


def dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("http://127.0.0.1:6379", "--remote"),
        ("redis://127.0.0.1", "not host:port"),
        ("redis://user:pw@127.0.0.1:6379", "holds a password"),
        (None, "cannot connect"),
    ],
)
def test_bad_url_or_dead_store_is_one_line(url: str | None, said: str, capsys: pytest.CaptureFixture[str]) -> None:
    url = url or f"redis://127.0.0.1:{dead_port()}"
    rc, out, err = status(capsys, "--remote", url, "--remote-timeout", "1")
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("kvtier status: error:") and said in err, err
    assert "Traceback" not in err
    assert "pw" not in err  # a password in a URL is never echoed


def test_flags_that_do_not_go_together(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, _, err = status(capsys, "--remote", "redis://127.0.0.1:1", "--verify")
    assert rc == 2 and "--verify" in err
    with pytest.raises(SystemExit) as e:  # argparse: one of --dir / --remote, not both
        main(["status", "--remote", "redis://127.0.0.1:1", "--dir", str(tmp_path)])
    assert e.value.code == 2
    capsys.readouterr()
    rc, _, err = status(capsys, "--remote", "redis://127.0.0.1:1", "--remote-password-file", str(tmp_path / "no"))
    assert rc == 2 and "--remote-password-file" in err and err.count("\n") == 1


def test_password(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = start_cluster(tmp_path / "c", password="right-password")
    try:
        monkeypatch.setenv("KVTIER_REMOTE_PASSWORD", "wrong-password")
        rc, out, err = status(capsys, "--remote", cluster.url)
        assert rc == 2 and out == "" and err.count("\n") == 1 and "cannot connect" in err
        assert "wrong-password" not in err
        monkeypatch.delenv("KVTIER_REMOTE_PASSWORD")
        rc, _, err = status(capsys, "--remote", cluster.url)
        assert rc == 2 and err.count("\n") == 1  # none given: refused too
        (tmp_path / "pw").write_text("right-password\n")
        rc, out, err = status(capsys, "--remote", cluster.url, "--remote-password-file", str(tmp_path / "pw"), "--json")
        assert rc == 0, err
        assert len(json.loads(out)["nodes"]) == 3
        monkeypatch.setenv("MY_PW", "right-password")
        rc, _, err = status(capsys, "--remote", cluster.url, "--remote-password-env", "MY_PW")
        assert rc == 0, err
    finally:
        cluster.stop()


def test_key_parsing() -> None:
    ns = bytes(range(16))
    assert parse_key(b"kvtier", store_key("kvtier", ns, b"\x01\x02")) == ns.hex()
    assert parse_key(b"a:b", store_key("a:b", ns, b"\x01")) == ns.hex()  # a prefix may hold ':'
    assert parse_key(b"kvtier", b"kvtier:" + ns.hex().encode()[:30] + b":01") is None
    assert parse_key(b"kvtier", b"kvtier:" + ns.hex().encode() + b":0") is None  # odd hex
    assert parse_key(b"kvtier", b"kvtier:" + ns.hex().encode() + b":") is None
    assert parse_key(b"kvtier", b"kvtierx:" + ns.hex().encode() + b":01") is None
    assert match_pattern("a*b[1]") == "a\\*b\\[1\\]:*"
