"""A trace turned into requests: token-id prompts whose prefixes are shared exactly as the
trace's block ids say.

Every block id becomes a fixed run of token ids, drawn from a generator seeded with the id (and
a salt), so block i of any chain is always the same tokens and two requests share exactly the
leading blocks their ids share. Prompts are sent as token ids (the completions API takes a list
of ints), never as text: text would go through the engine's tokenizer, whose merges at block
boundaries would blur the shared prefixes, and would need a tokenizer on this side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvtier_rs.planner.traces import TraceData
from kvtier_rs.rollout.errors import RolloutError

#: Default token-id range. Ids below 100 are where most vocabularies keep their special tokens
#: (BOS, EOS, padding); every model's vocabulary has at least 1000 ids.
TOKEN_RANGE = (100, 1000)


@dataclass(frozen=True)
class Request:
    index: int  # the record's position in the trace
    prompt: list[int]
    max_tokens: int
    arrival_s: float  # from the first request's timestamp
    chain: list[int]  # the trace's block ids the prompt holds (fewer than the record's when cut)
    cut: bool = False  # cut to fit the endpoint's prompt limit

    @property
    def blocks(self) -> int:
        return len(self.chain)


@dataclass(frozen=True)
class WorkloadOptions:
    block_tokens: int  # tokens each trace block becomes
    max_tokens: int  # output tokens at most (the trace's output length, cut to this)
    max_prompt_tokens: int | None = None  # chains longer are cut at a block boundary
    token_range: tuple[int, int] = TOKEN_RANGE
    seed: int = 0


def parse_token_range(text: str, arg: str = "--token-range") -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise RolloutError(f"{arg}: expected LO:HI token ids, e.g. 100:1000, got {text!r}") from None
    if not 0 <= lo < hi:
        raise RolloutError(f"{arg}: need 0 <= LO < HI, got {text!r}")
    return lo, hi


class BlockTokens:
    """The token ids of each block id under one salt, made once and reused."""

    def __init__(self, block_tokens: int, token_range: tuple[int, int], seed: int, salt: int) -> None:
        self.n, self.range, self.seed, self.salt = block_tokens, token_range, seed, salt
        self._cache: dict[int, list[int]] = {}

    def __call__(self, key: int) -> list[int]:
        toks = self._cache.get(key)
        if toks is None:
            # SeedSequence mixes the whole 64-bit id (and the salt), so ids that differ in any bit
            # get unrelated tokens.
            rng = np.random.default_rng([self.seed, self.salt, key])
            toks = rng.integers(self.range[0], self.range[1], size=self.n).tolist()
            self._cache[key] = toks
        return toks


def build_requests(data: TraceData, opts: WorkloadOptions, salt: int = 0) -> list[Request]:
    """One request per trace record. A record's input length is scaled by block_tokens over the
    trace's block size (so its last, partial block stays partial), and every listed block holds
    at least one token. With `max_prompt_tokens` a longer chain keeps only its leading whole
    blocks that fit: cut anywhere else, prompts that share those blocks would stop sharing."""
    blocks_of = BlockTokens(opts.block_tokens, opts.token_range, opts.seed, salt)
    bs, bt = data.block_size, opts.block_tokens
    t0 = data.timestamps_s[0] if data.n_requests else 0.0
    out = []
    for r in range(data.n_requests):
        ids = list(data.keys[data.offsets[r] : data.offsets[r + 1]])
        if not ids:
            continue  # a record with no blocks has no prefix to share or reuse
        n = math.ceil(data.input_tokens[r] * bt / bs)
        n = min(max(n, (len(ids) - 1) * bt + 1), len(ids) * bt)
        cut = opts.max_prompt_tokens is not None and n > opts.max_prompt_tokens
        if opts.max_prompt_tokens is not None and cut:
            keep = opts.max_prompt_tokens // bt
            if keep == 0:
                raise RolloutError(
                    f"--block-tokens: {bt} tokens per block do not fit the endpoint's prompt limit of "
                    f"{opts.max_prompt_tokens} tokens; give fewer"
                )
            ids, n = ids[:keep], keep * bt
        prompt: list[int] = []
        for key in ids:
            prompt.extend(blocks_of(key))
        out_tokens = max(1, min(opts.max_tokens, data.output_tokens[r] or opts.max_tokens))
        out.append(Request(r, prompt[:n], out_tokens, data.timestamps_s[r] - t0, ids, cut))
    if not out:
        raise RolloutError(f"{data.path}: no request of the trace has any block to replay")
    return out


def shared_prefix_blocks(a: Request, b: Request, block_tokens: int) -> int:
    """Whole blocks two prompts share from the start (a check of the synthesis)."""
    n = 0
    while (n + 1) * block_tokens <= min(len(a.prompt), len(b.prompt)) and (
        a.prompt[n * block_tokens : (n + 1) * block_tokens] == b.prompt[n * block_tokens : (n + 1) * block_tokens]
    ):
        n += 1
    return n
