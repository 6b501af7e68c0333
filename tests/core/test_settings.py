"""The one configuration tree: every entry point reads its options through it, with the same
names, defaults and checks, and the docs' tables are generated from it."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from kvtier_rs import settings as S
from kvtier_rs._core import InvalidArgumentError
from kvtier_rs.cli import plan as plan_cli
from kvtier_rs.integrations.trtllm import config as trt
from kvtier_rs.integrations.trtllm.identity import SCHEMES
from kvtier_rs.integrations.vllm import options as vo
from kvtier_rs.orchestrator.guard import GuardRule

ROOT = Path(__file__).resolve().parents[2]

# The smallest valid configuration of each reader, with the disk tier on.
MINIMAL = {
    S.API: {"cpu_bytes": "1GiB", "disk_root": "/d", "disk_bytes": "2GiB", "remote_url": "redis://h:7000"},
    S.VLLM: {"cpu_bytes": "1GiB", "disk_root": "/d", "disk_bytes": "2GiB", "remote_url": "redis://h:7000"},
    S.VLLM_DISK_TIER: {"disk_root": "/d", "disk_bytes": "2GiB"},
    S.VLLM_REMOTE_TIER: {"remote_url": "redis://h:7000"},
    S.TRTLLM: {"cpu_bytes": "1GiB", "disk_root": "/d", "disk_bytes": "2GiB", "remote_url": "redis://h:7000"},
}


def read(entry: str, raw: dict) -> object:
    """Each entry point's own reader, as the engines call it."""
    if entry == S.API:
        return S.read_settings(raw)
    if entry == S.VLLM:
        return vo.parse_options(raw)
    if entry == S.VLLM_DISK_TIER:
        return vo.parse_disk_tier(raw)
    if entry == S.VLLM_REMOTE_TIER:
        return vo.parse_remote_tier(raw)
    return trt.parse_options(raw)


@pytest.mark.parametrize("page", sorted(S.DOC_TABLES))
def test_the_docs_tables_are_the_trees(page):
    text = (ROOT / page).read_text(encoding="utf-8")
    assert S.with_tables(text, S.DOC_TABLES[page]) == text, (
        f"{page} is out of step with kvtier_rs.settings: run `python -m kvtier_rs.settings --write`"
    )
    for entry in S.DOC_TABLES[page]:
        for s in S.settings_for(entry):
            assert f"`{s.flag if entry == S.PLANNER else s.key}`" in text


def test_the_adapters_key_lists_come_from_the_tree():
    assert set(trt.KEYS) == {s.key for s in S.settings_for(S.TRTLLM)}
    assert set(vo.KVTIER_KEYS) | vo.VLLM_KEYS >= set(S.names_for(S.VLLM))
    assert set(vo.KVTIER_KEYS) == set(S.names_for(S.VLLM)) - vo.VLLM_KEYS
    assert tuple(S.BY_KEY["block_identity"].check(trt.READER, "block_identity", x) for x in SCHEMES) == SCHEMES


def test_the_planner_flags_come_from_the_tree():
    p = argparse.ArgumentParser()
    plan_cli.register(p.add_subparsers())
    sub = p._subparsers._group_actions[0].choices["plan"]  # type: ignore[union-attr]
    flags = {opt: a for a in sub._actions for opt in a.option_strings}
    for s in S.settings_for(S.PLANNER):
        assert s.flag is not None
        for name in (s.flag, *s.aliases.get(S.PLANNER, ())):
            assert flags[name].dest == s.key
            assert flags[name].default == s.default_for(S.PLANNER)


