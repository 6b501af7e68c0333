"""PNG figures for `--plot DIR`: miss-ratio curves and reuse histograms (matplotlib, Agg)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvtier_rs.planner.errors import PlanError
from kvtier_rs.planner.files import replaced_atomically


def check_plot_dir(out_dir: str | Path) -> None:
    """Refuse, before any replay, a --plot DIR the figures could not be written into (or a
    missing matplotlib); creates nothing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlanError("--plot needs matplotlib: pip install 'kvtier[plan]'") from None
    d = Path(out_dir)
    existing = d
    while not existing.exists() and existing != existing.parent:
        if existing.is_symlink():  # a dangling link: mkdir would fail on it
            raise PlanError(f"--plot: cannot create {d}: {existing} is a broken symbolic link")
        existing = existing.parent
    if not existing.is_dir():
        raise PlanError(f"--plot: cannot create {d}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PlanError(f"--plot: cannot write into {existing}: permission denied")


def write_plots(rep: dict[str, Any], out_dir: str | Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlanError("--plot needs matplotlib: pip install 'kvtier[plan]'") from None
    d = Path(out_dir)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PlanError(f"--plot: cannot create {d}: {e.strerror}") from None
    written = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    policies = list(dict.fromkeys(r["policy"] for r in rep["results"]))
    for p in policies:
        rows = sorted((r for r in rep["results"] if r["policy"] == p), key=lambda r: r["capacity_blocks"])
        xs = [r["capacity_blocks"] for r in rows if r["hit_rate"] is not None]
        ys = [1 - r["hit_rate"] for r in rows if r["hit_rate"] is not None]
        style = "k--" if p == "opt" else "-o"
        label = "opt (Belady: bounds whole-replay block hits, not these rates)" if p == "opt" else p
        ax.plot(xs, ys, style, label=label, markersize=4)
    ceil = rep["ceiling"]["hit_rate"]
    if ceil is not None:
        ax.axhline(1 - ceil, color="grey", linestyle=":", label="ceiling (infinite cache)")
    ax.set_xscale("log")
    ax.set_xlabel(f"capacity (blocks of {rep['trace']['block_size']} tokens)")
    ax.set_ylabel("miss ratio (token-weighted)")
    ax.set_title("Miss-ratio curves")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = d / "miss_ratio_curves.png"
    _save(plt, fig, path)
    written.append(str(path))

    reuse = rep["questions"]["reuse"]
    for key, name, label in (
        ("time_histogram_s", "reuse_time_histogram.png", "reuse time (s)"),
        (
            "distance_histogram_blocks",
            "reuse_distance_histogram.png",
            "reuse distance (distinct blocks in between)",
        ),
    ):
        h = reuse.get(key)
        if not h:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        edges, counts = h["edges"], h["counts"]
        ax.bar(
            edges[:-1],
            counts,
            width=[b - a for a, b in zip(edges[:-1], edges[1:], strict=True)],
            align="edge",
        )
        ax.set_xscale("symlog", linthresh=max(edges[1], 1e-3))
        ax.set_xlabel(label)
        ax.set_ylabel("block reuses")
        ax.set_title(label.split(" (")[0].capitalize() + " histogram")
        fig.tight_layout()
        path = d / name
        _save(plt, fig, path)
        written.append(str(path))
    return written


def _save(plt: Any, fig: Any, path: Path) -> None:
    """Write one figure whole or not at all (`replaced_atomically`), or refuse naming --plot and
    the file. check_plot_dir vets DIR before the replay, not the figures' own paths: one taken by
    a directory, or a file that cannot be replaced, made savefig raise a traceback after the
    whole replay."""
    try:
        with replaced_atomically(path) as f:
            fig.savefig(f, dpi=120, format="png")
    except OSError as e:
        raise PlanError(f"--plot: cannot write {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
