"""Build the tiny random Llama used by the vLLM tests and benches (no download).

hidden 128, 4 heads (head_dim 32, the smallest head size vLLM's CPU attention accepts), 2 KV
heads, 2 layers, vocab 1000, fp32. 2-D weights are scaled by 4 so that greedy decoding is not
degenerate (a freshly initialised model tends to repeat one token, which would make the
"outputs match the baseline" comparisons weak).

Usage: python tests/support/vllm/make_tiny_model.py DIR   (prints DIR; reuses a complete DIR)
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Bump when the recipe changes so that cached copies are rebuilt.
RECIPE_VERSION = "1"


def _saved(out_dir: str | Path, name: str, make: Callable[[], Any]) -> Path:
    """`out_dir` holding the model `make()` builds, reused when a complete copy is there."""
    out = Path(out_dir)
    stamp = out / f".kvtier-{name}-v{RECIPE_VERSION}"
    if not stamp.exists():
        model = make()
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out, safe_serialization=True)
        stamp.touch()
    return out


def build_tiny_llama(out_dir: str | Path, seed: int = 0) -> Path:
    return _saved(out_dir, "tiny-llama", lambda: _tiny_llama(seed))


def _tiny_llama(seed: int) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=1000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        torch_dtype="float32",
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return model


def build_tiny_hybrid(out_dir: str | Path, seed: int = 0) -> Path:
    """A tiny Gemma 3 text model whose two layers are a sliding-window (64 tokens) and a
    full-attention layer: vLLM gives it two KV-cache groups. Weights drawn with std 0.1 (the
    default 0.02 makes its greedy tokens repeat one id). hidden 128, 2 heads of 64, 1 KV head,
    vocab 1000, fp32."""
    return _saved(out_dir, "tiny-hybrid", lambda: _tiny_hybrid(seed))


def _tiny_hybrid(seed: int) -> Any:
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        vocab_size=1000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=2048,
        torch_dtype="float32",
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        initializer_range=0.1,
    )
    cfg.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(seed)
    return Gemma3ForCausalLM(cfg).to(torch.float32)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(build_tiny_llama(sys.argv[1]))