@pytest.mark.parametrize("entry", sorted(MINIMAL))
def test_every_entry_point_takes_the_trees_defaults(entry):
    values = S.read_values(MINIMAL[entry], entry, S.API_READER)
    given = {S.names_for(entry)[name] for name in MINIMAL[entry]}
    for s in S.settings_for(entry):
        if s.key not in given:
            assert values[s.key] == s.default_for(entry), s.key
    # And each adapter's own options object carries them.
    got = read(entry, MINIMAL[entry])
    if entry == S.VLLM:
        assert (got.disk_admission, got.disk_policy, got.disk_queue_depth) == (
            S.BY_KEY["disk_admission"].default,
            S.BY_KEY["disk_policy"].default,
            S.BY_KEY["disk_queue_depth"].default,
        )
        assert got.disk_max_promotions_in_flight == 1024
    if entry in (S.API, S.VLLM):
        # The typed remote settings' own defaults are the tree's.
        assert got.remote == S.RemoteTierSettings(url="redis://h:7000")
        assert got.remote == S.remote_settings(values)
    if entry == S.TRTLLM:
        assert (got.disk_admission, got.disk_policy, got.cpu_policy) == (
            S.BY_KEY["disk_admission"].default,
            "priority",
            "priority",
        )
        assert got.max_promotions_in_flight == {"cpu": 64, "disk": 16}
    elif entry == S.VLLM_DISK_TIER:
        assert (got.disk.admission, got.disk.policy, got.disk.io_engine) == ("always", "lru", "auto")
    elif entry == S.VLLM_REMOTE_TIER:
        assert got.remote == S.RemoteTierSettings(url="redis://h:7000", admission="always")
        assert got.locality == "REMOTE"


def test_only_documented_defaults_differ_between_entry_points():
    differing = {(s.key, e) for s in S.TREE for e in s.engine_defaults}
    assert differing == {
        ("cpu_bytes", S.PLANNER),  # optional there: a tier is judged only when sized
        ("disk_bytes", S.PLANNER),
        ("cpu_policy", S.TRTLLM),  # TensorRT-LLM's retention priorities
        ("disk_policy", S.TRTLLM),
        ("disk_max_promotions_in_flight", S.VLLM),  # counted in chunks there
        ("disk_root", S.VLLM_DISK_TIER),  # the entry is the disk tier
        ("remote_url", S.VLLM_REMOTE_TIER),  # the entry is the remote tier
        ("remote_admission", S.VLLM_REMOTE_TIER),  # vLLM's cascade is the only offer
        ("locality", S.VLLM_REMOTE_TIER),  # a store on other machines
    }


def _bad_cases():
    for entry in sorted(MINIMAL):
        for s in S.settings_for(entry):
            for name in s.names_for(entry):
                yield entry, name


@pytest.mark.parametrize(("entry", "name"), list(_bad_cases()))
def test_every_keys_bad_value_is_refused_naming_it(entry, name):
    raw = dict(MINIMAL[entry])
    key = S.names_for(entry)[name]
    for other in S.BY_KEY[key].names_for(entry):
        raw.pop(other, None)
    raw[name] = [1]  # a list is no value of any option
    with pytest.raises(InvalidArgumentError, match=rf"\[{re.escape(repr(name))}\]: ") as e:
        read(entry, raw)
    assert e.value.arg == name


@pytest.mark.parametrize(
    ("entry", "old", "new", "value"),
    [
        (S.VLLM, "cpu_bytes_to_use", "cpu_bytes", "1GiB"),
        (S.VLLM, "eviction_policy", "cpu_policy", "arc"),
        (S.VLLM, "disk_bytes_to_use", "disk_bytes", "2GiB"),
        (S.VLLM_DISK_TIER, "root_dir", "disk_root", "/d"),
        (S.VLLM_DISK_TIER, "capacity_bytes", "disk_bytes", "2GiB"),
        (S.VLLM_DISK_TIER, "queue_depth", "disk_queue_depth", 8),
    ],
)
def test_an_alias_means_its_option_and_both_at_once_are_refused(entry, old, new, value):
    base = {k: v for k, v in MINIMAL[entry].items() if k != new}
    assert read(entry, {**base, old: value}) == read(entry, {**base, new: value})
    with pytest.raises(InvalidArgumentError, match="not both"):
        read(entry, {**base, old: value, new: value})


