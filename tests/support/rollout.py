"""A small Mooncake-format trace with known reuse for `kvtier rollout`'s tests, and a stand-in
OpenAI model list for the input checks that need an answering endpoint but no engine."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: Block chains, in order. With 32 prompt tokens per block and an engine cache of 16 blocks:
#: request 1 reuses request 0's first four blocks at once (a GPU prefix hit); requests 5-9 come
#: back to chains that three requests (15 blocks) pushed out of the GPU cache, so with a CPU
#: tier they are loaded from it, without one recomputed.
CHAINS = [
    [1, 2, 3, 4, 5],
    [1, 2, 3, 4, 8],
    [10, 11, 12, 13, 14],
    [20, 21, 22, 23, 24],
    [30, 31, 32, 33, 34],
    [1, 2, 3, 4, 6],
    [10, 11, 12, 40, 41],
    [20, 21, 22, 23, 50],
    [30, 31, 32, 33, 34],
    [1, 2, 3, 4, 7],
]
BLOCK_TOKENS = 32  # prompt tokens per trace block in the tests: the tiny model's engine block


def write_reuse_trace(path: Path) -> Path:
    """CHAINS as Mooncake records (512-token blocks, the last one half full, 100 ms apart)."""
    with open(path, "w") as f:
        for i, chain in enumerate(CHAINS):
            rec = {"timestamp": i * 100, "input_length": (len(chain) - 1) * 512 + 256, "output_length": 4}
            f.write(json.dumps({**rec, "hash_ids": chain}) + "\n")
    return path


@contextmanager
def model_list(models: list[str]) -> Iterator[str]:
    """A loopback HTTP server answering GET /v1/models with `models` (nothing else): an
    endpoint that is up but serves other models than the one asked for."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/v1/models":
                self.send_error(404)
                return
            body = json.dumps({"object": "list", "data": [{"id": m, "object": "model"} for m in models]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()
