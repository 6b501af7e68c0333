"""kvtier's metrics in vLLM's own Prometheus exposition, on a real vLLM engine (CPU platform).

vLLM registers only the names a spec declares (``build_metric_definitions``) and fills them from
the stats the manager returns each step; this checks the whole path: declared, registered,
exported by prometheus_client, and moving when kvtier serves a hit.
"""

from __future__ import annotations

import pytest
from support.vllm import engine as E

E.require_vllm()  # fail, never skip: CI installs vLLM

PREFIX = "vllm:kv_offload_kvtier_"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return E.module_env(tmp_path_factory, "vllm-metrics")


def scrape(prefix: str = PREFIX) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample named `prefix`... (kvtier's by default) of the process-wide registry, as
    vLLM's /metrics would serve it."""
    from prometheus_client import REGISTRY, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    text = generate_latest(REGISTRY).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith(prefix):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (model_name and engine are
    added by vLLM; other engines of this process may have left their own series)."""
    hits = [v for (n, lab), v in samples.items() if n == name and set(labels.items()) <= set(lab)]
    assert hits, f"{name}{labels} is not in vLLM's Prometheus output"
    return sum(hits)


def test_kvtier_metrics_are_exported_and_move_on_a_hit(env):
    from kvtier_rs.integrations.vllm import metrics as m

    llm = E.make_llm(env["model"], E.kvtier_config(cpu_bytes_to_use="1MiB"), disable_log_stats=False)
    try:
        ids = E.prompt(7, E.PROMPT_LEN)
        _, cached = E.generate(llm, ids)
        assert cached == 0
        before = scrape()
        # Every declared kvtier family is registered (counters show up once they have a series;
        # gauges and the per-tier index counters are emitted every step).
        names = {n for n, _ in before}
        for name in m.INDEX_GAUGES:
            assert PREFIX + name in names, name
        assert value(before, PREFIX + "capacity_blocks", tier="cpu") > 0
        assert value(before, PREFIX + "resident_blocks", tier="cpu") == 3  # 100 tokens: 3 chunks
        assert value(before, PREFIX + "stores_completed_total", tier="cpu") >= 3
        loads_before = sum(v for (n, _), v in before.items() if n == PREFIX + "loads_cpu_total")

        E.drop_gpu_cache(llm)
        _, cached = E.generate(llm, ids)
        assert cached == E.SERVED
        after = scrape()
        # kvtier served 3 chunks from its CPU tier: the counter moved by exactly that.
        assert value(after, PREFIX + "loads_cpu_total") - loads_before == 3
        assert value(after, PREFIX + "resident_blocks", tier="cpu") == 3
    finally:
        E.shutdown(llm)


def test_a_failed_cpu_tier_stores_nothing_and_vllm_counts_no_allocation_failure(env):
    """A CPU index that disabled itself (an internal error) keeps the engine serving: its
    prepare_store answers "nothing to store", so vLLM neither counts allocation failures nor
    offers the chunks again on every step (it did, for as long as the engine ran: None is
    vLLM's "cannot store now")."""
    import logging

    from kvtier_rs.integrations.vllm import metrics
    from kvtier_rs.integrations.vllm.spec import engine_state

    class Records(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.ERROR)
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    errors = Records()
    metrics.log.addHandler(errors)  # vLLM's loggers do not propagate to pytest's
    llm = E.make_llm(env["model"], E.kvtier_config(cpu_bytes_to_use=4 * E.BLOCK_BYTES), disable_log_stats=False)
    try:
        mgr = engine_state(E.engine_id(llm)).manager
        failures = "vllm:kv_offload_allocation_failure_total"
        before = sum(v for (n, _), v in scrape("vllm:kv_offload_").items() if n == failures)
        E.generate(llm, E.prompt(8, E.PROMPT_LEN))  # 3 of the tier's 4 chunks
        # The next store that evicts fails the index midway, for good (its `failed` gauge).
        mgr.cpu_index._inject_fault("store_panic")
        ids = E.prompt(9, E.PROMPT_LEN)
        for _ in range(2):
            tokens, cached = E.generate(llm, ids)
            assert len(tokens) == 8 and cached == 0
            E.drop_gpu_cache(llm)
        after = scrape("vllm:kv_offload_")
        assert mgr.cpu_index.failure is not None
        assert value(after, PREFIX + "failed", tier="cpu") == 1
        assert sum(v for (n, _), v in after.items() if n == failures) == before
        # The change is logged once, naming the tier.
        assert [x for x in errors.lines if "index disabled itself" in x] == [
            next(x for x in errors.lines if "the cpu tier's index disabled itself" in x)
        ], errors.lines
    finally:
        metrics.log.removeHandler(errors)
        E.shutdown(llm)
