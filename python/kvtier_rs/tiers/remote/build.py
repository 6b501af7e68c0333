"""Opening the remote tier from its settings: everything a user can get wrong (the URL, an
unreadable password or secret file) is refused here, naming the option; whether the store answers
is not checked here (a store that is down at start-up costs misses, and the tier connects when it
comes back)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from kvtier_rs.checks import invalid_argument
from kvtier_rs.settings import RemoteTierSettings
from kvtier_rs.tiers.remote.client import connect, parse_url, read_password
from kvtier_rs.tiers.remote.tier import RemoteOptions, RemoteTier
from kvtier_rs.tiers.remote.values import ValueFormat, derive_secret, namespace_digest

log = logging.getLogger("kvtier_rs.remote")


def read_secret(path: str) -> bytes:
    """The MAC key from the deployment secret in `path` (surrounding whitespace ignored)."""
    try:
        material = Path(path).read_bytes().strip()
    except OSError as e:
        raise invalid_argument("remote_secret_file", f"cannot read {path}: {e.strerror}") from None
    if len(material) < 16:
        raise invalid_argument("remote_secret_file", f"{path} holds {len(material)} bytes; a secret needs at least 16")
    return derive_secret(material)


def open_remote_tier(
    s: RemoteTierSettings,
    block_bytes: int,
    identity: str,
    *,
    clock: Callable[[], float] = time.monotonic,
) -> RemoteTier:
    """The remote tier for blocks of `block_bytes` whose meaning `identity` names (the model, KV
    geometry, dtype, layout and parallel split: see ``values.namespace_digest``)."""
    endpoint = parse_url(s.url)
    password = read_password(s.password_env, s.password_file)
    secret = read_secret(s.secret_file) if s.secret_file else None
    fmt = ValueFormat(namespace_digest(identity, s.salt), secret)
    tier = RemoteTier(
        lambda: connect(endpoint, password=password, timeout_s=s.deadline_s, tls_ca_file=s.tls_ca_file),
        fmt,
        block_bytes,
        RemoteOptions(
            prefix=s.prefix,
            deadline_s=s.deadline_s,
            ttl_s=s.ttl_s,
            admission=s.admission,
            max_write_bytes=s.max_write_bytes,
        ),
        clock=clock,
        description=endpoint.describe(),
    )
    log.info(
        "kvtier remote tier: %s, namespace %s:%s, values %s, admission %s, deadline %g s",
        endpoint.describe(),
        s.prefix,
        fmt.namespace.hex(),
        "MAC-keyed" if secret is not None else "checksummed (no secret)",
        s.admission,
        s.deadline_s,
    )
    return tier
