"""Time to first token of a replica served from the shared remote tier, against recomputing.

Two `vllm serve` replicas (default multiprocess mode, CPU, the benchmark's small Llama of
benches/bench_vllm_e2e.py) share a 3-primary Redis Cluster started here on loopback. Replica A
serves `--prompts` prompts of `--tokens` tokens each and stores their chunks in the cluster
(`remote_admission: "always"`), then stops. Replica B, with the same configuration and an empty
cache, serves the same prompts: each one's prefix comes from the remote tier (its counters are
checked). The baseline is a replica without offloading serving the same prompts: it recomputes
every prefix. Both answer one request at a time over HTTP with the OpenAI client (streaming);
TTFT runs from sending the request to its first token.

    python benches/bench_remote_ttft.py [--prompts 8] [--tokens 1536] [--reps 1]

Prints TTFT p50 / mean for B and for the baseline and the ratio (baseline over B: above 1, the
remote tier is faster than recomputing). No timing is asserted.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import serve_load  # noqa: E402 - benches/serve_load.py
from bench_vllm_e2e import BLOCK, BLOCK_BYTES, GEN, build_model  # noqa: E402 - the benchmark's model
from support.valkey import start_cluster  # noqa: E402 - the tests' cluster on loopback
from support.vllm.server import Server, metric  # noqa: E402 - `vllm serve` as the tests start it

K = "vllm:kv_offload_kvtier_"


def remote_config(url: str, cpu_chunks: int) -> dict[str, Any]:
    return {
        "kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier_rs.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "KvtierOffloadingSpec",
            "spec_module_path": "kvtier_rs.integrations.vllm",
            "cpu_bytes_to_use": cpu_chunks * BLOCK_BYTES,
            "remote_url": url,
            "remote_admission": "always",
            "remote_deadline_s": 10.0,  # a busy 2-core machine runs the servers and the cluster
        },
    }


def serve(model: str, work: Path, cfg: dict[str, Any] | None, a: argparse.Namespace) -> Server:
    longest = a.tokens + GEN
    return Server(
        model,
        work,
        kv_transfer_config=cfg,
        gpu_blocks=a.gpu_blocks,
        block_bytes=BLOCK_BYTES,
        max_model_len=BLOCK * -(-longest // BLOCK),
        extra_env={"VLLM_LOGGING_LEVEL": "WARNING"},
    ).wait_ready()


def requests(srv: Server, a: argparse.Namespace, seed: int) -> dict[str, float]:
    """The prompts (the same for the same seed), one at a time."""
    serve_load.run(srv.url, [[64]], concurrency=1, reuse=False, gen=GEN, seed=10_000 + seed)  # warm-up
    return serve_load.run(srv.url, [[a.tokens]] * a.prompts, concurrency=1, reuse=True, gen=GEN, seed=seed)


def one_rep(model: str, tmp: Path, a: argparse.Namespace, rep: int) -> dict[str, dict[str, float]]:
    cluster = start_cluster(tmp / f"cluster{rep}")
    chunks = a.prompts * (a.tokens // BLOCK)  # full chunks A stores
    servable = a.prompts * ((a.tokens - 1) // BLOCK)  # B recomputes each prompt's last token
    try:
        cfg = remote_config(cluster.url, cpu_chunks=chunks + 64)
        writer = serve(model, tmp / f"a{rep}", cfg, a)
        try:
            requests(writer, a, seed=rep)
            # Every full chunk of every prompt written through before A goes away.
            writer.wait_for_metric(K + "remote_writes_total", chunks, tier="remote")
        finally:
            writer.stop()
        out: dict[str, dict[str, float]] = {}
        for name, c in (("remote", cfg), ("recompute", None)):
            srv = serve(model, tmp / f"{name}{rep}", c, a)
            try:
                out[name] = requests(srv, a, seed=rep)
                if c is not None:
                    loaded = metric(srv.metrics(), K + "remote_hits_total", tier="remote")
                    if loaded < servable:
                        raise RuntimeError(f"replica B found {loaded:.0f} of {servable} chunks in the remote tier")
                    out[name]["remote_hits"] = loaded
            finally:
                srv.stop()
        return out
    finally:
        cluster.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8, help="prompts, each served by A, then by B and the baseline")
    ap.add_argument("--tokens", type=int, default=1536, help="tokens per prompt")
    ap.add_argument("--gpu-blocks", type=int, default=128, help="each engine's own KV cache, in blocks")
    ap.add_argument("--reps", type=int, default=1, help="repetitions (a fresh cluster and servers each)")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-bench-remote-ttft-"))
    t0 = time.monotonic()
    try:
        model = build_model(tmp / "model")
        runs = [one_rep(model, tmp, a, rep) for rep in range(a.reps)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    took = time.monotonic() - t0
    print(f"{a.prompts} prompts of {a.tokens} tokens, one request at a time, {a.reps} rep(s), {took:.0f} s")
    med = {n: {k: statistics.median(r[n][k] for r in runs) for k in ("ttft_p50_ms", "ttft_mean_ms")} for n in runs[0]}
    for name, m in med.items():
        print(f"  {name:10} TTFT p50 {m['ttft_p50_ms']:8.1f} ms   mean {m['ttft_mean_ms']:8.1f} ms")
    print(
        f"  recompute / remote: TTFT p50 {med['recompute']['ttft_p50_ms'] / med['remote']['ttft_p50_ms']:.2f}x, "
        f"mean {med['recompute']['ttft_mean_ms'] / med['remote']['ttft_mean_ms']:.2f}x "
        f"(remote hits {statistics.median(r['remote']['remote_hits'] for r in runs):.0f} chunks)"
    )


if __name__ == "__main__":
    main()
