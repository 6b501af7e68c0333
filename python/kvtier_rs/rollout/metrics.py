"""The engine's Prometheus series, scraped around each concurrency level, and what they say about
hit quality: prompt tokens hit in the engine's own (GPU) prefix cache, loaded from kvtier's CPU
tier, promoted from its disk tier, or recomputed.

vLLM counts prompt tokens served by its prefix cache (``vllm:prefix_cache_hits``) apart from
those a KV connector loaded (``vllm:external_prefix_cache_hits``); kvtier counts the chunks it
loaded from each tier (``vllm:kv_offload_kvtier_loads_cpu`` / ``_loads_disk``), so the connector's
tokens are split between the tiers in the proportion of their chunks (exact while every chunk
holds the same number of tokens, as kvtier's do). Parsed with prometheus_client's text parser.
"""

from __future__ import annotations

from typing import Any

import httpx

from kvtier_rs.rollout.errors import RolloutError

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

K = "vllm:kv_offload_kvtier_"
#: Counters whose increase over a level the report shows (summed over labels unless split below).
COUNTERS = {
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "external_queries": "vllm:external_prefix_cache_queries_total",
    "external_hits": "vllm:external_prefix_cache_hits_total",
    "preemptions": "vllm:num_preemptions_total",
    # GPU blocks evicted from vLLM's prefix cache, as sampled by --kv-cache-metrics (a sampled
    # count, --kv-cache-metrics-sample of them; absent without the flag).
    "gpu_evictions_sampled": "vllm:kv_block_idle_before_evict_seconds_count",
    "kvtier_loads_cpu": K + "loads_cpu_total",
    "kvtier_loads_disk": K + "loads_disk_total",
    "kvtier_promotions": K + "promotions_total",
    "kvtier_promotion_failures": K + "promotion_failures_total",
    "kvtier_disk_skipped_by_cost": K + "disk_skipped_by_cost_total",
    "kvtier_disk_refused_guard": K + "disk_refused_guard_total",
    "kvtier_disk_refused_backpressure": K + "disk_refused_backpressure_total",
}
#: Per-tier counters (label "tier").
TIER_COUNTERS = {
    "evictions": K + "evictions_total",
    "stores": K + "stores_completed_total",
    "guard_trips": K + "guard_trips_total",
}


def scrape(url: str, timeout_s: float = 30.0) -> Samples:
    """Every sample of the endpoint's /metrics, keyed by (name, sorted labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    base = url.rstrip("/").removesuffix("/v1")
    try:
        r = httpx.get(base + "/metrics", timeout=timeout_s)
    except httpx.HTTPError as e:
        raise RolloutError(f"{url}: cannot scrape /metrics ({type(e).__name__}: {e})") from None
    if r.status_code != 200:
        raise RolloutError(f"{url}: GET /metrics answered HTTP {r.status_code}")
    try:
        return {
            (s.name, tuple(sorted(s.labels.items()))): float(s.value)
            for fam in text_string_to_metric_families(r.text)
            for s in fam.samples
        }
    except ValueError as e:
        raise RolloutError(f"{url}: /metrics is not Prometheus text ({e})") from None


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples named `name` whose labels include `labels` (0 when there are none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def has(samples: Samples, name: str) -> bool:
    return any(n == name for n, _ in samples)


def deltas(before: Samples, after: Samples) -> dict[str, Any]:
    """The counters' increase between two scrapes; None for a series the engine does not
    export (a baseline has no kvtier series: reported as absent, not as zero)."""
    out: dict[str, Any] = {}
    for key, name in COUNTERS.items():
        out[key] = total(after, name) - total(before, name) if has(after, name) else None
    for key, name in TIER_COUNTERS.items():
        tiers = sorted({dict(ls).get("tier", "") for n, ls in after if n == name})
        out[key] = {t: total(after, name, tier=t) - total(before, name, tier=t) for t in tiers} or None
    return out


def hit_quality(d: dict[str, Any]) -> dict[str, Any]:
    """Prompt tokens by where they came from, from a level's counter deltas: gpu (the engine's
    prefix cache), cpu and disk (kvtier's loads), recomputed (the rest of the prompt tokens the
    engine was asked for), with shares of the total."""
    queried = d["prefix_cache_queries"] or 0.0
    gpu = d["prefix_cache_hits"] or 0.0
    external = d["external_hits"] or 0.0
    cpu_chunks, disk_chunks = d["kvtier_loads_cpu"] or 0.0, d["kvtier_loads_disk"] or 0.0
    chunks = cpu_chunks + disk_chunks
    cpu = external * cpu_chunks / chunks if chunks else 0.0
    disk = external * disk_chunks / chunks if chunks else 0.0
    other = external - cpu - disk  # a connector other than kvtier's tiers (none when kvtier loads)
    recomputed = max(0.0, queried - gpu - external)
    tokens = {"gpu": gpu, "cpu": cpu, "disk": disk, "other_connector": other, "recomputed": recomputed}
    shares = {k: (v / queried if queried else None) for k, v in tokens.items()}
    return {
        "prompt_tokens": queried,
        "tokens": tokens,
        "shares": shares,
        "chunks": {"cpu": cpu_chunks, "disk": disk_chunks},
    }


def engine_info(samples: Samples) -> dict[str, Any]:
    """What the engine says of its KV cache (vLLM's cache_config_info labels) and kvtier's tier
    capacities, for the planner's side of the comparison."""
    info: dict[str, Any] = {}
    for (name, labels), _ in samples.items():
        if name == "vllm:cache_config_info":
            info["cache_config"] = dict(labels)
    info["kvtier_capacity_blocks"] = {
        dict(ls).get("tier", ""): v for (n, ls), v in samples.items() if n == K + "capacity_blocks"
    }
    return info
