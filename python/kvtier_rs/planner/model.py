"""Model byte accounting (KV bytes per token from a Hugging Face config) and size arguments."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from kvtier_rs._core import InvalidArgumentError
from kvtier_rs.config import parse_bytes
from kvtier_rs.planner.errors import PlanError

DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "bfloat16": 2,
    "bf16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
}


@dataclass
class ModelBytes:
    bytes_per_token: int
    source: str
    notes: list[str] = field(default_factory=list)


def _get(cfg: dict, *names: str) -> int | None:
    for n in names:
        v = cfg.get(n)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def bytes_per_token_from_config(path: str | Path, kv_dtype: str | None = None) -> ModelBytes:
    """KV-cache bytes per token: 2 (K and V) x layers x KV heads x head dim x dtype bytes, with
    MLA (one compressed latent per layer) and hybrid sliding-window models handled; a model whose
    every layer is sliding-window is refused (its per-prefix bytes are not per token)."""
    p = Path(path)
    try:
        cfg = json.loads(p.read_text())
    except FileNotFoundError:
        raise PlanError(f"--model-config: {p}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanError(f"--model-config: {p}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise PlanError(f"--model-config: {p}: expected a JSON object")
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        # Multimodal configs keep the language model under text_config.
        cfg = {**cfg, **cfg["text_config"]}
    notes: list[str] = []

    def need(value: int | None, what: str) -> int:
        if value is None or value <= 0:
            raise PlanError(f"--model-config: {p}: field {what!r} is missing or not a positive integer")
        return value

    layers = need(_get(cfg, "num_hidden_layers", "n_layer", "num_layers"), "num_hidden_layers")
    dtype_name = (kv_dtype or cfg.get("torch_dtype") or cfg.get("dtype") or "").lower()
    if not dtype_name:
        dtype_name = "bfloat16"
        notes.append("no dtype in the config: assuming bfloat16 KV (use --kv-dtype)")
    if dtype_name not in DTYPE_BYTES:
        raise PlanError(
            f"--kv-dtype/--model-config: unknown dtype {dtype_name!r}; expected one of {sorted(DTYPE_BYTES)}"
        )
    dbytes = DTYPE_BYTES[dtype_name]

    full_layers = layers
    layer_types = cfg.get("layer_types")
    window = cfg.get("sliding_window")
    if isinstance(layer_types, list) and layer_types:
        full_layers = sum(1 for t in layer_types if t == "full_attention")
        others = len(layer_types) - full_layers
        if full_layers == 0:
            raise PlanError(
                f"--model-config: {p}: no full-attention layer in layer_types; a sliding-window or "
                "linear-attention model keeps a bounded state per request, not bytes per token: "
                "pass --bytes-per-token"
            )
        if others:
            notes.append(
                f"{others} of {len(layer_types)} layers are not full attention "
                f"({sorted(set(layer_types) - {'full_attention'})}); "
                "only the full-attention layers are counted per token (their windowed state is a "
                "per-request constant)"
            )
    elif isinstance(window, int) and window > 0 and cfg.get("use_sliding_window", True):
        pattern = cfg.get("sliding_window_pattern")
        if isinstance(pattern, int) and pattern > 1:
            full_layers = layers // pattern
            notes.append(
                f"sliding window {window} on {layers - full_layers} of {layers} layers (pattern "
                f"{pattern}); counting the {full_layers} full layers"
            )
        else:
            raise PlanError(
                f"--model-config: {p}: every layer uses a sliding window of {window} tokens, so KV bytes "
                "do not grow per token past the window and prefix reuse is bounded by it: pass "
                "--bytes-per-token "
                "if you still want to plan"
            )

    if _get(cfg, "kv_lora_rank") is not None:
        rank = need(_get(cfg, "kv_lora_rank"), "kv_lora_rank")
        rope = _get(cfg, "qk_rope_head_dim") or 0
        per_layer = (rank + rope) * dbytes
        notes.append(f"MLA: one latent of {rank}+{rope} values per token and layer (no separate K and V)")
        return ModelBytes(per_layer * full_layers, f"{p.name} (MLA, {full_layers} layers, {dtype_name})", notes)

    heads = need(_get(cfg, "num_attention_heads", "n_head"), "num_attention_heads")
    kv_heads = _get(cfg, "num_key_value_heads", "n_head_kv", "num_kv_heads")
    if kv_heads is None:
        kv_heads = 1 if cfg.get("multi_query") else heads
    head_dim = _get(cfg, "head_dim")
    if head_dim is None:
        hidden = need(_get(cfg, "hidden_size", "n_embd", "d_model"), "hidden_size")
        head_dim = hidden // heads
    bpt = 2 * full_layers * kv_heads * head_dim * dbytes
    src = f"{p.name} ({full_layers} layers x {kv_heads} KV heads x {head_dim} head dim x {dbytes} B x K,V)"
    return ModelBytes(bpt, src, notes)


_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


@dataclass
class Size:
    """A tier size: bytes, or a block count when given with the `blocks` suffix."""

    value: int
    in_blocks: bool

    def blocks(self, block_bytes: int | None, arg: str) -> int:
        if self.in_blocks:
            return self.value
        if not block_bytes:
            raise PlanError(
                f"{arg}: a size in bytes needs --bytes-per-token or --model-config (or give it in "
                "blocks, e.g. 4000blocks)"
            )
        return self.value // block_bytes


def parse_size(text: str, arg: str) -> Size:
    m = _SIZE.match(text)
    if not m:
        raise PlanError(f"{arg}: cannot read {text!r}; expected e.g. 40GiB, 2TB or 5000blocks")
    num, unit = m.group(1), m.group(2).lower()
    if unit in ("block", "blocks", "blk"):
        if "." in num or int(num) <= 0:
            raise PlanError(f"{arg}: a block count must be a positive integer, got {num}")
        return Size(int(num), True)
    if unit == "":
        raise PlanError(f"{arg}: {text!r} has no unit; write bytes with a unit (40GiB, 512MB) or blocks (5000blocks)")
    try:
        value = parse_bytes(text, name=arg)  # the one byte-size parser (kvtier_rs.config)
    except InvalidArgumentError as e:
        raise PlanError(f"{arg}: {e}") from None
    return Size(value, False)


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n:.0f} B"
