"""Every `kvtier plan` option checked before the trace is read, so a bad one is refused at once,
in one line naming it, and never after a long read or replay.

`check_options` runs first in `run_plan` (and so for the CLI and for library callers alike). The
only check that needs the trace is whether a tier given in bytes holds one block of the trace's
block size; `tier_blocks` does it right after reading, before any replay. It is also done at
once when the block size is known up front (`--block-size`), and a size below one token's KV
bytes, too small for any block size, is refused at once as well.
"""

from __future__ import annotations

import math

from kvtier_rs._core import MAX_REPLICAS, InvalidArgumentError, parse_admission, policy_names
from kvtier_rs.planner.errors import PlanError
from kvtier_rs.planner.model import MAX_BYTES_PER_TOKEN, ModelBytes, bytes_per_token_from_config
from kvtier_rs.planner.options import PlanOptions
from kvtier_rs.planner.traces import check_reader_options
from kvtier_rs.planner.units import MAX_BLOCKS, Size, fmt_bytes

# Policies the sweep can replay; "opt" (Belady) needs the whole future, so it is planner-only.
ONLINE_POLICIES = tuple(policy_names())
ALL_POLICIES = (*ONLINE_POLICIES, "opt")
TIERS = ("gpu", "cpu", "disk", "remote")
SPLITS = ("round-robin", "session")
MAX_THREADS = 1024
MAX_TOP = 10_000


def _admission(option: str, spec: str) -> str:
    """An admission rule checked by the core's own parser, its error under the option's name."""
    try:
        return parse_admission(spec)
    except InvalidArgumentError as e:
        raise PlanError(f"{option}: {e.reason}") from None


