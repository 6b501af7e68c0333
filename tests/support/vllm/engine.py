"""Helpers for the real-engine vLLM tests and benches: environment, tiny model, engines.

vLLM reads its environment at import, so ``prepare_env`` must run before the first
``import vllm`` in the process (the test modules call it from their first fixture).
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import mmap
import os
from pathlib import Path
from typing import Any

from support.vllm.make_tiny_model import build_tiny_llama

BLOCK = 32  # tokens per engine block (vLLM's CPU attention needs a multiple of 32)
PAGE_BYTES = 2 * BLOCK * 2 * 32 * 4  # KV heads * block * (K+V) * head_dim * fp32, per layer
BLOCK_BYTES = 2 * PAGE_BYTES  # two layers
PROMPT_LEN = 100  # 3 full chunks of 32 tokens...
SERVED = 96  # ...so 96 tokens can be served by an offload tier


def require_vllm() -> None:
    """Fail (not skip) when vLLM is missing: CI installs it (make vllm-env), so its absence is a
    broken environment that must be visible."""
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError("vLLM is not installed in this environment: run `make vllm-env`")


def prepare_env(tmp: Path) -> None:
    """Hermetic, in-process, CPU-only vLLM under ``tmp``."""
    tmp.mkdir(parents=True, exist_ok=True)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["TMPDIR"] = str(tmp)
    os.environ["VLLM_CACHE_ROOT"] = str(tmp / "vllm-cache")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import tempfile

    tempfile.tempdir = None  # re-read TMPDIR


def module_env(tmp_path_factory: Any, name: str) -> dict[str, Any]:
    """A test module's engine environment: its own temp dir (TMPDIR, VLLM_CACHE_ROOT), the tiny
    model (built once per session) and a disk-tier directory."""
    tmp = tmp_path_factory.mktemp(name)
    prepare_env(tmp)
    return {"tmp": tmp, "model": tiny_model(tmp_path_factory.getbasetemp()), "disk": tmp / "disk"}


def tiny_model(cache_dir: Path) -> str:
    return str(build_tiny_llama(cache_dir / "tiny-llama"))


def baseline_tokens(model: str, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """Greedy tokens of each prompt from an engine without any connector."""
    llm = make_llm(model)
    try:
        return {name: generate(llm, ids)[0] for name, ids in prompts.items()}
    finally:
        shutdown(llm)


def kvtier_config(**extra: Any) -> Any:
    from vllm.config import KVTransferConfig

    cfg = {"spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier_rs.integrations.vllm"}
    cfg.update(extra)
    return KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=cfg)


def offloading_config(extra: dict[str, Any]) -> Any:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra)


def make_llm(model: str, kv_transfer_config: Any = None, gpu_blocks: int = 16, **kw: Any) -> Any:
    from vllm import LLM

    args: dict[str, Any] = dict(
        model=model,
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        block_size=BLOCK,
        max_num_seqs=1,
        seed=0,
        kv_cache_memory_bytes=gpu_blocks * BLOCK_BYTES,
    )
    args.update(kw)
    if kv_transfer_config is not None:
        args["kv_transfer_config"] = kv_transfer_config
    try:
        return LLM(**args)
    except BaseException:
        # vLLM leaves it behind when an engine fails to start; the start-up error is what counts.
        with contextlib.suppress(Exception):
            _drop_process_connector()
        raise


def _drop_process_connector() -> None:
    """Shut down the KV connector an in-process engine leaves in vLLM's process-wide slot: the
    next engine of this process (another test's) would find it there and run with a connector
    made for the engine before it (or, without one of its own, with that one)."""
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    ensure_kv_transfer_shutdown()


def generate(llm: Any, ids: list[int], max_tokens: int = 8) -> tuple[list[int], int]:
    """Greedy tokens and ``num_cached_tokens`` (GPU prefix hits + tokens loaded by the connector)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)


def drop_gpu_cache(llm: Any) -> None:
    """Evict every prefix from the engine's own cache; the offload tiers keep theirs."""
    assert llm.reset_prefix_cache(), "engine still holds blocks; prefix cache not reset"


def shutdown(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    _drop_process_connector()


def engine_id(llm: Any) -> str:
    return llm.llm_engine.vllm_config.kv_transfer_config.engine_id


def prompt(seed: int, n: int) -> list[int]:
    """Deterministic token ids in 3..999 (0-2 are pad/bos/eos in the tiny config)."""
    import random

    r = random.Random(seed)
    return [r.randrange(3, 1000) for _ in range(n)]


def corrupt_payloads(root: Path) -> int:
    """Flip one payload byte of every block on disk (headers stay valid, so only the checksum
    check on read can notice). Slot layout: payload, then a 4 KiB header starting KVTSLOT1."""
    data_bytes = -(-BLOCK_BYTES // 4096) * 4096
    n = 0
    for f in root.rglob("*"):
        if not f.is_file() or f.stat().st_size < data_bytes + 4096:
            continue
        with open(f, "r+b") as fh, mmap.mmap(fh.fileno(), 0) as mm:
            pos = mm.find(b"KVTSLOT1")
            while pos != -1:
                if pos % 4096 == 0 and pos >= data_bytes:
                    mm[pos - data_bytes + 100] ^= 0xFF
                    n += 1
                pos = mm.find(b"KVTSLOT1", pos + 1)
    return n


def spec_config(extra, *, dp_index=0, dp_size=1, tp=1, pp=1, pcp=1, dcp=1, replicated=False, canonical=False):
    """A vLLM OffloadingConfig of the tiny model's geometry (32768-byte blocks, one per chunk), as
    vLLM hands it to an offloading spec: for specs built without an engine."""
    import uuid

    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(32, ("l0", "l1"), 0),),
        worker_kv_bytes_per_block=32768,
        enable_kv_cache_events=False,
        extra_config=extra,
        engine_id=uuid.uuid4().hex,
        model=OffloadingModelConfig("tiny/llama", "float32"),
        cache=OffloadingCacheConfig(32, 1),
        parallel=OffloadingParallelConfig(0, tp * pp * pcp, tp, pp, pcp, dcp, dp_index, dp_size, None, False),
        kv_cache_layout="LBHNC",
        replicated_layout=replicated,
        canonical_layout=canonical,
    )
