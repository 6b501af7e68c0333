"""Model byte accounting: KV bytes per token from a Hugging Face config."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

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
# A sanity bound, far beyond any real deployment, that keeps byte counts well inside the core's
# 64-bit integers and the cost model's floats.
MAX_BYTES_PER_TOKEN = 2**30  # 1 GiB of KV per token


@dataclass
class ModelBytes:
    bytes_per_token: int
    source: str
    notes: list[str] = field(default_factory=list)


def _get(cfg: dict, p: Path, *names: str, minimum: int = 1) -> int | None:
    """The first of `names` present in the config (a null counts as absent), which must be an
    integer >= `minimum`; None when none is present."""
    for n in names:
        v = cfg.get(n)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise PlanError(f"--model-config: {p}: field {n!r} must be {what}, got {v!r}")
        return v
    return None


def _need(cfg: dict, p: Path, *names: str) -> int:
    v = _get(cfg, p, *names)
    if v is None:
        raise PlanError(f"--model-config: {p}: field {names[0]!r} is missing")
    return v


def bytes_per_token_from_config(path: str | Path, kv_dtype: str | None = None) -> ModelBytes:
    """KV-cache bytes per token: 2 (K and V) x layers x KV heads x head dim x dtype bytes, with
    MLA (one compressed latent per layer) and hybrid sliding-window models handled; a model whose
    every layer is sliding-window is refused (its per-prefix bytes are not per token)."""
    p = Path(path)
    try:
        cfg = json.loads(p.read_text())
    except FileNotFoundError:
        raise PlanError(f"--model-config: {p}: no such file") from None
    except OSError as e:
        raise PlanError(f"--model-config: {p}: cannot read: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanError(f"--model-config: {p}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise PlanError(f"--model-config: {p}: expected a JSON object")
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        # Multimodal configs keep the language model under text_config.
        cfg = {**cfg, **cfg["text_config"]}
    notes: list[str] = []

    layers = _need(cfg, p, "num_hidden_layers", "n_layer", "num_layers")
    dtype_name = _kv_dtype(cfg, p, kv_dtype, notes)
    dbytes = DTYPE_BYTES[dtype_name]
    full_layers = _full_attention_layers(cfg, p, layers, notes)

    rank = _get(cfg, p, "kv_lora_rank")
    if rank is not None:
        rope = _get(cfg, p, "qk_rope_head_dim", minimum=0) or 0
        per_layer = (rank + rope) * dbytes
        notes.append(f"MLA: one latent of {rank}+{rope} values per token and layer (no separate K and V)")
        bpt = per_layer * full_layers
        return _bounded(ModelBytes(bpt, f"{p.name} (MLA, {full_layers} layers, {dtype_name})", notes), p)

    heads = _need(cfg, p, "num_attention_heads", "n_head")
    kv_heads = _get(cfg, p, "num_key_value_heads", "n_head_kv", "num_kv_heads")
    if kv_heads is None:
        kv_heads = 1 if cfg.get("multi_query") else heads
    head_dim = _get(cfg, p, "head_dim")
    if head_dim is None:
        hidden = _need(cfg, p, "hidden_size", "n_embd", "d_model")
        if hidden < heads:
            raise PlanError(
                f"--model-config: {p}: field 'hidden_size' ({hidden}) is smaller than "
                f"'num_attention_heads' ({heads}): no head dimension; give 'head_dim'"
            )
        head_dim = hidden // heads
    bpt = 2 * full_layers * kv_heads * head_dim * dbytes
    src = f"{p.name} ({full_layers} layers x {kv_heads} KV heads x {head_dim} head dim x {dbytes} B x K,V)"
    return _bounded(ModelBytes(bpt, src, notes), p)


def _kv_dtype(cfg: dict, p: Path, kv_dtype: str | None, notes: list[str]) -> str:
    """The KV dtype's name: --kv-dtype, else the config's, else bfloat16 (with a note)."""
    dtype_name = kv_dtype or ""
    if not dtype_name:
        for key in ("torch_dtype", "dtype"):
            if cfg.get(key) is not None:
                if not isinstance(cfg[key], str):
                    raise PlanError(f"--model-config: {p}: field {key!r} must be a dtype name, got {cfg[key]!r}")
                dtype_name = cfg[key]
                break
    dtype_name = dtype_name.lower()
    if not dtype_name:
        dtype_name = "bfloat16"
        notes.append("no dtype in the config: assuming bfloat16 KV (use --kv-dtype)")
    if dtype_name not in DTYPE_BYTES:
        raise PlanError(
            f"--kv-dtype/--model-config: unknown dtype {dtype_name!r}; expected one of {sorted(DTYPE_BYTES)}"
        )
    return dtype_name


def _full_attention_layers(cfg: dict, p: Path, layers: int, notes: list[str]) -> int:
    """The layers whose KV grows with every token: all of them but sliding-window (or other
    bounded-state) layers; a model with none is refused."""
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
    return full_layers


def _bounded(m: ModelBytes, p: Path) -> ModelBytes:
    if m.bytes_per_token > MAX_BYTES_PER_TOKEN:
        raise PlanError(
            f"--model-config: {p}: {m.bytes_per_token} KV bytes per token is more than the "
            f"{MAX_BYTES_PER_TOKEN} (1 GiB) any real model needs; check its layer and head counts"
        )
    return m
