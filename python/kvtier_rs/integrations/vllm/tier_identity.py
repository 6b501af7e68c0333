"""Where a vLLM engine's blocks live in the lower tiers, and what names them: the text that says
what a chunk's bytes mean (model, KV geometry, dtype, byte layout, parallel split), from which
the disk tier's directory and the remote tier's namespace are both derived. Shared by the
offloading spec's layers and the tiering spec's secondary tiers, so every engine of one
deployment, under either spec, agrees on both."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import canonical_format_id

from kvtier_rs.tiers.disk import DIR_FORMAT, earlier_format

log = logging.getLogger("vllm." + __name__)  # under vLLM's logging configuration


def log_earlier_formats(path: Path) -> None:
    """Say so when the root holds directories of an earlier format: they are left alone (never
    read, never cleared: they may be another engine's), and their space is the user's."""
    try:
        earlier = sorted(p.name for p in path.parent.iterdir() if p.is_dir() and earlier_format(p.name))
    except OSError:
        return
    if earlier:
        log.warning(
            "kvtier: ignoring disk-tier director%s %s under %s: written by an earlier kvtier format, never "
            "read by this one; remove %s to free the space",
            "y" if len(earlier) == 1 else "ies",
            ", ".join(earlier),
            path.parent,
            "it" if len(earlier) == 1 else "them",
        )


def layout_identity(config: Any, chunk_bytes: int) -> str:
    """What a chunk's bytes mean, as stable text: the model, KV geometry, dtype and byte layout.

    A chunk's bytes depend on how the KV cache is split over workers (a primary row holds each
    worker's share in rank order: TP splits heads, PP layers, PCP/DCP tokens) and on the host
    layout (vLLM's canonical one or each worker's own pages), even where the row size is the
    same, so all of these are in it. Nothing per-process is: every engine of one deployment
    computes the same text (the disk tier's directory and the remote tier's namespace)."""
    par = config.parallel
    ident = {
        "model": config.model.name,
        "dtype": str(config.model.dtype),
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "groups": [[g.tokens_per_block, list(g.layer_names)] for g in config.groups],
        "chunk_bytes": chunk_bytes,
        "layout": config.kv_cache_layout,
        "parallel": {"tp": par.tp_size, "pp": par.pp_size, "pcp": par.pcp_size, "dcp": par.dcp_size},
        # One copy per row (replicated MLA) vs one per worker.
        "replicated_layout": bool(config.replicated_layout),
        # vLLM's id of its canonical byte format (version and layout family), or None.
        "canonical_layout": canonical_format_id(config.kv_cache_layout) if config.canonical_layout else None,
    }
    return json.dumps(ident, sort_keys=True)


def tier_dir(root: str, config: Any, chunk_bytes: int) -> Path:
    """A directory per model, KV geometry and byte layout (``layout_identity``), stable across
    restarts: an engine reopening the same root with the same model and layout finds its blocks,
    and any other never reads them. Directories named before the digest covered all of these
    (which may hold blocks of any split) match no digest of this scheme: such a directory is not
    found, never read."""
    par = config.parallel
    digest = hashlib.sha256(layout_identity(config, chunk_bytes).encode()).hexdigest()[:12]
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", str(config.model.name).strip("/"))[-64:]
    # Data-parallel replicas are separate engines, each with its own CPU tier: each gets its
    # own directory (one tier per directory, locked), stable across restarts by replica index.
    if par.data_parallel_size > 1:
        name += f"_dp{par.data_parallel_index}"
    return Path(root) / f"{name}_{DIR_FORMAT}_{digest}"
