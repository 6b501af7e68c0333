"""A real Valkey/Redis Cluster on loopback for the remote tier's tests: N primaries on free ports,
each its own server process (Debian's ``redis-server``, installed by ``make redis``), joined with
``redis-cli --cluster create`` and stopped afterwards. Tests kill, pause (SIGSTOP) and fill its
nodes; nothing in it is a fake of the server.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

#: The server binary: Valkey's if present, else Redis's.
SERVERS = ("valkey-server", "redis-server")
CLIS = ("valkey-cli", "redis-cli")


def _binary(names: tuple[str, ...]) -> str:
    for n in names:
        path = shutil.which(n)
        if path:
            return path
    # Never a skip: CI installs the server (`make redis`), so a missing one is a broken setup.
    pytest.fail(f"none of {', '.join(names)} is on PATH: run `make redis` (installs Debian's redis-server)")


def _free_port() -> int:
    """A free port whose cluster-bus port (port + 10000) is free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


@dataclass(frozen=True)
class TlsFiles:
    """A CA and a server certificate for 127.0.0.1 it signed (`make_tls_files`)."""

    ca: Path
    cert: Path
    key: Path


def make_tls_files(workdir: Path) -> TlsFiles:
    """A throwaway CA, and a certificate for 127.0.0.1 signed by it, made with the openssl tool."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.fail("openssl is not on PATH: the TLS tests make their certificates with it")
    workdir.mkdir(parents=True, exist_ok=True)
    ca, ca_key = workdir / "ca.crt", workdir / "ca.key"
    cert, key, csr, ext = workdir / "server.crt", workdir / "server.key", workdir / "server.csr", workdir / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    steps = [
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=kvtier test CA",
         "-keyout", str(ca_key), "-out", str(ca)],
        [openssl, "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", str(key),
         "-out", str(csr)],
        [openssl, "x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
         "-days", "2", "-extfile", str(ext), "-out", str(cert)],
    ]  # fmt: skip
    for cmd in steps:
        subprocess.run(cmd, check=True, capture_output=True, timeout=60)
    return TlsFiles(ca, cert, key)


@dataclass
class Node:
    port: int
    proc: subprocess.Popen[bytes]
    workdir: Path
    args: list[str]
    tls: TlsFiles | None = None

    def client(self, password: str | None = None) -> redis.Redis:
        if self.tls is not None:
            return redis.Redis(
                host="127.0.0.1",
                port=self.port,
                password=password,
                socket_timeout=5,
                ssl=True,
                ssl_ca_certs=str(self.tls.ca),
            )
        return redis.Redis(host="127.0.0.1", port=self.port, password=password, socket_timeout=5)


@dataclass
class Cluster:
    nodes: list[Node]
    password: str | None = None
    _paused: set[int] = field(default_factory=set)

    @property
    def url(self) -> str:
        """Every node as a seed, as an operator would write it (`rediss://` over TLS)."""
        scheme = "rediss" if self.nodes and self.nodes[0].tls is not None else "redis"
        return f"{scheme}://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def node_clients(self) -> list[redis.Redis]:
        return [n.client(self.password) for n in self.nodes if n.proc.poll() is None]

    def kill(self, i: int) -> None:
        self.nodes[i].proc.kill()
        self.nodes[i].proc.wait()

    def pause(self, i: int) -> None:
        self.nodes[i].proc.send_signal(signal.SIGSTOP)
        self._paused.add(i)

    def resume(self, i: int) -> None:
        self.nodes[i].proc.send_signal(signal.SIGCONT)
        self._paused.discard(i)

    def restart(self, i: int) -> None:
        """Start a killed node again from its own data directory (cluster config and all)."""
        n = self.nodes[i]
        n.proc = subprocess.Popen(n.args, cwd=n.workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_up(n, self.password)
        self.wait_ok()

    def flushall(self) -> None:
        for c in self.node_clients():
            with contextlib.suppress(redis.ResponseError):  # a replica refuses writes
                c.flushall()

    def config_set(self, name: str, value: str) -> None:
        """CONFIG SET on every running node (a cluster has no cluster-wide CONFIG)."""
        for c in self.node_clients():
            c.config_set(name, value)

    def dbsize(self) -> int:
        return sum(int(c.dbsize()) for c in self.node_clients())

    def wait_ok(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            states = []
            for c in self.node_clients():
                try:
                    states.append(c.cluster("info").get("cluster_state"))
                except redis.RedisError:
                    states.append(None)
            if states and all(s == "ok" for s in states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster not ok after {timeout} s: {states}")
            time.sleep(0.1)

    def stop(self) -> None:
        for i in list(self._paused):
            self.resume(i)
        for n in self.nodes:
            if n.proc.poll() is None:
                n.proc.terminate()
        for n in self.nodes:
            try:
                n.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                n.proc.kill()
                n.proc.wait()


def _wait_up(node: Node, password: str | None, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    c = node.client(password)
    while True:
        with contextlib.suppress(redis.RedisError, OSError):  # not listening yet
            if c.ping():
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"node on port {node.port} did not answer within {timeout} s")
        time.sleep(0.05)


def start_cluster(
    workdir: Path,
    *,
    primaries: int = 3,
    password: str | None = None,
    maxmemory: str | None = None,
    tls: TlsFiles | None = None,
) -> Cluster:
    """`tls`: the nodes listen for TLS only (clients and the cluster bus), with that
    certificate; clients are not asked for one."""
    server, cli = _binary(SERVERS), _binary(CLIS)
    nodes: list[Node] = []
    try:
        for i in range(primaries):
            port = _free_port()
            d = workdir / f"node{i}"
            d.mkdir(parents=True, exist_ok=True)
            listen = ["--port", str(port)]
            if tls is not None:
                listen = [
                    "--port", "0", "--tls-port", str(port), "--tls-cluster", "yes", "--tls-replication", "yes",
                    "--tls-cert-file", str(tls.cert), "--tls-key-file", str(tls.key),
                    "--tls-ca-cert-file", str(tls.ca), "--tls-auth-clients", "no",
                ]  # fmt: skip
            args = [
                server,
                *listen,
                "--bind", "127.0.0.1",
                "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", "2000",
                "--appendonly", "no",
                "--save", "",
                "--protected-mode", "no",
                "--daemonize", "no",
                "--dir", str(d),
            ]  # fmt: skip
            if password is not None:
                args += ["--requirepass", password, "--masterauth", password]
            if maxmemory is not None:
                args += ["--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru"]
            proc = subprocess.Popen(args, cwd=d, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            nodes.append(Node(port, proc, d, args, tls))
        for n in nodes:
            _wait_up(n, password)
        create = [cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in nodes)]
        create += ["--cluster-replicas", "0", "--cluster-yes"]
        if tls is not None:
            create += ["--tls", "--cacert", str(tls.ca)]
        env = dict(os.environ)
        if password is not None:
            env["REDISCLI_AUTH"] = password
        out = subprocess.run(create, capture_output=True, text=True, timeout=60, env=env)
        if out.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout}\n{out.stderr}")
        cluster = Cluster(nodes, password)
        cluster.wait_ok()
        return cluster
    except BaseException:
        Cluster(nodes, password).stop()
        raise


@contextlib.contextmanager
def running_cluster(workdir: Path, **kwargs: object) -> Iterator[Cluster]:
    cluster = start_cluster(workdir, **kwargs)  # type: ignore[arg-type]
    try:
        yield cluster
    finally:
        cluster.stop()


# ---- the remote tier over a cluster ---------------------------------------------------------

#: Payload bytes of one block in the remote tier's tests: not a multiple of 4 KiB on purpose.
BLOCK = 6000
IDENTITY = "test-model/bf16/l2h4d64/b16/tp1"


class FakeClock:
    """A clock the test moves: deadlines, presence answers and breakers see only this."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def block_payload(key: object, salt: bytes = b"") -> bytes:
    """Deterministic, key-specific bytes of one block."""
    import blake3

    return blake3.blake3(repr(key).encode() + b"\0" + salt).digest(length=BLOCK)


