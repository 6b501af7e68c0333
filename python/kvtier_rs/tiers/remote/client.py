"""Connecting to the shared store: a Valkey or Redis (>= 7) Cluster through redis-py's cluster
client, which routes each key to its shard, follows MOVED/ASK and reconnects by itself.

The URL names seed nodes only (``redis://host:port[,host:port...]``, ``rediss://`` for TLS);
credentials never go in it, because URLs end up in logs and in engine configs: the password comes
from an environment variable or a file, and is never logged.
"""

from __future__ import annotations

import os
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redis.backoff import ExponentialBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from kvtier_rs.checks import invalid_argument

DEFAULT_PASSWORD_ENV = "KVTIER_REMOTE_PASSWORD"


@dataclass(frozen=True)
class Endpoint:
    """What `parse_url` read: the seed nodes, TLS or not, and the ACL user, if any."""

    nodes: tuple[tuple[str, int], ...]
    tls: bool
    username: str | None

    def describe(self) -> str:
        """For logs: no credentials."""
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://" + ",".join(f"{h}:{p}" for h, p in self.nodes)


def parse_url(url: str, name: str = "remote_url") -> Endpoint:
    if not isinstance(url, str) or "://" not in url:
        raise invalid_argument(name, f"must be redis://host:port[,host:port...] (or rediss://), got {url!r}")
    scheme, _, rest = url.partition("://")
    if scheme not in ("redis", "rediss"):
        raise invalid_argument(name, f"scheme {scheme!r}: expected redis:// or rediss:// (TLS)")
    rest = rest.rstrip("/")
    username = None
    if "@" in rest:
        creds, _, rest = rest.rpartition("@")
        if ":" in creds:
            # Refused rather than used: a URL is logged and copied around; a password is not.
            raise invalid_argument(
                name, "holds a password; give it in remote_password_env's variable or remote_password_file"
            )
        username = urllib.parse.unquote(creds) or None
    nodes = []
    for part in rest.split(","):
        host, sep, port = part.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise invalid_argument(name, f"{part!r} is not host:port")
        nodes.append((host.strip("[]"), int(port)))
    return Endpoint(tuple(nodes), scheme == "rediss", username)


def read_password(password_env: str | None, password_file: str | None) -> str | None:
    """The store's password: from `password_file` if given (its first line), else from the
    environment variable `password_env` (unset: no password)."""
    if password_file:
        try:
            text = Path(password_file).read_text()
        except OSError as e:
            raise invalid_argument("remote_password_file", f"cannot read {password_file}: {e.strerror}") from None
        return text.splitlines()[0] if text.strip() else None
    return os.environ.get(password_env or DEFAULT_PASSWORD_ENV) or None


def connect(
    endpoint: Endpoint,
    *,
    password: str | None,
    timeout_s: float,
    tls_ca_file: str | None = None,
) -> RedisCluster:
    """A cluster client whose every socket operation gives up after `timeout_s`. Few retries:
    the tier's own breaker decides when to try again, so a dead node costs one deadline, not
    the client's default ten attempts."""
    kwargs: dict[str, Any] = {}
    if endpoint.tls:
        kwargs["ssl"] = True
        if tls_ca_file:
            kwargs["ssl_ca_certs"] = tls_ca_file
    return RedisCluster(
        startup_nodes=[ClusterNode(h, p) for h, p in endpoint.nodes],
        username=endpoint.username,
        password=password,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(ExponentialBackoff(cap=timeout_s, base=min(0.01, timeout_s)), retries=1),
        require_full_coverage=False,
        **kwargs,
    )
