"""HTTP load for `vllm serve`: multi-turn conversations over the OpenAI completions API with the
OpenAI client (async, streaming), a fixed number of requests in flight.

Each conversation sends its turns in order (a turn's prompt is the conversation so far plus new
user tokens; with ``reuse=False`` the same lengths, every token fresh); conversations interleave,
``concurrency`` requests at a time, in arrival order (asyncio's semaphore is first come, first
served). TTFT is measured by the client: from sending the request to its first streamed token.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

VOCAB = (3, 1000)  # token ids drawn for prompts (0-2: the model's special tokens)


@dataclass(frozen=True)
class Record:
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    generated: int
    cached_tokens: int


async def _turn(client: Any, prompt: list[int], gen: int) -> tuple[Record, list[int]]:
    t0 = time.perf_counter()
    stream = await client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=gen,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    first: float | None = None
    tokens: list[int] = []
    cached = 0
    async for chunk in stream:
        for choice in chunk.choices:
            ids = (choice.model_extra or {}).get("token_ids")
            if ids is None:
                raise RuntimeError("the server streamed no token_ids (return_token_ids is vLLM's; is it vLLM?)")
            if ids and first is None:
                first = time.perf_counter()
            tokens += ids
        if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
            cached = int(chunk.usage.prompt_tokens_details.cached_tokens or 0)
    end = time.perf_counter()
    if first is None:
        raise RuntimeError("the server streamed no token")
    return Record(first - t0, end - t0, len(prompt), len(tokens), cached), tokens


async def _conversation(
    client: Any, gate: asyncio.Semaphore, turns: list[int], rng: random.Random, reuse: bool, gen: int
) -> list[Record]:
    history: list[int] = []
    records = []
    for new in turns:
        fresh = [rng.randrange(*VOCAB) for _ in range(new)]
        prompt = history + fresh if reuse else [rng.randrange(*VOCAB) for _ in history] + fresh
        async with gate:
            record, tokens = await _turn(client, prompt, gen)
        records.append(record)
        history = prompt + tokens
    return records


async def _run(url: str, conversations: list[list[int]], concurrency: int, reuse: bool, gen: int, seed: int):
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=url + "/v1", api_key="unused", timeout=600, max_retries=0) as client:
        gate = asyncio.Semaphore(concurrency)
        t0 = time.perf_counter()
        per = await asyncio.gather(
            *(
                _conversation(client, gate, turns, random.Random(seed * 100_003 + i), reuse, gen)
                for i, turns in enumerate(conversations)
            )
        )
        return [r for rs in per for r in rs], time.perf_counter() - t0


def run(
    url: str, conversations: list[list[int]], *, concurrency: int, reuse: bool, gen: int, seed: int
) -> dict[str, float]:
    """Send the conversations (each a list of new-token counts per turn) and summarise:
    TTFT percentiles, throughput (prompt + generated tokens per second of wall time) and the
    share of prompt tokens the engine did not compute."""
    records, wall = asyncio.run(_run(url, conversations, concurrency, reuse, gen, seed))
    ttft_ms = 1e3 * np.array([r.ttft_s for r in records])
    prompt = sum(r.prompt_tokens for r in records)
    p50, p95, p99 = np.percentile(ttft_ms, [50, 95, 99])
    return {
        "requests": len(records),
        "ttft_p50_ms": float(p50),
        "ttft_p95_ms": float(p95),
        "ttft_p99_ms": float(p99),
        "ttft_mean_ms": float(ttft_ms.mean()),
        "tokens_per_s": (prompt + sum(r.generated for r in records)) / wall,
        "requests_per_s": len(records) / wall,
        "cached_share": sum(r.cached_tokens for r in records) / prompt,
        "wall_s": wall,
    }