def _positive_finite(option: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise PlanError(f"{option}: must be a positive finite number, got {value}")


def check_options(opts: PlanOptions) -> ModelBytes | None:
    """Refuse the first bad option, naming it; returns the model's KV bytes (None without
    --model-config or --bytes-per-token). Reads only the --model-config file."""
    check_reader_options(opts.trace_format, opts.block_size)
    if opts.limit is not None and opts.limit <= 0:
        raise PlanError(f"--limit: must be positive, got {opts.limit}")
    if not 0.0 <= opts.warmup < 1.0:  # NaN fails too
        raise PlanError(f"--warmup: must be in [0, 1), got {opts.warmup}")
    if opts.mode not in ("tree", "flat"):
        raise PlanError(f"--mode: expected tree or flat, got {opts.mode!r}")
    _check_policies(opts)
    for option, value in (
        ("--pcie-gbps", opts.pcie_gbps),
        ("--disk-gbps", opts.disk_gbps),
        ("--remote-gbps", opts.remote_gbps),
        ("--prefill-tps", opts.prefill_tps),
    ):
        _positive_finite(option, value)
    if not (opts.remote_latency_ms >= 0 and math.isfinite(opts.remote_latency_ms)):
        raise PlanError(f"--remote-latency-ms: must be a finite number >= 0, got {opts.remote_latency_ms}")
    if not 0 <= opts.threads <= MAX_THREADS:
        raise PlanError(f"--threads: must be between 0 (every core) and {MAX_THREADS}, got {opts.threads}")
    if not 0 <= opts.top <= MAX_TOP:
        raise PlanError(f"--top: must be between 0 and {MAX_TOP}, got {opts.top}")
    if opts.disk is not None and opts.cpu is None:
        raise PlanError("--disk: needs --cpu (disk promotions are staged through the CPU tier)")
    if opts.remote is not None and opts.cpu is None:
        raise PlanError("--remote: needs --cpu (remote promotions are staged through the CPU tier)")
    _check_replicas(opts)
    model = _model(opts)
    for name in TIERS:
        size = getattr(opts, name)
        if size is not None:
            _early_tier_check(f"--{name}", size, model, opts.block_size)
    return model


def _check_policies(opts: PlanOptions) -> None:
    """The policies, capacities and admissions to replay, and the tiers' own."""
    if not opts.policies:
        raise PlanError("--policies: give at least one policy")
    for pol in opts.policies:
        if pol not in ALL_POLICIES:
            raise PlanError(f"--policies: unknown policy {pol!r}; expected some of {', '.join(ALL_POLICIES)}")
    if opts.capacities is not None and any(not 0 < c <= MAX_BLOCKS for c in opts.capacities):
        raise PlanError(f"--capacities: every capacity must be between 1 and {MAX_BLOCKS} (10^12) blocks")
    for k in opts.admission_thresholds:
        _admission("--admission-thresholds", f"uses:{k}")
    if opts.tier_policy is not None and opts.tier_policy not in ONLINE_POLICIES:
        why = " (opt is offline: it needs the future, no live tier can run it)" if opts.tier_policy == "opt" else ""
        raise PlanError(
            f"--tier-policy: unknown policy {opts.tier_policy!r}{why}; expected one of {', '.join(ONLINE_POLICIES)}"
        )
    _admission("--cpu-admission", opts.cpu_admission)
    _admission("--disk-admission", opts.disk_admission)


def _check_replicas(opts: PlanOptions) -> None:
    """The replica split: how many replicas and how requests are given to them. The session
    split's need for session ids is checked once the trace is read (`replicas.split`)."""
    if isinstance(opts.replicas, bool) or not isinstance(opts.replicas, int) or not 1 <= opts.replicas <= MAX_REPLICAS:
        raise PlanError(f"--replicas: must be between 1 and {MAX_REPLICAS}, got {opts.replicas!r}")
    if opts.split not in SPLITS:
        raise PlanError(f"--split: expected one of {', '.join(SPLITS)}, got {opts.split!r}")
    if opts.replicas > 1 and opts.remote is None:
        raise PlanError(
            "--replicas: needs --remote (the replay compares the replicas' own tiers without and with a shared one)"
        )


def _model(opts: PlanOptions) -> ModelBytes | None:
    if opts.model_config is not None and opts.bytes_per_token is not None:
        raise PlanError("--bytes-per-token: give either --model-config or --bytes-per-token, not both")
    if opts.kv_dtype is not None and opts.model_config is None:
        raise PlanError("--kv-dtype: needs --model-config (it overrides the config's dtype)")
    if opts.model_config is not None:
        return bytes_per_token_from_config(opts.model_config, opts.kv_dtype)
    if opts.bytes_per_token is not None:
        if not 0 < opts.bytes_per_token <= MAX_BYTES_PER_TOKEN:
            raise PlanError(
                f"--bytes-per-token: must be between 1 and {MAX_BYTES_PER_TOKEN} (1 GiB), got {opts.bytes_per_token}"
            )
        return ModelBytes(opts.bytes_per_token, "--bytes-per-token")
    return None


def _early_tier_check(option: str, size: Size, model: ModelBytes | None, block_size: int | None) -> None:
    if size.in_blocks:
        tier_blocks(option, size, None)
        return
    if model is None:
        size.blocks(None, option)  # raises: a size in bytes needs the model's bytes per token
        return
    if block_size is not None:
        tier_blocks(option, size, model.bytes_per_token * block_size)
    elif size.value < model.bytes_per_token:
        # Any block holds at least one token: this size holds no block whatever the block size.
        raise PlanError(
            f"{option}: {fmt_bytes(size.value)} is smaller than one block (one token alone is "
            f"{fmt_bytes(model.bytes_per_token)} of KV)"
        )


def tier_blocks(option: str, size: Size, block_bytes: int | None) -> int:
    """A tier size in blocks, refused (naming the option) when it holds no block or too many."""
    blocks = size.blocks(block_bytes, option)
    if blocks <= 0:
        raise PlanError(f"{option}: {fmt_bytes(size.value)} is smaller than one block ({fmt_bytes(block_bytes)})")
    if blocks > MAX_BLOCKS:
        raise PlanError(f"{option}: {blocks} blocks of {block_bytes} bytes; at most {MAX_BLOCKS} (10^12) blocks")
    return blocks
