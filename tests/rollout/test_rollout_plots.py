"""The rollout's figures, drawn from a small report of the rollout's shape: each is a PNG, and
no figure is left open (a rollout of many steps must not pile up matplotlib's figures)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # as the rollout draws them: files only, whatever $DISPLAY says
import matplotlib.pyplot as plt  # noqa: E402

from kvtier_rs.rollout.plots import FIGURES, write_plots  # noqa: E402


def _level(concurrency: int, scale: float) -> dict:
    return {
        "concurrency": concurrency,
        "per_request": [{"ttft_s": scale * i, "e2e_s": 2 * scale * i} for i in range(1, 6)]
        + [{"ttft_s": None, "e2e_s": None}],  # a failed request has no timings
        "ttft_s": {"p99": 5 * scale},
        "itl_s": {"p99": scale / 10},
        "hit_quality": {"tokens": {"gpu": 10.0, "cpu": 30.0, "recomputed": 60.0}, "prompt_tokens": 100},
    }


REPORT = {
    "budgets": {"ttft_p99_s": 0.5, "itl_p99_s": None},
    "concurrency": [1, 2, 4, 8],
    "steps": [
        {"name": "baseline", "levels": [_level(c, 0.01 * c) for c in (1, 2, 4, 8)]},
        {
            "name": "kvtier",
            "levels": [_level(c, 0.005 * c) for c in (1, 2, 4, 8)],
            "predicted": {"shares": {"gpu": 0.1, "cpu": 0.4, "disk": None, "recomputed": 0.5}},
        },
    ],
}


def test_every_figure_is_a_png_and_none_is_left_open(tmp_path):
    before = plt.get_fignums()
    names = write_plots(REPORT, tmp_path)
    assert names == list(FIGURES)
    for name in names:
        data = (tmp_path / name).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000, name
    assert plt.get_fignums() == before


def test_a_figure_that_fails_to_draw_is_closed_too(tmp_path):
    before = plt.get_fignums()
    broken = {**REPORT, "budgets": {}, "steps": [{"name": "x", "levels": [{"concurrency": 1}]}]}
    failed = []
    for name, draw in FIGURES.items():
        try:
            draw(broken, tmp_path / name)
        except KeyError:  # the report lacks what this figure reads
            failed.append(name)
        assert plt.get_fignums() == before, name
    assert "latency_cdf.png" in failed and "p99_vs_concurrency.png" in failed  # inside their figures
