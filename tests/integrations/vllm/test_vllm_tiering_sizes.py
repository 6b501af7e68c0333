"""KvtierTieringOffloadingSpec reads cpu_bytes_to_use as KvtierOffloadingSpec does: bytes or a
size string such as "32GiB", a bad value named by its key when the spec is built. Before, vLLM's
CPU spec took int(cpu_bytes_to_use), so "32GiB" failed an engine a minute into start-up with
"invalid literal for int()". No engine here: the spec is built from an OffloadingConfig."""

from __future__ import annotations

import os

import pytest
from support.vllm import engine as E

E.require_vllm()

from kvtier_rs import InvalidArgumentError  # noqa: E402

ROW = 32768  # worker_kv_bytes_per_block below, one block per chunk: a page-aligned chunk row
SPEC = {"spec_name": "KvtierTieringOffloadingSpec", "spec_module_path": "kvtier_rs.integrations.vllm"}


_offloading_config = E.spec_config


def _spec(extra):
    from kvtier_rs.integrations.vllm.secondary import KvtierTieringOffloadingSpec

    return KvtierTieringOffloadingSpec(_offloading_config(extra))


@pytest.mark.parametrize("value", ["1MiB", "1 MiB", "1048576", 1 << 20, "1.048576MB"])
def test_cpu_bytes_to_use_takes_sizes_and_bytes(value):
    extra = {**SPEC, "cpu_bytes_to_use": value}
    spec = _spec(extra)
    assert spec.num_chunks == (1 << 20) // ROW
    # vLLM reads the bytes; the caller's dict is left as written.
    assert spec.extra_config["cpu_bytes_to_use"] == 1 << 20
    assert extra["cpu_bytes_to_use"] == value


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("32 gigs", "is not a byte size"),
        ("1.5B", "is not a whole number of bytes"),
        (-4096, "must be positive"),
        (True, "expected a byte size"),
        ([1], "expected int or str"),
        ("", "required"),
        (None, "required"),
        (0, "required"),
    ],
)
def test_a_bad_cpu_bytes_to_use_names_the_key(value, reason):
    with pytest.raises(InvalidArgumentError, match=rf"^kv_connector_extra_config\['cpu_bytes_to_use'\]: .*{reason}"):
        _spec({**SPEC, "cpu_bytes_to_use": value})


def test_a_missing_cpu_bytes_to_use_names_the_key():
    with pytest.raises(InvalidArgumentError, match=r"^kv_connector_extra_config\['cpu_bytes_to_use'\]: required"):
        _spec(dict(SPEC))


def test_the_manager_runs_with_sized_primary_and_disk_tiers(tmp_path):
    # The whole scheduler side, as vLLM builds it: a primary tier of 1 MiB (32 rows) and
    # kvtier's disk tier, both given as size strings.
    from kvtier_rs.integrations.vllm.secondary import KvtierDiskTier

    tier = {
        "type": "KvtierDiskTier",
        "module_path": "kvtier_rs.integrations.vllm",
        "root_dir": str(tmp_path),
        "capacity_bytes": "2MiB",
    }
    spec = _spec({**SPEC, "cpu_bytes_to_use": "1MiB", "secondary_tiers": [tier]})
    try:
        mgr = spec.get_manager()
        try:
            assert mgr.primary_tier.get_kv_memoryview().nbytes == 1 << 20
            (disk,) = mgr.secondary_tiers
            assert isinstance(disk, KvtierDiskTier)
            assert disk.disk.capacity_blocks == (2 << 20) // disk.disk.slot_stride
        finally:
            mgr.shutdown()
    finally:
        # The scheduler's region is named, with no worker to unlink it.
        path = f"/dev/shm/vllm_offload_{spec.config.engine_id}.mmap"
        if os.path.exists(path):
            os.unlink(path)


@pytest.mark.parametrize(
    "bad",
    [{"capacity_bytes": None}, {"capacity_bytes": "lots"}, {"policy": "mru"}, {"root": "/x"}, {"locality": "NEAR"}],
)
def test_the_disk_tier_and_kvtier_vllm_config_refuse_an_entry_alike(tmp_path, bad):
    # `kvtier vllm-config` runs the disk tier's own checks: the same message, before any engine.
    import mmap
    import types

    from kvtier_rs.integrations.vllm.config_check import check
    from kvtier_rs.integrations.vllm.secondary import KvtierDiskTier

    entry = {k: v for k, v in {"root_dir": str(tmp_path), "capacity_bytes": "1MiB", **bad}.items() if v is not None}
    mm = mmap.mmap(-1, 8 * ROW)
    view = memoryview(mm).cast("B", (8, ROW))
    spec = types.SimpleNamespace(config=_offloading_config({**SPEC, "cpu_bytes_to_use": 8 * ROW}))
    with pytest.raises(InvalidArgumentError) as by_tier:
        KvtierDiskTier(spec, view, "KvtierDiskTier", None, **entry)
    view.release()
    mm.close()
    tier = {"type": "KvtierDiskTier", "module_path": "kvtier_rs.integrations.vllm", **entry}
    cfg = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {**SPEC, "cpu_bytes_to_use": "1MiB", "secondary_tiers": [tier]},
    }
    with pytest.raises(InvalidArgumentError) as by_check:
        check(cfg)
    assert str(by_check.value) == str(by_tier.value)
    assert str(by_tier.value).startswith("secondary_tiers[type=KvtierDiskTier]")
