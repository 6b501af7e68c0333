"""kvtier as TensorRT-LLM's KV cache connector: a CPU tier and an NVMe tier behind the engine's
GPU block pool, with retention priorities (needs TensorRT-LLM 1.2+ and a GPU).

    KVTIER_DISK=/nvme/kvtier python examples/trtllm_connector.py TinyLlama/TinyLlama-1.1B-Chat-v1.0
"""

from __future__ import annotations

import datetime
import json
import os
import sys


def main(model: str) -> None:
    # kvtier's options travel in the environment: KvCacheConnectorConfig has no free-form field.
    # block_identity "auto" (the default): blocks are keyed by the engine's own block hash,
    # computed with TensorRT-LLM's hasher and checked against SchedulerOutput.block_hashes.
    cfg = {"cpu_bytes": "8GiB", "min_offload_priority": 30, "block_identity": "auto"}
    if os.environ.get("KVTIER_DISK"):
        cfg.update(disk_root=os.environ["KVTIER_DISK"], disk_bytes="64GiB")
    os.environ["KVTIER_TRTLLM_CONFIG"] = json.dumps(cfg)

    from tensorrt_llm import LLM, SamplingParams
    from tensorrt_llm.llmapi import KvCacheConfig, KvCacheRetentionConfig

    from kvtier_rs.integrations.trtllm import connector_config

    llm = LLM(
        model,
        backend="pytorch",
        # Block reuse is required. host_cache_size stays unset: kvtier is the host tier, and a native
        # host pool as well would hold the same blocks twice. use_kv_cache_manager_v2=False keeps
        # retention priorities (V2 reports none to connectors).
        kv_cache_config=KvCacheConfig(enable_block_reuse=True, use_kv_cache_manager_v2=False),
        kv_connector_config=connector_config(),
    )
    system = "You are a terse assistant. " * 20
    keep = KvCacheRetentionConfig(
        [KvCacheRetentionConfig.TokenRangeRetentionConfig(0, 256, 90, datetime.timedelta(minutes=10))],
        decode_retention_priority=10,  # below min_offload_priority: generated blocks stay out of kvtier
    )
    params = SamplingParams(max_tokens=32)
    for q in ["What is KV cache offloading?", "Why keep a system prompt hot?"]:
        out = llm.generate([system + q], params, kv_cache_retention_config=keep)
        print(out[0].outputs[0].text)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "TinyLlama/TinyLlama-1.1B-Chat-v1.0")
