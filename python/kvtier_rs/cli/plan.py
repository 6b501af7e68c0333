"""`kvtier plan`: decide from a request trace whether a CPU (and disk) tier is worth it."""

from __future__ import annotations

import argparse
import json
import sys

from kvtier_rs import settings
from kvtier_rs.planner.errors import PlanError

DESCRIPTION = """\
Replay a request trace through the same eviction policies the live tiers run, and answer:
which prefixes are shared, how soon they come back, whether loading a block beats recomputing
it, and which blocks should never be admitted; then recommend a size, policy and admission rule,
or say plainly that tiering will not pay.

Trace formats (--trace-format auto detects; .gz accepted):
  mooncake        JSONL {"timestamp" (ms), "input_length", "output_length", "hash_ids"}; 512-token
                  blocks unless "block_size" is in the records or --block-size is given; an
                  optional "session_id" (kvtier trace synth's chats) names a request's session
  bailian         Alibaba Bailian JSONL: as mooncake plus chat_id, parent_chat_id, turn, type;
                  timestamps in seconds; 16-token blocks
  kvcache-tester  kv-cache-tester JSON conversations {"block_size", "requests": [{"t", "in",
                  "out", "hash_ids"}]}; several conversations are merged in time order
  tokens          JSONL {"timestamp" (s), "token_ids": [...]}, hashed here into chained block keys
A malformed record is an error naming file, line and field; --skip-bad counts and skips it (the
first line too: auto-detection then goes by the first good line); no usable line is an error.

Replay semantics:
  - Requests are replayed in file order, so timestamps must not decrease: a record earlier than
    the one before it is a bad record (reuse times are differences of timestamps).
  - A request's hits are the longest prefix of its blocks that is cached: after the first miss,
    later blocks are misses even if cached. Hit rate is token-weighted (the last block counts
    only its real tokens; tokens not covered by any listed block always miss).
  - --warmup F (default 0.5): the first F of the requests warm the cache and are not measured.
  - Prefix-tree mode (default, --mode tree): a block is admitted only if its parent is cached;
    only leaves of the cached prefix tree are evicted; the blocks of the request being served are
    never evicted while it inserts; insertion stops at the first block that cannot be placed.
    Then the policy sees the request's chain tail first (insert for new blocks, touch for the
    rest), as the live index applies it. --mode flat drops the tree rules (any block may be
    admitted or evicted; hits must still be contiguous).
  - Policies: fifo (first in, first out: a hit never moves a block; blocks a request adds under a
    cached prefix join that prefix's place in the queue, so a chain leaves in the order it first
    arrived), lru, arc, priority (no priorities in traces: all blocks at the default level),
    s3fifo (scan-resistant), lhd (hit density: learns online, per use count and age, which
    blocks still earn hits, and evicts the least dense; the best online policy on multi-turn
    traces at small capacities), and opt (Belady: evict the leaf whose next use is farthest; do not
    admit a block whose next use is later than every evictable leaf's). opt bounds the block
    hits of every policy at the same capacity over the whole replay (all_block_hit_rate,
    warm-up included), not the measured rates: it does not weigh a partial block less, and
    may spend hits in the warm-up. The ceiling is an infinite cache; it bounds every rate.
    Admission "uses:K" admits a block on its K-th use (counted exactly).
  - A capacity whose cache never became full during the replay is flagged underfilled (^ in
    the table): it holds all it was offered, so its rate is an infinite cache's. One that filled
    only after 10% of the measured requests is flagged filled_late (*): its rate is partly that
    of a cache still warming up (no evictions yet) and overstates it; raise --warmup.
  - Multi-tier (--gpu/--cpu/--disk): tiers are inclusive and written through; each is its own
    cache with its own policy and admission; a block is served by the fastest tier holding it,
    counted as a GPU hit, a CPU promotion or a disk promotion; the usable prefix stops at the
    first block no tier holds. --remote adds a remote store behind them (LRU, as a Valkey or
    Redis server's allkeys-lru; loads cross --remote-latency-ms and --remote-gbps, then PCIe).
  - Replicas (--replicas K --split round-robin|session, with --cpu and --remote): the trace is
    split across K replicas, each with its own GPU/CPU/disk tiers; the tier replay runs with
    those alone and again with one remote store shared by all, and the report gives what the
    shared store saves: blocks and tokens no longer prefilled (misses and loads not worth it).
  - The knee (the recommended size): the smallest swept capacity whose hit rate is within a
    tenth of the infinite cache's. With none in the sweep (the curve still rising, or flat
    below the ceiling, at the largest capacity) no size is recommended and the report asks for
    larger --capacities; a knee at the smallest swept capacity may lie below it.
  - The verdict: with --cpu (and --disk) it judges the tiers asked for, from their multi-tier
    replay: they pay when their promotions worth loading save 2% of the tokens (over what the
    --gpu cache hits); the knee and admission advice follow as reasons. Without them it judges
    a CPU tier at the knee (less what the --gpu cache alone hits, if given).
  - Cost model: the live orchestrator's (kvtier_rs.orchestrator.cost.CostModel). Loading n
    blocks from a tier as one job costs a fixed latency per hop plus bytes / bandwidth per hop
    (disk: disk then PCIe;
    remote: remote then PCIe), recomputing them n x block_size / --prefill-tps; a request's hits
    from a tier count as gains only when their load beats recomputing them, and a CPU part not
    worth loading cuts the chain before its disk part, as the orchestrator decides. Sizing, the
    knee and the verdict go by these gains (without model bytes every hit counts). TTFT
    estimate = mean over requests of recomputed tokens / prefill rate + load time (linear
    prefill, no overlap of loads with compute).

Output: --format table (default) or json (schema "kvtier.plan/1": "results" holds one entry per
(policy, capacity): policy, capacity_blocks, hit_rate, hit_tokens, total_tokens, hit_blocks,
total_blocks, gain_rate, all_block_hit_rate, underfilled, filled_late, ...; "ceiling" has the
same fields; "bounds" says which rate opt and the ceiling bound; see docs/planner.md for the rest).
--plot DIR writes miss_ratio_curves.png, reuse_time_histogram.png, reuse_distance_histogram.png.
"""