def test_required_and_prerequisite_options_name_the_key():
    with pytest.raises(InvalidArgumentError, match=r"\['cpu_bytes'\]: required"):
        S.read_settings({})
    with pytest.raises(InvalidArgumentError, match=r"\['disk_bytes'\]: required with disk_root"):
        S.read_settings({"cpu_bytes": "1GiB", "disk_root": "/d"})
    with pytest.raises(InvalidArgumentError, match=r"\['disk_slo_guard'\]: needs disk_root"):
        S.read_settings({"cpu_bytes": "1GiB", "disk_slo_guard": {"p99_ms": 5}})
    with pytest.raises(InvalidArgumentError, match=r"\['disk_bytes'\]: required"):
        vo.parse_disk_tier({"root_dir": "/d"})
    with pytest.raises(InvalidArgumentError, match=r"\['nope'\]: unknown key; known keys: cost_model, cpu_admission, "):
        S.read_settings({"cpu_bytes": "1GiB", "nope": 1})


def test_the_python_api_returns_the_typed_tree():
    s = S.read_settings(
        {
            "cpu_bytes": "1GiB",
            "cpu_policy": "arc",
            "disk_root": "/d",
            "disk_bytes": "2GiB",
            "disk_admission": "uses:2",
            "cost_model": {"prefill_tokens_per_s": 5000},
            "disk_slo_guard": {"p99_ms": 50, "recover_s": 5},
            "cpu_max_promotions_in_flight": 8,
        }
    )
    assert s.cpu == S.CpuTierSettings(1 << 30, "arc", "always")
    assert s.disk == S.DiskTierSettings("/d", 2 << 30, "lru", "uses:2", "auto", 16)
    assert s.data_path.cost == S.CostRates(5000.0)
    assert s.data_path.max_promotions_in_flight == {"cpu": 8, "disk": 16}
    assert s.data_path.guards == {"disk": GuardRule(p99_ms=50.0, recover_s=5.0)}
    assert s.engine == {}
    off = S.read_settings({"cpu_bytes": 4096, "disk_root": None, "cost_model": "always_load"})
    assert (off.disk, off.data_path.cost, off.data_path.max_promotions_in_flight) == (None, None, {"cpu": 64})


def test_the_disk_write_backlog_is_read_and_checked_by_name():
    base = {"cpu_bytes": "1GiB", "disk_root": "/d", "disk_bytes": "2GiB"}
    assert S.read_settings(base).data_path.max_disk_write_backlog == 1024
    assert S.read_settings({**base, "disk_max_write_backlog": 8}).data_path.max_disk_write_backlog == 8
    for bad in (0, "8", True, 1 << 21):
        with pytest.raises(InvalidArgumentError, match=r"\['disk_max_write_backlog'\]") as e:
            S.read_settings({**base, "disk_max_write_backlog": bad})
        assert e.value.arg == "disk_max_write_backlog"
    with pytest.raises(InvalidArgumentError, match=r"\['disk_max_write_backlog'\]: needs disk_root"):
        S.read_settings({"cpu_bytes": "1GiB", "disk_max_write_backlog": 8})
    with pytest.raises(InvalidArgumentError, match=r"\['disk_max_write_backlog'\]: unknown key"):
        vo.parse_disk_tier({"root_dir": "/d", "capacity_bytes": "1GiB", "disk_max_write_backlog": 8})


def test_the_cost_model_reads_alike_for_both_engines():
    rates = {"prefill_tokens_per_s": 8000, "disk_read_bytes_per_s": 2e9}
    v = vo.parse_options({**MINIMAL[S.VLLM], "cost_model": rates})
    t = trt.parse_options({**MINIMAL[S.TRTLLM], "cost_model": rates})
    assert (v.cost_model.prefill_tokens_per_s, v.cost_model.disk_read_bytes_per_s) == (8000.0, 2e9)
    assert (t.prefill_tokens_per_s, t.disk_read_bytes_per_s) == (8000.0, 2e9)
    for entry in (S.VLLM, S.TRTLLM):
        with pytest.raises(InvalidArgumentError, match=r"\['cost_model'\]: prefill_tokens_per_s is required"):
            read(entry, {**MINIMAL[entry], "cost_model": {"disk_read_bytes_per_s": 1e9}})
