"""The report's reuse percentiles and histograms are computed in plain Python (numpy costs the
command more to import than the computation); they must agree with numpy's definitions."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier_rs.planner.plan import _histogram, _percentiles

values = st.lists(
    st.one_of(
        st.floats(min_value=0, max_value=1e7, allow_nan=False),
        st.integers(min_value=0, max_value=50).map(float),
        st.just(0.0),
    ),
    min_size=1,
    max_size=300,
)


def numpy_histogram(values: list[float], log: bool) -> tuple[list[float], list[int]]:
    a = np.asarray(values, dtype=float)
    if log:
        lo = max(a[a > 0].min(), 1e-3) if (a > 0).any() else 1e-3
        hi = max(a.max(), lo * 10)
        edges = np.logspace(math.log10(lo), math.log10(hi), 25)
        edges[0], edges[-1] = 0.0, hi  # the largest value is always in the last bin
    else:
        edges = np.linspace(0, a.max() or 1, 25)
    counts, edges = np.histogram(a, bins=edges)
    return [float(e) for e in edges], [int(c) for c in counts]


@settings(max_examples=200, deadline=None)
@given(values)
def test_percentiles_match_numpy(vs: list[float]) -> None:
    got = _percentiles(vs)
    assert got is not None
    a = np.asarray(vs, dtype=float)
    want = dict(zip(["p50", "p90", "p99"], np.percentile(a, [50, 90, 99]), strict=True))
    assert got["count"] == len(vs)
    assert math.isclose(got["mean"], float(a.mean()), rel_tol=1e-12, abs_tol=1e-12)
    for k, w in want.items():
        assert math.isclose(got[k], float(w), rel_tol=1e-12, abs_tol=1e-12), k


@settings(max_examples=200, deadline=None)
@given(values, st.booleans())
def test_histogram_matches_numpy(vs: list[float], log: bool) -> None:
    got = _histogram(vs, log=log)
    assert got is not None
    edges, counts = numpy_histogram(vs, log)
    assert len(got["edges"]) == len(edges) == 25
    for g, w in zip(got["edges"], edges, strict=True):
        assert math.isclose(g, w, rel_tol=1e-12, abs_tol=0), (g, w)
    # Edges equal to the last ulp or so: a value exactly on an edge may fall either side, so
    # counts are compared where no value sits within that distance of an edge.
    near = any(math.isclose(v, e, rel_tol=1e-12) for v in vs for e in got["edges"][1:-1])
    if not near:
        assert got["counts"] == counts
    assert sum(got["counts"]) == sum(counts)


def test_the_largest_value_is_counted_when_its_logarithm_rounds_down() -> None:
    # 10 ** log10(1343651.0974815711) is an ulp below it: the value fell outside every bin.
    got = _histogram([1.0, 1343651.0974815711], log=True)
    assert got is not None and sum(got["counts"]) == 2 and got["edges"][-1] == 1343651.0974815711


def test_empty_is_none() -> None:
    assert _percentiles([]) is None
    assert _histogram([], log=True) is None