def _capacities(text: str) -> list[int]:
    from kvtier_rs.planner.units import MAX_BLOCKS

    try:
        caps = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated block counts, got {text!r}") from None
    if not caps or any(not 0 < c <= MAX_BLOCKS for c in caps):
        raise argparse.ArgumentTypeError(f"capacities must be block counts between 1 and {MAX_BLOCKS} (10^12)")
    return caps


class _KeepFlag(argparse.Action):
    """Stores the value and the flag it came under (``<dest>_flag``), so that an error names
    the flag the user typed, alias or not."""

    def __call__(
        self, parser: argparse.ArgumentParser, ns: argparse.Namespace, value: object, flag: object = None
    ) -> None:
        setattr(ns, self.dest, value)
        setattr(ns, self.dest + "_flag", flag)


def _tree_option(group: argparse._ArgumentGroup, key: str, *, also: str = "") -> None:
    """An option of the one configuration tree, under its planner flag (and aliases), with the
    tree's meaning and default."""
    s = settings.BY_KEY[key]
    assert s.flag is not None, key
    default = s.default_for(settings.PLANNER)
    shown = "" if default is None else f" (default {default})"
    meaning = s.meaning.replace("`", "").replace("%", "%%")
    flags = (s.flag, *s.aliases.get(settings.PLANNER, ()))
    group.add_argument(*flags, dest=key, default=default, action=_KeepFlag, help=meaning + also + shown)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="plan tier sizes, policy and admission from a request trace",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("trace", help="trace file")
    g = p.add_argument_group("input")
    g.add_argument(
        "--trace-format", default="auto", choices=["auto", "mooncake", "bailian", "kvcache-tester", "tokens"]
    )
    g.add_argument("--block-size", type=int, help="tokens per block (default: per format)")
    g.add_argument("--skip-bad", action="store_true", help="count and skip malformed records instead of failing")
    g.add_argument("--limit", type=int, help="replay only the first N requests")
    m = p.add_argument_group("model bytes")
    m.add_argument("--model-config", help="Hugging Face config.json (layers, KV heads, head dim, dtype)")
    m.add_argument("--bytes-per-token", type=int, help="KV bytes per token, instead of --model-config")
    m.add_argument("--kv-dtype", help="KV cache dtype overriding the config's (e.g. fp8, bfloat16)")
    s = p.add_argument_group("sizes")
    s.add_argument("--gpu", help="GPU prefix-cache size: bytes with a unit (40GiB) or blocks (5000blocks)")
    _tree_option(s, "cpu_bytes", also=" or blocks (5000blocks); the CPU tier is judged only when given")
    _tree_option(s, "disk_bytes", also=" or blocks; the disk tier is judged only when given")
    s.add_argument(
        "--remote",
        help="shared remote store's size (a Valkey/Redis cluster's memory for KV; evicts by LRU, as "
        "allkeys-lru): bytes with a unit or blocks; staged through the CPU tier",
    )
    s.add_argument("--capacities", type=_capacities, help="capacities to sweep, in blocks (e.g. 1000,10000,50000)")
    r = p.add_argument_group("replay")
    r.add_argument(
        "--policies",
        default="fifo,lru,arc,lhd,opt",
        help="policies to sweep (default %(default)s; also priority, s3fifo: slower, see docs/planner.md)",
    )
    r.add_argument(
        "--warmup",
        type=float,
        default=0.5,
        help="share of requests used only to warm the cache (default 0.5)",
    )
    r.add_argument("--mode", choices=["tree", "flat"], default="tree")
    r.add_argument("--admission-thresholds", default="2,3", help="K values of uses:K to evaluate (default 2,3)")
    r.add_argument(
        "--tier-policy", help="policy of the tiers in the multi-tier replay (default: the policy the plan recommends)"
    )
    _tree_option(r, "cpu_admission", also=", in the multi-tier replay")
    _tree_option(r, "disk_admission", also=", in the multi-tier replay")
    r.add_argument("--threads", type=int, default=0, help="replay threads (default: all cores)")
    r.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="split the trace across K replicas, each with its own --gpu/--cpu/--disk tiers, and compare "
        "them alone against them plus the shared --remote tier (default 1: no split)",
    )
    r.add_argument(
        "--split",
        default="round-robin",
        help="how requests go to replicas: round-robin (request i to replica i mod K) or session (a "
        "conversation's requests to one replica; needs a trace with conversation ids) (default round-robin)",
    )
    c = p.add_argument_group("cost model")
    c.add_argument("--pcie-gbps", type=float, default=25.0, help="CPU->GPU bandwidth, GB/s (default 25)")
    c.add_argument("--disk-gbps", type=float, default=6.0, help="disk->CPU bandwidth, GB/s (default 6)")
    c.add_argument(
        "--remote-gbps", type=float, default=1.25, help="remote store->CPU bandwidth, GB/s (default 1.25: 10 Gb/s)"
    )
    c.add_argument(
        "--remote-latency-ms",
        type=float,
        default=0.5,
        help="fixed time of one load from the remote store (a round trip), ms (default 0.5)",
    )
    c.add_argument("--prefill-tps", type=float, default=10_000.0, help="prefill throughput, tokens/s (default 10000)")
    o = p.add_argument_group("output")
    o.add_argument("--format", choices=["table", "json"], default="table")
    o.add_argument("--plot", metavar="DIR", help="write PNG figures into DIR")
    o.add_argument("--top", type=int, default=10, help="shared prefixes to list (default 10)")
    o.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar (default: on a terminal)",
    )
    p.set_defaults(func=run)


