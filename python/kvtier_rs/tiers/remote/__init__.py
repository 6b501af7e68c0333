"""The shared remote tier: KV blocks in a Valkey/Redis Cluster that every serving replica of one
deployment reads and writes, staged through the CPU tier like the disk tier.

- `values`: the self-describing, verified value of one block, and the keys replicas agree on;
- `client`: the cluster connection (URL, credentials, TLS);
- `breaker`: the circuit breaker that stops calling a failing store;
- `tier`: `RemoteTier`, the staging contract over the store, with its worker threads.
"""

from kvtier_rs.tiers.remote.breaker import BreakerState, CircuitBreaker
from kvtier_rs.tiers.remote.tier import RemoteJobResult, RemoteOptions, RemoteTier, RemoteWriteTicket
from kvtier_rs.tiers.remote.values import Miss, ValueFormat, derive_secret, namespace_digest, store_key

__all__ = [
    "BreakerState",
    "CircuitBreaker",
    "Miss",
    "RemoteJobResult",
    "RemoteOptions",
    "RemoteTier",
    "RemoteWriteTicket",
    "ValueFormat",
    "derive_secret",
    "namespace_digest",
    "store_key",
]
