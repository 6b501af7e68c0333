"""One trace served by K replicas: does a shared remote tier pay?

Each replica has its own GPU, CPU (and disk) tiers and sees only the requests given to it; the
remote store (a Valkey or Redis cluster) is one cache that every replica reads and writes. A
prefix computed on one replica is then a remote hit on another, where its own tiers would have
it recomputed. The tier replay runs twice over the same split, (a) the replicas' own tiers
alone and (b) the same with the shared remote tier behind them, and what (b) prefills less than
(a) is what the shared tier is worth. Both sides weigh loads against recompute by the same rule
(`gains.tiers_cost`), so a remote hit slower than recomputing counts as a recompute.
"""

from __future__ import annotations

from typing import Any

from kvtier_rs.planner.errors import PlanError
from kvtier_rs.planner.traces import TraceData


def split(data: TraceData, replicas: int, how: str) -> list[int]:
    """The replica of each request. `round-robin`: request i goes to replica i mod K, as a load
    balancer without affinity spreads them. `session`: every request of a conversation goes to
    the replica its conversation was given, conversations dealt round robin in the order they
    first appear, as a router with session affinity keeps them; it needs the trace's
    conversation ids (Bailian chat ids, kv-cache-tester conversations, the `session_id` of
    records from `kvtier trace synth`)."""
    if how == "round-robin":
        return [r % replicas for r in range(data.n_requests)]
    if data.sessions is None:
        raise PlanError(
            f"--split session: this {data.format} trace names no session or conversation of its requests "
            "(bailian chat ids, kvcache-tester conversations or session_id fields do); use --split round-robin"
        )
    order: dict[int, int] = {}
    return [order.setdefault(s, len(order)) % replicas for s in data.sessions]


def _side(mt: dict[str, Any], cost: dict[str, Any]) -> dict[str, Any]:
    """One side of the comparison: its tier replay, cost figures and what it prefills."""
    return {
        **mt,
        "recomputed_blocks": cost["recomputed_blocks"],
        "recomputed_tokens": cost["recomputed_tokens"],
        "cost": cost,
    }


def compare(
    replicas: int,
    how: str,
    assignment: list[int],
    private: tuple[dict[str, Any], dict[str, Any]],
    shared: tuple[dict[str, Any], dict[str, Any]],
    prefill_tps: float,
) -> dict[str, Any]:
    """The report's `replicas` section from the two replays, (tier replay, tiers_cost) each."""
    a, b = _side(*private), _side(*shared)
    total = b["total_tokens"] or 1
    saved_tokens = a["recomputed_tokens"] - b["recomputed_tokens"]
    per_replica = [0] * replicas
    for r in assignment:
        per_replica[r] += 1
    remote = next(t for t in b["tiers"] if t["name"] == "remote")
    return {
        "replicas": replicas,
        "split": how,
        "requests_per_replica": per_replica,
        "private": a,
        "with_remote": b,
        "remote_saves": {
            "recomputed_blocks": a["recomputed_blocks"] - b["recomputed_blocks"],
            "recomputed_tokens": saved_tokens,
            "token_share": saved_tokens / total,
            "prefill_compute_saved_s": saved_tokens / prefill_tps,
            "remote_served_blocks": remote["served_blocks"],
            "remote_served_tokens": remote["served_tokens"],
            "remote_saved_tokens": remote["saved_tokens"],
        },
    }
