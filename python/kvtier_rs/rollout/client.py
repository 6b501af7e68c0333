"""Sending the requests: the OpenAI client's async API (streamed completions), so TTFT and the
gaps between tokens are seen per request as the engine sends them. No HTTP is written here: the
openai package speaks the protocol and parses the event stream; httpx (its transport) answers
the plain GETs of the endpoint's health, model list and metrics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvtier_rs.rollout.errors import RolloutError
from kvtier_rs.rollout.workload import Request

#: One request may take this long (a long prompt on a loaded engine).
REQUEST_TIMEOUT_S = 600.0


@dataclass
class Result:
    """One request as the client saw it. Times are seconds from when it was sent."""

    index: int
    level: str
    sent_s: float  # from the start of its concurrency level
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    prompt_tokens: int = 0
    sent_prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details (vLLM: --enable-prompt-tokens-details)
    error: str | None = None


def _base(url: str) -> str:
    return url.rstrip("/").removesuffix("/v1")


def endpoint_models(url: str, arg: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """The models an endpoint serves ({id: its model card}), or a one-line RolloutError naming
    the endpoint when it does not answer."""
    try:
        r = httpx.get(_base(url) + "/v1/models", timeout=timeout_s)
    except httpx.HTTPError as e:
        raise RolloutError(f"{arg} {url}: cannot reach the endpoint ({type(e).__name__}: {e})") from None
    if r.status_code != 200:
        raise RolloutError(f"{arg} {url}: GET /v1/models answered HTTP {r.status_code}; is it an OpenAI endpoint?")
    try:
        cards = r.json()["data"]
        return {c["id"]: c for c in cards}
    except (ValueError, KeyError, TypeError):
        raise RolloutError(f"{arg} {url}: GET /v1/models did not answer an OpenAI model list") from None


def check_model(url: str, model: str | None, arg: str) -> tuple[str, dict[str, Any]]:
    """The model to ask for (`model`, or the endpoint's only one) and its card; refuses a model
    the endpoint does not serve, naming what it does serve."""
    models = endpoint_models(url, arg)
    if model is None:
        if len(models) != 1:
            raise RolloutError(f"--model: {url} serves {sorted(models)}; name one")
        model = next(iter(models))
    if model not in models:
        raise RolloutError(f"--model {model}: {url} does not serve it (it serves {', '.join(sorted(models))})")
    return model, models[model]


class Client:
    """Streamed completions against one endpoint."""

    def __init__(self, url: str, model: str) -> None:
        from openai import AsyncOpenAI

        self.model = model
        # max_retries=0: a retried request would be measured as one slow request.
        self._api = AsyncOpenAI(base_url=_base(url) + "/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0)

    async def send(self, req: Request, level: str, t0: float) -> Result:
        res = Result(req.index, level, time.perf_counter() - t0, sent_prompt_tokens=len(req.prompt))
        start = time.perf_counter()
        last = start
        try:
            stream = await self._api.completions.create(
                model=self.model,
                prompt=req.prompt,
                max_tokens=req.max_tokens,
                temperature=0.0,
                stream=True,
                stream_options={"include_usage": True},
                # ignore_eos: the output length is the trace's, whatever the model says.
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            async for chunk in stream:
                now = time.perf_counter()
                n = _tokens_in(chunk)
                if n:
                    if res.ttft_s is None:
                        res.ttft_s = now - start
                        n -= 1  # the first token's time is the TTFT; the rest of the chunk follow it
                    # A chunk of several tokens (the server coalesced them) spreads its gap evenly.
                    gap = (now - last) / n if n else 0.0
                    res.itl_s.extend([gap] * n)
                    last = now
                if chunk.usage is not None:
                    _take_usage(res, chunk.usage)
            res.e2e_s = time.perf_counter() - start
        except Exception as e:  # recorded per request; the step's report counts failures
            res.error = f"{type(e).__name__}: {e}"[:300]
        return res

    async def close(self) -> None:
        await self._api.close()


def _tokens_in(chunk: Any) -> int:
    n = 0
    for choice in chunk.choices or ():
        ids = (choice.model_extra or {}).get("token_ids")
        if ids is not None:
            n += len(ids)
        elif choice.text:
            n += 1  # a server that sends no ids: one token per text delta
    return n


def _take_usage(res: Result, usage: Any) -> None:
    res.prompt_tokens = int(usage.prompt_tokens or 0)
    res.output_tokens = int(usage.completion_tokens or 0)
    details = getattr(usage, "prompt_tokens_details", None)
    if details is not None and details.cached_tokens is not None:
        res.cached_tokens = int(details.cached_tokens)
