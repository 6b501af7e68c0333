"""The one configuration tree: every option kvtier takes, with its name, section, default, check
and one-line meaning, and which entry points take it.

Every entry point reads its options through this tree, so an option has one name, one default
and one check wherever it is set:

- the Python API: ``read_settings(mapping)`` returns the typed ``Settings`` (CPU tier, disk tier,
  data path and guard);
- vLLM's ``kv_connector_extra_config`` and a ``KvtierDiskTier`` or ``KvtierRemoteTier`` entry of
  its ``secondary_tiers`` (``integrations.vllm.options``);
- TensorRT-LLM's connector config (``integrations.trtllm.config``);
- the planner's ``--cpu-bytes``, ``--disk-bytes``, ``--cpu-admission`` and ``--disk-admission``.

Where an engine has its own long-standing name for an option (vLLM's ``cpu_bytes_to_use`` and
``eviction_policy``), or an earlier kvtier release used another name, the entry point also takes
that name as an alias; giving both is an error. Where an engine needs another default (TensorRT-
LLM's tiers evict by its retention priorities), the tree says so and why.

The option tables of the docs are generated from this tree (``python -m kvtier_rs.settings``
prints them; a test holds the docs to them).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier_rs import defaults as D
from kvtier_rs._core import InvalidArgumentError
from kvtier_rs.checks import show
from kvtier_rs.options import MIN_SAMPLES_MAX, OptionReader, guard_rule
from kvtier_rs.orchestrator.gate import DEFAULT_MAX_IN_FLIGHT
from kvtier_rs.orchestrator.guard import GuardRule
from kvtier_rs.orchestrator.request_guard import RequestRule

#: The entry points that read options through the tree.
API, VLLM, TRTLLM, PLANNER = "api", "vllm", "trtllm", "planner"
VLLM_DISK_TIER, VLLM_REMOTE_TIER = "vllm_disk_tier", "vllm_remote_tier"
ENTRY_POINTS = (API, VLLM, VLLM_DISK_TIER, VLLM_REMOTE_TIER, TRTLLM, PLANNER)
#: The sections of the tree, in the order the docs list them.
SECTIONS = ("cpu tier", "disk tier", "remote tier", "data path", "guard", "engine")


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


#: The default of an option that must be given (with its ``needs`` option, if it has one).
REQUIRED: Any = _Required()

Check = Callable[[OptionReader, str, Any], Any]


@dataclass(frozen=True)
class Setting:
    """One option of the tree.

    key: its name, the same at every entry point.
    section: one of ``SECTIONS``.
    meaning: one line, for the docs' tables and for errors.
    check: validates a value given under a name (the key or an alias) and returns it in canonical
        form; raises ``InvalidArgumentError`` naming that name.
    default: the value when the option is not given, or ``REQUIRED``. Default: None (off).
    takes: the entry points that take it. Default: the API, vLLM and TensorRT-LLM.
    aliases: per entry point, other names it takes for this option. Default: none.
    engine_defaults: per entry point, a default that differs from ``default``, with the reason in
        ``meaning``. Default: none.
    needs: another option without which this one is an error (and, if REQUIRED, with which this
        one is required). Default: none.
    flag: the planner's command-line flag. Default: none (not a planner option).
    shown_default: how the docs show the default where the value alone says too little.
    """

    key: str
    section: str
    meaning: str
    check: Check
    default: Any = None
    takes: frozenset[str] = frozenset({API, VLLM, TRTLLM})
    aliases: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    engine_defaults: Mapping[str, Any] = field(default_factory=dict)
    needs: str | None = None
    flag: str | None = None
    shown_default: str | None = None

    def default_for(self, entry: str) -> Any:
        return self.engine_defaults.get(entry, self.default)

    def names_for(self, entry: str) -> tuple[str, ...]:
        """The key and its aliases at `entry`, the key first."""
        return (self.key, *self.aliases.get(entry, ()))


# ---- checks of one value ------------------------------------------------------------------------


def _size(r: OptionReader, k: str, v: Any) -> int:
    return r.size(k, v)


def _policy(r: OptionReader, k: str, v: Any) -> str:
    return r.policy(k, v)


def _admission(r: OptionReader, k: str, v: Any) -> str:
    return r.admission(k, v)


def _directory(r: OptionReader, k: str, v: Any) -> str:
    return r.directory(k, v)


def _io_engine(r: OptionReader, k: str, v: Any) -> str:
    return r.disk_io_engine(k, v)


def _queue_depth(r: OptionReader, k: str, v: Any) -> int:
    return r.queue_depth(k, v)


def _in_flight(r: OptionReader, k: str, v: Any) -> int:
    return r.int_in(k, v, 1, 1 << 20)


def _remote_url(r: OptionReader, k: str, v: Any) -> str:
    from kvtier_rs.tiers.remote.client import parse_url

    if not isinstance(v, str):
        raise r.error(k, f"expected redis://host:port[,host:port...] or rediss://..., got {show(v)}")
    try:
        parse_url(v, k)
    except InvalidArgumentError as e:
        raise r.error(k, e.reason) from None
    return v


def _key_prefix(r: OptionReader, k: str, v: Any) -> str:
    if not isinstance(v, str) or not v or any(c in v for c in ": \t\r\n"):
        raise r.error(k, f"expected a non-empty string without ':' or spaces, got {show(v)}")
    return v


def _string(r: OptionReader, k: str, v: Any) -> str:
    if not isinstance(v, str):
        raise r.error(k, f"expected a string, got {show(v)}")
    return v


def _file(r: OptionReader, k: str, v: Any) -> str:
    return r.directory(k, v)  # a path; whether it can be read is said at open


def _positive_seconds(r: OptionReader, k: str, v: Any) -> float:
    return r.positive(k, v, unit="(seconds)")


def _guard(r: OptionReader, k: str, v: Any) -> GuardRule | None:
    return guard_rule(r, k, v)


_REQUEST_FIELDS = ("ttft_p99_ms", "itl_p99_ms", "window_s", "recover_s", "min_samples")


def _request_rule(r: OptionReader, k: str, v: Any) -> RequestRule | None:
    if v is None:
        return None
    if not isinstance(v, Mapping):
        raise r.error(k, f"expected null or a dict with ttft_p99_ms and/or itl_p99_ms, got {show(v)}")
    unknown = sorted(map(str, set(v) - set(_REQUEST_FIELDS)))
    if unknown:
        raise r.error(k, f"unknown field(s) {unknown}; expected {', '.join(_REQUEST_FIELDS)}")
    if "ttft_p99_ms" not in v and "itl_p99_ms" not in v:
        raise r.error(k, "needs ttft_p99_ms, itl_p99_ms or both: the budgets for requests' p99 TTFT and ITL, in ms")
    numbers = {f: r.positive(k, v[f], field=f) for f in _REQUEST_FIELDS[:4] if f in v}
    samples = v.get("min_samples", GuardRule.min_samples)
    if isinstance(samples, bool) or not isinstance(samples, int) or not 1 <= samples <= MIN_SAMPLES_MAX:
        raise r.error(k, f"min_samples must be an int in 1..{MIN_SAMPLES_MAX}, got {show(samples)}")
    return RequestRule(**numbers, min_samples=samples)


def _choice(*choices: str) -> Check:
    return lambda r, k, v: r.choice(k, v, choices)


def _seconds(r: OptionReader, k: str, v: Any) -> float:
    return r.positive(k, v, unit="of seconds")


def _priority(r: OptionReader, k: str, v: Any) -> int:
    return r.int_in(k, v, 0, 100)


def _optional_str(r: OptionReader, k: str, v: Any) -> str | None:
    if v is not None and not isinstance(v, str):
        raise r.error(k, f"expected a string, got {show(v)}")
    return v


@dataclass(frozen=True)
class CostRates:
    """The ``cost_model`` option: load a hit only when moving it is estimated faster than
    recomputing its tokens. ``disk_read_bytes_per_s`` is the first estimate of the disk's read
    rate (the orchestrator's default otherwise); measured reads refine it."""

    prefill_tokens_per_s: float
    disk_read_bytes_per_s: float | None = None


_COST_FIELDS = ("prefill_tokens_per_s", "disk_read_bytes_per_s")


def _cost_model(r: OptionReader, k: str, v: Any) -> CostRates | None:
    if v is None or v == "always_load":
        return None
    if not isinstance(v, Mapping):
        raise r.error(
            k,
            'expected "always_load", null or a dict with prefill_tokens_per_s (and disk_read_bytes_per_s), '
            f"got {show(v)}",
        )
    unknown = sorted(map(str, set(v) - set(_COST_FIELDS)))
    if unknown:
        raise r.error(k, f"unknown field(s) {unknown}; expected prefill_tokens_per_s and disk_read_bytes_per_s")
    if "prefill_tokens_per_s" not in v:
        raise r.error(k, "prefill_tokens_per_s is required: the engine's prefill rate, tokens per second")
    rates = {f: r.positive(k, v[f], field=f) for f in _COST_FIELDS if f in v}
    return CostRates(**rates)


def _guard_meaning(tier: str, what: str) -> str:
    return (
        "null (off) or a dict with `p99_ms` and optionally `window_s` (default "
        f"{GuardRule.window_s:g}), `recover_s` (default {GuardRule.recover_s:g}) and `min_samples` (default "
        f"{GuardRule.min_samples}): when the p99 time requests waited on {what} over `window_s` exceeds "
        f"`p99_ms`, the {tier} tier is bypassed for `recover_s` (its hits are recomputed, nothing waits on "
        "it), then re-probed; promotions that hang count as slow. A trip and a recovery are logged and "
        "shown as `guard_state{tier}` and `guard_trips{tier}`"
    )


_ALL = frozenset({API, VLLM, TRTLLM})
_DISK = frozenset({API, VLLM, VLLM_DISK_TIER, TRTLLM})
_REMOTE = frozenset({API, VLLM, VLLM_REMOTE_TIER, TRTLLM})

#: The tree, in the order the docs list it.
TREE: tuple[Setting, ...] = (
    # -- the CPU tier --
    Setting(
        "cpu_bytes",
        "cpu tier",
        'CPU tier capacity, bytes or a size string such as `"32GiB"`',
        _size,
        default=REQUIRED,
        takes=_ALL | {PLANNER},
        engine_defaults={PLANNER: None},
        aliases={VLLM: ("cpu_bytes_to_use",), PLANNER: ("--cpu",)},
        flag="--cpu-bytes",
    ),
    Setting(
        "cpu_policy",
        "cpu tier",
        "CPU tier eviction policy: `lru`, `arc`, `fifo`, `priority`, `s3fifo`, `lhd` (TensorRT-LLM: `priority`, "
        "which carries its retention priorities)",
        _policy,
        default=D.POLICY,
        engine_defaults={TRTLLM: "priority"},
        aliases={VLLM: ("eviction_policy",)},
    ),
    Setting(
        "cpu_admission",
        "cpu tier",
        'CPU tier admission: `"always"`, `"uses:K"` (store a block on its K-th offer) or `"priority:T"`; '
        'vLLM\'s `store_threshold: N` means `"uses:N"`',
        _admission,
        default=D.CPU_ADMISSION,
        takes=_ALL | {PLANNER},
        flag="--cpu-admission",
    ),
    # -- the disk tier --
    Setting(
        "disk_root",
        "disk tier",
        "directory of the disk tier; setting it turns the disk tier on",
        _directory,
        default=None,
        takes=_DISK,
        engine_defaults={VLLM_DISK_TIER: REQUIRED},
        aliases={VLLM_DISK_TIER: ("root_dir",)},
        shown_default="null (no disk tier)",
    ),
    Setting(
        "disk_bytes",
        "disk tier",
        'disk tier capacity, bytes or a size string such as `"1TiB"`',
        _size,
        default=REQUIRED,
        takes=_DISK | {PLANNER},
        engine_defaults={PLANNER: None},
        aliases={VLLM: ("disk_bytes_to_use",), VLLM_DISK_TIER: ("capacity_bytes",), PLANNER: ("--disk",)},
        needs="disk_root",
        flag="--disk-bytes",
    ),
    Setting(
        "disk_policy",
        "disk tier",
        "disk tier eviction policy (TensorRT-LLM: `priority`, as for its CPU tier)",
        _policy,
        default=D.POLICY,
        takes=_DISK,
        engine_defaults={TRTLLM: "priority"},
        aliases={VLLM_DISK_TIER: ("policy",)},
        needs="disk_root",
    ),
    Setting(
        "disk_admission",
        "disk tier",
        'disk tier admission: `"always"`, `"uses:K"` or `"priority:T"`; `"uses:2"` spares the device '
        "on workloads with little reuse",
        _admission,
        default=D.DISK_ADMISSION,
        takes=_DISK | {PLANNER},
        aliases={VLLM_DISK_TIER: ("admission",)},
        needs="disk_root",
        flag="--disk-admission",
    ),
    Setting(
        "disk_io_engine",
        "disk tier",
        "disk I/O engine: `auto` (io_uring when the kernel allows it and measures faster), `io_uring` or "
        "`pool` (positioned I/O on threads)",
        _io_engine,
        default=D.DISK_IO_ENGINE,
        takes=_DISK,
        aliases={VLLM_DISK_TIER: ("io_engine",)},
        needs="disk_root",
    ),
    Setting(
        "disk_queue_depth",
        "disk tier",
        "disk I/O requests in flight",
        _queue_depth,
        default=D.DISK_QUEUE_DEPTH,
        takes=_DISK,
        aliases={VLLM_DISK_TIER: ("queue_depth",)},
        needs="disk_root",
    ),
    # -- the remote tier --
    Setting(
        "remote_url",
        "remote tier",
        "seed nodes of a Valkey / Redis (>= 7) Cluster, `redis://host:port[,host:port...]` (`rediss://` for "
        "TLS; an ACL user as `redis://user@host:port`, never a password); setting it turns the shared remote "
        "tier on",
        _remote_url,
        default=None,
        takes=_REMOTE,
        engine_defaults={VLLM_REMOTE_TIER: REQUIRED},
        shown_default="null (no remote tier)",
    ),
    Setting(
        "remote_prefix",
        "remote tier",
        "first part of every key in the store: one per deployment, so that deployments sharing a cluster "
        "never read each other's blocks",
        _key_prefix,
        default="kvtier",
        takes=_REMOTE,
        needs="remote_url",
    ),
    Setting(
        "remote_salt",
        "remote tier",
        "tenant or cache salt mixed into the namespace digest: blocks stored under one salt are never read "
        "under another",
        _string,
        default="",
        takes=_REMOTE,
        needs="remote_url",
    ),
    Setting(
        "remote_secret_file",
        "remote tier",
        "file holding the deployment secret: values are then checked by a keyed BLAKE3 MAC, so a client "
        "that can write to the store but lacks the secret cannot plant KV that replicas serve",
        _file,
        default=None,
        takes=_REMOTE,
        needs="remote_url",
        shown_default="null (a plain XXH3-128 check)",
    ),
    Setting(
        "remote_password_env",
        "remote tier",
        "environment variable holding the store's password (AUTH / ACL); never logged",
        _string,
        default="KVTIER_REMOTE_PASSWORD",
        takes=_REMOTE,
        needs="remote_url",
    ),
    Setting(
        "remote_password_file",
        "remote tier",
        "file whose first line is the store's password, instead of `remote_password_env`",
        _file,
        default=None,
        takes=_REMOTE,
        needs="remote_url",
    ),
    Setting(
        "remote_tls_ca_file",
        "remote tier",
        "CA certificate file for a `rediss://` cluster",
        _file,
        default=None,
        takes=_REMOTE,
        needs="remote_url",
    ),
    Setting(
        "remote_deadline_s",
        "remote tier",
        "seconds one operation on the store may take; a later answer is a miss (reads) or a dropped "
        "write, and counts toward the circuit breaker",
        _positive_seconds,
        default=1.0,
        takes=_REMOTE,
        needs="remote_url",
    ),
    Setting(
        "remote_ttl_s",
        "remote tier",
        "seconds a stored block lives (`SET ... EX`); null leaves eviction to the server's "
        "`maxmemory-policy allkeys-lru`",
        _positive_seconds,
        default=None,
        takes=_REMOTE,
        needs="remote_url",
    ),
    Setting(
        "remote_admission",
        "remote tier",
        'remote tier admission: `"uses:K"` (a block offered K times: stored, then reused from the CPU '
        'tier), `"always"` or `"priority:T"`; the shared store receives only blocks with reuse evidence '
        '(a `KvtierRemoteTier` entry defaults to `"always"`: vLLM offers it a chunk only when the chunk '
        "enters vLLM's CPU tier)",
        _admission,
        default="uses:2",
        engine_defaults={VLLM_REMOTE_TIER: "always"},
        takes=_REMOTE,
        needs="remote_url",
    ),
    Setting(
        "remote_max_write_bytes",
        "remote tier",
        "bytes of write-throughs in flight to the store at most; beyond them writes are dropped and "
        "counted (`writes_dropped_backlog`), never queued",
        _size,
        default=1 << 30,
        takes=_REMOTE,
        needs="remote_url",
    ),
    # -- the data path --
    Setting(
        "cost_model",
        "data path",
        '`"always_load"` or null (load every hit) or `{"prefill_tokens_per_s": N, '
        '"disk_read_bytes_per_s": B}` (`B` optional): load a hit only when moving it is estimated faster '
        "than recomputing it; measured transfers refine the rates, and a tier turned away is probed now and then",
        _cost_model,
        default=None,
        shown_default='`"always_load"`',
    ),
    Setting(
        "cpu_max_promotions_in_flight",
        "data path",
        "loads from the CPU tier in flight at most; a hit beyond them is recomputed, never queued",
        _in_flight,
        default=DEFAULT_MAX_IN_FLIGHT["cpu"],
        takes=frozenset({API, TRTLLM}),
    ),
    Setting(
        "disk_max_promotions_in_flight",
        "data path",
        "promotions from the disk tier in flight at most; a disk hit beyond them is recomputed, never "
        "queued (counted as `backpressure`). vLLM counts chunks (default 1024), TensorRT-LLM and the API "
        "count requests' loads (default 16)",
        _in_flight,
        default=DEFAULT_MAX_IN_FLIGHT["disk"],
        # Far above what one request's prompt usually promotes, so only a burst from many
        # requests meets it.
        engine_defaults={VLLM: 1024},
        needs="disk_root",
    ),
    Setting(
        "disk_max_write_backlog",
        "data path",
        "write-through blocks waiting for the disk at most (each pins its CPU slot until written); beyond "
        "them write-throughs are dropped and counted (`writes_dropped_backlog`), never queued",
        _in_flight,
        default=D.DISK_MAX_WRITE_BACKLOG,
        # vLLM's tiering spec writes its secondary tiers itself: no kvtier stager to bound.
        takes=frozenset({API, VLLM, TRTLLM}),
        needs="disk_root",
    ),
    # -- the guard --
    Setting(
        "cpu_slo_guard",
        "guard",
        _guard_meaning("CPU", "the CPU tier's loads"),
        _guard,
        default=None,
        takes=frozenset({API, TRTLLM}),
    ),
    Setting(
        "disk_slo_guard",
        "guard",
        _guard_meaning("disk", "disk promotions"),
        _guard,
        default=None,
        needs="disk_root",
    ),
    Setting(
        "slo_guard",
        "guard",
        "null (off) or a dict with `ttft_p99_ms` and/or `itl_p99_ms` and optionally `window_s`, `recover_s` "
        "and `min_samples` (defaults as above): when the p99 of requests' time to first token or inter-token "
        "latency over `window_s` exceeds its budget, the newest tier in service (disk, then CPU) is "
        "bypassed for `recover_s`, then re-probed; a tier that trips again soon after returning stays out "
        "twice as long (up to 8 `recover_s`). vLLM: needs `KvtierConnector`, which measures the requests",
        _request_rule,
        default=None,
        takes=frozenset({API, VLLM}),
    ),
    # -- engine-specific --
    Setting(
        "disk_on_reset",
        "engine",
        'what a cache reset does to the disk tier: `"clear"` (every block is forgotten for good, as '
        'after a weight update) or `"keep"` (the blocks stay valid: sleep without new weights)',
        _choice("clear", "keep"),
        default="clear",
        takes=frozenset({VLLM}),
        needs="disk_root",
    ),
    Setting(
        "guard",
        "engine",
        '`"checksum"`: a disk block whose checksum does not match is a miss (the only value: serving '
        "unverified KV is never an option)",
        _choice("checksum"),
        default="checksum",
        takes=frozenset({VLLM}),
    ),
    Setting(
        "locality",
        "engine",
        "`LOCAL` or `REMOTE`: vLLM's locality of the tier",
        _choice("LOCAL", "REMOTE"),
        default="LOCAL",
        takes=frozenset({VLLM_DISK_TIER, VLLM_REMOTE_TIER}),
        engine_defaults={VLLM_REMOTE_TIER: "REMOTE"},
    ),
    Setting(
        "min_offload_priority",
        "engine",
        "blocks whose retention priority (0..100) is below this are never offloaded, nor any later "
        "block of the same request (TensorRT-LLM's `secondary_offload_min_priority` default)",
        _priority,
        default=30,
        takes=frozenset({TRTLLM}),
    ),
    Setting(
        "io_engine",
        "engine",
        "device <-> host copies: `auto` (CUDA for CUDA tensors), `cpu` or `cuda`",
        _choice("auto", "cpu", "cuda"),
        default="auto",
        takes=frozenset({TRTLLM}),
    ),
    Setting(
        "namespace",
        "engine",
        "string mixed into every block key, e.g. the model name",
        _optional_str,
        default=None,
        takes=frozenset({TRTLLM}),
        shown_default="the model name",
    ),
    Setting(
        "load_timeout_s",
        "engine",
        "seconds `wait_for_layer_load` waits for a load before failing (an async load: seconds from its "
        "start until `get_finished` fails it)",
        _seconds,
        default=60.0,
        takes=frozenset({TRTLLM}),
    ),
    Setting(
        "remote_probe_wait_s",
        "engine",
        "seconds the scheduler waits, once per request, for the remote tier to say which of the "
        "request's blocks it holds (TensorRT-LLM asks for a request's matches once and cannot be asked "
        "again); an answer later than this makes those blocks misses for this request and serves the next",
        _seconds,
        default=0.005,
        takes=frozenset({TRTLLM}),
        needs="remote_url",
    ),
    Setting(
        "async_loads",
        "engine",
        "`off`: every load is waited for per layer in the forward pass; `staged`: a request whose load "
        "reads from the disk or remote tier is answered `load_kv_async` and kept out of the batch until "
        "its blocks are staged in CPU slots, then copied in the step it comes back in (a staging that "
        "falls short stops the executor, since TensorRT-LLM cannot take a promise back)",
        _choice("off", "staged"),
        default="off",
        takes=frozenset({TRTLLM}),
    ),
    Setting(
        "block_identity",
        "engine",
        "`auto` (the engine's own block hash when TensorRT-LLM's hasher imports, else kvtier's chain), "
        "`engine` or `kvtier`",
        _choice("auto", "engine", "kvtier"),
        default="auto",
        takes=frozenset({TRTLLM}),
    ),
)

BY_KEY: dict[str, Setting] = {s.key: s for s in TREE}


def settings_for(entry: str) -> tuple[Setting, ...]:
    """The options `entry` takes, in the tree's order."""
    if entry not in ENTRY_POINTS:
        raise ValueError(f"unknown entry point {entry!r}; expected one of {', '.join(ENTRY_POINTS)}")
    return tuple(s for s in TREE if entry in s.takes)


def names_for(entry: str) -> dict[str, str]:
    """Every name `entry` takes (keys and aliases) -> its key."""
    return {name: s.key for s in settings_for(entry) for name in s.names_for(entry)}


def read_values(raw: Mapping[Any, Any], entry: str, reader: OptionReader) -> dict[str, Any]:
    """Validate `raw` (names as `entry` takes them) and return every option of `entry` by key,
    defaults filled in. An option whose ``needs`` is not given is None. Errors name the name the
    user wrote: an unknown name, an alias given beside its key, an option whose ``needs`` is
    missing, a required option missing, a bad value. A null where the default is null (off) is
    as if the option were not given.

    Preconditions: `raw` holds only names of this tree (an engine's own keys, which the engine
    reads itself, are taken out by the caller)."""
    names = names_for(entry)
    unknown = sorted((k for k in raw if k not in names), key=str)
    if unknown:
        raise reader.error(unknown[0], "unknown key; known keys: " + ", ".join(sorted(names)))
    given: dict[str, str] = {}  # key -> the name it was given under
    for name in raw:
        key = names[name]
        if raw[name] is None and BY_KEY[key].default_for(entry) is None:
            continue  # null where null is the default (off): as if not given
        if key in given:
            raise reader.error(name, f"set either {given[key]} or {name}, not both (they are the same option)")
        given[key] = name
    out: dict[str, Any] = {}
    for s in settings_for(entry):
        name = given.get(s.key)
        if s.needs is not None and s.needs not in given:
            if name is not None:
                raise reader.error(name, f"needs {s.needs} (the {BY_KEY[s.needs].section} is off without it)")
            out[s.key] = None
            continue
        if name is None:
            default = s.default_for(entry)
            if default is REQUIRED:
                needs_given = s.needs is not None and BY_KEY[s.needs].default_for(entry) is not REQUIRED
                what = f"required with {s.needs}" if needs_given else "required"
                also = s.aliases.get(entry, ())
                taken = f" (also taken as {', '.join(also)})" if also else ""
                raise reader.error(s.key, f"{what}{taken}: {s.meaning.replace('`', '')}")
            out[s.key] = default
        else:
            out[s.key] = s.check(reader, name, raw[name])
    return out


def written_names(raw: Mapping[Any, Any], entry: str) -> dict[str, str]:
    """Each option given in `raw` -> the name it was given under (its key or an alias), so that
    an error found later (by the tier, at start-up) names what the user wrote."""
    names = names_for(entry)
    return {names[n]: n for n in raw if n in names}


# ---- the typed tree -----------------------------------------------------------------------------


@dataclass(frozen=True)
class CpuTierSettings:
    bytes: int
    policy: str = D.POLICY
    admission: str = D.CPU_ADMISSION


@dataclass(frozen=True)
class DiskTierSettings:
    root: str
    bytes: int
    policy: str = D.POLICY
    admission: str = D.DISK_ADMISSION
    io_engine: str = D.DISK_IO_ENGINE
    queue_depth: int = D.DISK_QUEUE_DEPTH


@dataclass(frozen=True)
class RemoteTierSettings:
    url: str
    prefix: str = "kvtier"
    salt: str = ""
    secret_file: str | None = None
    password_env: str = "KVTIER_REMOTE_PASSWORD"
    password_file: str | None = None
    tls_ca_file: str | None = None
    deadline_s: float = 1.0
    ttl_s: float | None = None
    admission: str = "uses:2"
    max_write_bytes: int = 1 << 30


@dataclass(frozen=True)
class DataPathSettings:
    cost: CostRates | None = None
    #: tier -> promotions in flight at most (the tiers that are on).
    max_promotions_in_flight: dict[str, int] = field(default_factory=dict)
    #: tier -> its SLO guard (the tiers that have one).
    guards: dict[str, GuardRule] = field(default_factory=dict)
    #: The request-level rule (TTFT / ITL budgets), or None.
    request_rule: RequestRule | None = None
    #: Write-through blocks waiting for the disk tier at most.
    max_disk_write_backlog: int = D.DISK_MAX_WRITE_BACKLOG


@dataclass(frozen=True)
class Settings:
    """kvtier's options as one typed tree (``read_settings``)."""

    cpu: CpuTierSettings
    disk: DiskTierSettings | None = None
    remote: RemoteTierSettings | None = None
    data_path: DataPathSettings = field(default_factory=DataPathSettings)
    #: The engine's own options, by key (``section == "engine"``).
    engine: dict[str, Any] = field(default_factory=dict)


def settings_from_values(values: Mapping[str, Any]) -> Settings:
    """The typed tree of `read_values`' output."""
    disk = None
    if values.get("disk_root") is not None:
        disk = DiskTierSettings(
            root=values["disk_root"],
            bytes=values["disk_bytes"],
            policy=values["disk_policy"],
            admission=values["disk_admission"],
            io_engine=values["disk_io_engine"],
            queue_depth=values["disk_queue_depth"],
        )
    remote = remote_settings(values)
    tiers = ("cpu", "disk") if disk is not None else ("cpu",)
    limits = {t: values[f"{t}_max_promotions_in_flight"] for t in tiers if values.get(f"{t}_max_promotions_in_flight")}
    guards = {t: values[f"{t}_slo_guard"] for t in tiers if values.get(f"{t}_slo_guard") is not None}
    return Settings(
        cpu=CpuTierSettings(values["cpu_bytes"], values["cpu_policy"], values["cpu_admission"]),
        disk=disk,
        remote=remote,
        data_path=DataPathSettings(
            values.get("cost_model"),
            limits,
            guards,
            values.get("slo_guard"),
            # Not an option of vLLM's tiering spec, which writes its secondary tiers itself.
            values.get("disk_max_write_backlog") or D.DISK_MAX_WRITE_BACKLOG,
        ),
        engine={k: v for k, v in values.items() if BY_KEY[k].section == "engine"},
    )


def remote_settings(values: Mapping[str, Any]) -> RemoteTierSettings | None:
    """The remote tier's part of `read_values`' output, or None when it is off."""
    if values.get("remote_url") is None:
        return None
    return RemoteTierSettings(
        url=values["remote_url"],
        prefix=values["remote_prefix"],
        salt=values["remote_salt"],
        secret_file=values["remote_secret_file"],
        password_env=values["remote_password_env"],
        password_file=values["remote_password_file"],
        tls_ca_file=values["remote_tls_ca_file"],
        deadline_s=values["remote_deadline_s"],
        ttl_s=values["remote_ttl_s"],
        admission=values["remote_admission"],
        max_write_bytes=values["remote_max_write_bytes"],
    )


#: The reader of the Python API's mapping.
API_READER = OptionReader("kvtier settings")


def read_settings(raw: Mapping[str, Any]) -> Settings:
    """The Python API's entry: validate a mapping of the tree's keys (``settings_for("api")``)
    and return the typed tree; every error names its key."""
    if not isinstance(raw, Mapping):
        raise API_READER.error("settings", f"expected a mapping of option -> value, got {show(raw)}")
    return settings_from_values(read_values(raw, API, API_READER))


# ---- the docs' tables ---------------------------------------------------------------------------


def _shown(value: Any) -> str:
    if value is REQUIRED:
        return "required"
    if value is None:
        return "null (off)"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value}`"


def markdown_table(entry: str) -> str:
    """The options table of `entry`, as the docs show it."""
    rows = ["| key | section | default | meaning |", "|---|---|---|---|"]
    for s in settings_for(entry):
        names = s.names_for(entry)
        if entry == PLANNER:
            names = (s.flag or s.key, *s.aliases.get(PLANNER, ()))
        name = f"`{names[0]}`" + (f" (also `{'`, `'.join(names[1:])}`)" if len(names) > 1 else "")
        default = s.default_for(entry)
        shown = s.shown_default if s.shown_default and default is s.default else _shown(default)
        # A planner flag stands alone; a prerequisite that the entry point requires anyway goes
        # without saying.
        needs = s.needs if entry != PLANNER and BY_KEY[s.needs or s.key].default_for(entry) is not REQUIRED else None
        if default is REQUIRED and needs:
            shown = f"required with `{needs}`"
        elif needs:
            shown += f"; needs `{needs}`"
        rows.append(f"| {name} | {s.section} | {shown} | {s.meaning} |")
    return "\n".join(rows) + "\n"


#: The doc pages that hold a generated table, and the entry point of each table.
DOC_TABLES = {
    "docs/integrations/vllm.md": (VLLM, VLLM_DISK_TIER, VLLM_REMOTE_TIER),
    "docs/integrations/trtllm.md": (TRTLLM,),
    "docs/planner.md": (PLANNER,),
    "docs/configuration.md": (API,),
}


def begin_marker(entry: str) -> str:
    return f"<!-- options table: {entry} (generated by `python -m kvtier_rs.settings --write`) -->"


END_MARKER = "<!-- end of options table -->"


def with_tables(text: str, entries: tuple[str, ...]) -> str:
    """`text` with each entry's table (between its markers) regenerated."""
    for entry in entries:
        begin = begin_marker(entry)
        start = text.find(begin)
        if start < 0:
            raise ValueError(f"no {begin!r} marker")
        end = text.find(END_MARKER, start)
        if end < 0:
            raise ValueError(f"no {END_MARKER!r} after {begin!r}")
        text = text[: start + len(begin)] + "\n" + markdown_table(entry) + text[end:]
    return text


def main(argv: list[str] | None = None) -> int:
    """Print every entry point's table, or with ``--write`` regenerate them in the docs (run from
    the repository's root)."""
    from pathlib import Path

    args = sys.argv[1:] if argv is None else argv
    if args == ["--write"]:
        for page, entries in DOC_TABLES.items():
            path = Path(page)
            path.write_text(with_tables(path.read_text(encoding="utf-8"), entries), encoding="utf-8")
        return 0
    for entry in ENTRY_POINTS:
        print(f"## {entry}\n\n{markdown_table(entry)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