def make_tier(
    url: str,
    *,
    password: str | None = None,
    timeout_s: float = 5.0,
    tls_ca_file: str | None = None,
    identity: str = IDENTITY,
    salt: str = "",
    secret: bytes | None = None,
    block_bytes: int = BLOCK,
    **kwargs: object,
):  # -> RemoteTier
    """A `RemoteTier` for blocks of `block_bytes` on its own cluster client, as one serving replica
    would have it. `kwargs` are `RemoteOptions` fields (deadline 60 s unless given: only the tests of deadlines meet
    one) and `RemoteTier`'s own keywords (breaker, clock)."""
    import dataclasses

    from kvtier_rs.tiers.remote import RemoteOptions, RemoteTier, ValueFormat, namespace_digest
    from kvtier_rs.tiers.remote.client import connect, parse_url

    endpoint = parse_url(url)
    fmt = ValueFormat(namespace_digest(identity, salt), secret)
    names = {f.name for f in dataclasses.fields(RemoteOptions)}
    options = {k: v for k, v in kwargs.items() if k in names}
    options.setdefault("deadline_s", 60.0)
    rest = {k: v for k, v in kwargs.items() if k not in names}
    return RemoteTier(
        lambda: connect(endpoint, password=password, timeout_s=timeout_s, tls_ca_file=tls_ca_file),
        fmt,
        block_bytes,
        RemoteOptions(**options),  # type: ignore[arg-type]
        description="test",
        **rest,  # type: ignore[arg-type]
    )