def _thresholds(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise PlanError(f"--admission-thresholds: expected integers like 2,3, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    from kvtier_rs.planner.plan import PlanOptions, run_plan
    from kvtier_rs.planner.plots import check_plot_dir
    from kvtier_rs.planner.report import render_table
    from kvtier_rs.planner.units import parse_size

    if args.plot:
        check_plot_dir(args.plot)  # before the replay, with the other options (run_plan checks those)
    thresholds = _thresholds(args.admission_thresholds)
    opts = PlanOptions(
        trace=args.trace,
        trace_format=args.trace_format,
        block_size=args.block_size,
        skip_bad=args.skip_bad,
        limit=args.limit,
        bytes_per_token=args.bytes_per_token,
        model_config=args.model_config,
        kv_dtype=args.kv_dtype,
        gpu=parse_size(args.gpu, "--gpu") if args.gpu else None,
        cpu=parse_size(args.cpu_bytes, getattr(args, "cpu_bytes_flag", "--cpu-bytes")) if args.cpu_bytes else None,
        disk=parse_size(args.disk_bytes, getattr(args, "disk_bytes_flag", "--disk-bytes")) if args.disk_bytes else None,
        remote=parse_size(args.remote, "--remote") if args.remote else None,
        capacities=args.capacities,
        policies=tuple(x.strip() for x in args.policies.split(",") if x.strip()),
        warmup=args.warmup,
        mode=args.mode,
        admission_thresholds=thresholds,
        cpu_admission=args.cpu_admission,
        disk_admission=args.disk_admission,
        tier_policy=args.tier_policy,
        pcie_gbps=args.pcie_gbps,
        disk_gbps=args.disk_gbps,
        remote_gbps=args.remote_gbps,
        remote_latency_ms=args.remote_latency_ms,
        replicas=args.replicas,
        split=args.split,
        prefill_tps=args.prefill_tps,
        top=args.top,
        threads=args.threads,
        progress=args.progress,
    )
    report = run_plan(opts)
    if args.plot:
        from kvtier_rs.planner.plots import write_plots

        report["plots"] = write_plots(report, args.plot)
    if args.format == "json":
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(render_table(report))
        if args.plot:
            print(f"\nfigures: {', '.join(report['plots'])}")
    return 0
