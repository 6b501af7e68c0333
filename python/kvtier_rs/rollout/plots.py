"""The rollout's figures (matplotlib, no display): latency CDFs per step, p99 against
concurrency per step, and hit quality as stacked bars, measured beside predicted."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

SOURCES = ("gpu", "cpu", "disk", "recomputed")
COLORS = {"gpu": "#2ca02c", "cpu": "#1f77b4", "disk": "#ff7f0e", "recomputed": "#d62728"}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, on a machine without a display too
    import matplotlib.pyplot as plt

    return plt


@contextmanager
def _figure(path: Path, *, panels: int = 1, figsize: tuple[float, float] = (11, 4)) -> Iterator[Any]:
    """A figure of `panels` axes side by side (yielded as a list), saved to `path` and closed."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, panels, figsize=figsize, squeeze=False)
    try:
        yield list(axes[0])
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)


def _label(ax: Any, xlabel: str, ylabel: str, title: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()


def latency_cdf(report: dict[str, Any], path: Path) -> None:
    with _figure(path, panels=2) as axes:
        for ax, key, title in ((axes[0], "ttft_s", "TTFT"), (axes[1], "e2e_s", "end-to-end latency")):
            for step in report["steps"]:
                vals = np.sort([r[key] for lv in step["levels"] for r in lv["per_request"] if r[key] is not None])
                if vals.size:
                    ax.step(vals * 1e3, np.arange(1, vals.size + 1) / vals.size, where="post", label=step["name"])
            ax.set_xscale("log")
            _label(ax, f"{title} (ms)", "share of requests", f"{title} CDF per step (all levels)")


def p99_vs_concurrency(report: dict[str, Any], path: Path) -> None:
    with _figure(path, panels=2) as axes:
        _p99_panels(report, axes)


def _p99_panels(report: dict[str, Any], axes: list[Any]) -> None:
    budgets = report["budgets"]
    for ax, key, budget, title in (
        (axes[0], "ttft_s", budgets.get("ttft_p99_s"), "p99 TTFT"),
        (axes[1], "itl_s", budgets.get("itl_p99_s"), "p99 ITL"),
    ):
        for step in report["steps"]:
            pts = [(lv["concurrency"], lv[key]["p99"]) for lv in step["levels"] if lv["concurrency"] and lv[key]]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, np.asarray(ys) * 1e3, marker="o", label=step["name"])
        levels = report.get("concurrency") or []
        if levels:
            if max(levels) >= 4 * min(levels):
                ax.set_xscale("log", base=2)  # levels usually double: evenly spaced
            ax.set_xticks(levels, [str(c) for c in levels])  # the levels run, not fractions between them
        if budget is not None:
            ax.axhline(budget * 1e3, color="k", linestyle="--", label="budget")
        _label(ax, "concurrency (requests in flight)", f"{title} (ms)", f"{title} against concurrency")


def _pooled_shares(step: dict[str, Any]) -> dict[str, float]:
    tokens = {s: sum(lv["hit_quality"]["tokens"].get(s, 0.0) for lv in step["levels"]) for s in SOURCES}
    total = sum(lv["hit_quality"]["prompt_tokens"] for lv in step["levels"])
    return {s: (tokens[s] / total if total else 0.0) for s in SOURCES}


def hit_quality(report: dict[str, Any], path: Path) -> None:
    labels, bars = [], []
    for step in report["steps"]:
        labels.append(f"{step['name']}\nmeasured")
        bars.append(_pooled_shares(step))
        pred = (step.get("predicted") or {}).get("shares")
        if pred:
            labels.append(f"{step['name']}\nplanner")
            bars.append({s: pred.get(s) or 0.0 for s in SOURCES})
    with _figure(path, figsize=(max(5, 1.3 * len(bars) + 2), 4)) as (ax,):
        bottom = np.zeros(len(bars))
        for s in SOURCES:
            vals = np.asarray([b[s] for b in bars]) * 100
            ax.bar(labels, vals, bottom=bottom, label=s, color=COLORS[s])
            bottom += vals
        ax.set_ylabel("share of prompt tokens (%)")
        ax.set_title("hit quality: where prompt tokens came from")
        ax.legend(loc="upper left", bbox_to_anchor=(1, 1))


FIGURES = {
    "latency_cdf.png": latency_cdf,
    "p99_vs_concurrency.png": p99_vs_concurrency,
    "hit_quality.png": hit_quality,
}


def write_plots(report: dict[str, Any], directory: Path) -> list[str]:
    for name, draw in FIGURES.items():
        draw(report, directory / name)
    return list(FIGURES)
