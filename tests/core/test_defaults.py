"""One default per option, wherever it is set: the Rust core's constructors, the vLLM and
TensorRT-LLM option readers and the planner all take theirs from `kvtier_rs.defaults`."""

from __future__ import annotations

from kvtier_rs import BlockIndex, DiskTier
from kvtier_rs import defaults as D
from kvtier_rs.integrations.trtllm.config import parse_options as trtllm_options
from kvtier_rs.integrations.vllm.options import parse_disk_tier
from kvtier_rs.integrations.vllm.options import parse_options as vllm_options
from kvtier_rs.planner.options import PlanOptions


def test_the_core_constructors_default_to_the_shared_values(tmp_path):
    with DiskTier(str(tmp_path / "d"), 16 * 8192, 4096) as disk:
        assert (disk.admission, disk.policy, disk.queue_depth) == (D.DISK_ADMISSION, D.POLICY, D.DISK_QUEUE_DEPTH)
        assert disk.engine_probe is None or disk.engine_probe["chosen"] == disk.engine  # "auto" measured
    ix = BlockIndex(8)
    assert (ix.admission, ix.policy) == (D.CPU_ADMISSION, D.POLICY)


def test_every_entry_point_defaults_to_the_shared_values(tmp_path):
    v = vllm_options({"cpu_bytes_to_use": 1 << 20, "disk_root": str(tmp_path), "disk_bytes_to_use": "1GiB"})
    t = trtllm_options({"cpu_bytes": "1MiB", "disk_root": str(tmp_path), "disk_bytes": "1GiB"})
    s = parse_disk_tier({"root_dir": str(tmp_path), "capacity_bytes": "1GiB"})
    p = PlanOptions(trace="t")
    assert v.cpu_admission == t.cpu_admission == p.cpu_admission == D.CPU_ADMISSION
    assert v.disk_admission == t.disk_admission == s.disk.admission == p.disk_admission == D.DISK_ADMISSION
    assert v.disk_io_engine == t.disk_io_engine == s.disk.io_engine == D.DISK_IO_ENGINE
    assert v.disk_queue_depth == t.disk_queue_depth == s.disk.queue_depth == D.DISK_QUEUE_DEPTH
    assert v.disk_max_write_backlog == t.disk_max_write_backlog == D.DISK_MAX_WRITE_BACKLOG
    assert v.disk_policy == s.disk.policy == D.POLICY  # TensorRT-LLM's tiers default to `priority`


def test_the_planner_command_line_defaults_to_the_shared_values():
    from kvtier_rs.cli import build_parser

    args = build_parser().parse_args(["plan", "trace.jsonl"])
    assert (args.cpu_admission, args.disk_admission) == (D.CPU_ADMISSION, D.DISK_ADMISSION)