class Host:
    """A host pool of `slots` slots of BLOCK bytes, with a view to fill and read them."""

    def __init__(self, slots: int = 64) -> None:
        import numpy as np

        from kvtier_rs._core import HostPool

        self.pool = HostPool(slots * HostPool.stride_for(BLOCK), BLOCK)
        self.slots = slots
        self._mem = np.frombuffer(memoryview(self.pool), dtype=np.uint8)

    def _span(self, slot: int):
        off = self.pool.slot_offset(slot)
        return self._mem[off : off + BLOCK]

    def put(self, slot: int, data: bytes) -> None:
        import numpy as np

        self._span(slot)[:] = np.frombuffer(data, dtype=np.uint8)

    def get(self, slot: int) -> bytes:
        return self._span(slot).tobytes()

    def fill(self, keys: list, first_slot: int = 0) -> list[int]:
        """Put each key's payload in consecutive slots; returns the slots."""
        slots = list(range(first_slot, first_slot + len(keys)))
        for k, s in zip(keys, slots, strict=True):
            self.put(s, block_payload(k))
        return slots

    def scribble(self, slots: list[int], byte: int = 0xEE) -> None:
        for s in slots:
            self.put(s, bytes([byte]) * BLOCK)


def wait_result(tier, job_id: int, timeout: float = 120.0):  # -> RemoteJobResult
    """The result of `job_id`, polled for with a generous real-time limit (a failure to report
    at all is a hang of the tier, not slowness of this machine). Other jobs' results met on the
    way are kept for their own waiters."""
    stash = tier.__dict__.setdefault("_test_results", {})
    end = time.monotonic() + timeout
    while job_id not in stash:
        for r in tier.poll():
            stash[r.job_id] = r
        if job_id in stash:
            break
        if time.monotonic() > end:
            raise AssertionError(f"job {job_id} reported no result within {timeout} s: the tier hangs")
        tier.wait_idle(0.2)
    return stash.pop(job_id)


def write(tier, host: Host, keys: list, first_slot: int = 0, **kw: object):
    """Write `keys` through the tier (payloads put in the host slots first); (ticket, result)."""
    slots = host.fill(keys, first_slot)
    ticket = tier.submit_write(keys, host.pool, slots, **kw)
    return ticket, wait_result(tier, ticket.job_id)


def read(tier, host: Host, keys: list, first_slot: int):
    """Read `keys` into consecutive slots from `first_slot` (scribbled first); (result, slots)."""
    slots = list(range(first_slot, first_slot + len(keys)))
    host.scribble(slots)
    return wait_result(tier, tier.submit_read(keys, host.pool, slots)), slots


def keys_on_node(cluster: Cluster, i: int, pattern: bytes = b"*") -> list[bytes]:
    """The store keys node `i` holds."""
    return list(cluster.nodes[i].client(cluster.password).scan_iter(match=pattern, count=1000))


def block_key_of(store_key: bytes) -> bytes:
    return bytes.fromhex(store_key.rsplit(b":", 1)[1].decode())


def plain_client(cluster: Cluster):  # -> redis.RedisCluster
    """Another program's cluster client (redis-py's, no kvtier in between)."""
    from redis.cluster import ClusterNode, RedisCluster

    n = cluster.nodes[0]
    tls = {"ssl": True, "ssl_ca_certs": str(n.tls.ca)} if n.tls is not None else {}
    return RedisCluster(
        startup_nodes=[ClusterNode("127.0.0.1", n.port)], password=cluster.password, socket_timeout=10, **tls
    )


def bkeys(n: int, tag: bytes = b"k") -> list[bytes]:
    """`n` vLLM-like block keys (36 bytes each) starting with `tag`."""
    return [tag + i.to_bytes(4, "big") + bytes(36 - len(tag) - 4) for i in range(n)]
