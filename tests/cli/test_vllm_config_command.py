"""`kvtier vllm-config`: a vLLM --kv-transfer-config checked with kvtier's own parsers before
an engine starts, and reported as "ok" with the effective settings, or as one error line
naming the key (exit status 2). No vLLM is imported."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from kvtier_rs.cli import main

MODULE = "kvtier_rs.integrations.vllm"
DISK_TIER = {"type": "KvtierDiskTier", "module_path": MODULE, "root_dir": "/nvme/kv", "capacity_bytes": "64GiB"}
REMOTE_TIER = {"type": "KvtierRemoteTier", "module_path": MODULE, "remote_url": "redis://10.0.0.5:7000"}
OFFLOADING = {
    "kv_connector": "OffloadingConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {
        "spec_name": "KvtierOffloadingSpec",
        "spec_module_path": MODULE,
        "cpu_bytes_to_use": "8GiB",
        "disk_root": "/nvme/kv",
        "disk_bytes_to_use": "64GiB",
    },
}
TIERING = {
    "kv_connector": "OffloadingConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {
        "spec_name": "KvtierTieringOffloadingSpec",
        "spec_module_path": MODULE,
        "cpu_bytes_to_use": "32GiB",
        "secondary_tiers": [DISK_TIER],
    },
}


def run(capsys, *args):
    rc = main(["vllm-config", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def with_extra(base, **changes):
    cfg = copy.deepcopy(base)
    for k, v in changes.items():
        if v is None:
            cfg["kv_connector_extra_config"].pop(k, None)
        else:
            cfg["kv_connector_extra_config"][k] = v
    return cfg


def with_tier(**changes):
    tier = {**DISK_TIER, **changes}
    return with_extra(TIERING, secondary_tiers=[{k: v for k, v in tier.items() if v is not None}])


def test_kvtier_offloading_spec_settings(capsys):
    rc, out, err = run(capsys, json.dumps(OFFLOADING))
    assert (rc, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == f"ok: KvtierOffloadingSpec ({MODULE})"
    assert "  cpu_bytes:          8589934592 (8 GiB)" in lines
    assert "  disk_bytes:         68719476736 (64 GiB)" in lines
    assert "  disk_root:          /nvme/kv (a directory per model is made under it)" in lines
    assert "  cpu_policy:         lru" in lines and "  disk_io_engine:     auto" in lines

    rc, out, _ = run(
        capsys,
        "--json",
        json.dumps(with_extra(OFFLOADING, eviction_policy="ARC", disk_root=None, disk_bytes_to_use=None)),
    )
    assert rc == 0
    report = json.loads(out)
    assert report["ok"] is True and report["spec_name"] == "KvtierOffloadingSpec"
    assert report["settings"] == {
        "cpu_bytes": 8 << 30,
        "cpu_policy": "arc",
        "cpu_admission": "always",
        "slo_guard": None,
        "remote_url": None,
        "disk_root": None,
    }


def test_the_remote_tier_is_shown_and_its_files_checked_without_the_store(capsys, tmp_path):
    # Port 1: nothing listens there; the check never connects (a store that is down costs
    # misses at run time, not a refused config).
    cfg = with_extra(OFFLOADING, remote_url="redis://127.0.0.1:1", remote_admission="always")
    rc, out, err = run(capsys, "--json", json.dumps(cfg))
    assert (rc, err) == (0, "")
    s = json.loads(out)["settings"]
    assert (s["remote_url"], s["remote_admission"], s["remote_values"]) == (
        "redis://127.0.0.1:1",
        "always",
        "checksummed, no secret",
    )
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    rc, out, err = run(capsys, "--json", json.dumps(with_extra(cfg, remote_secret_file=str(secret))))
    assert rc == 0 and json.loads(out)["settings"]["remote_values"].startswith("MAC-keyed")
    missing = str(tmp_path / "missing")
    rc, out, err = run(capsys, json.dumps(with_extra(cfg, remote_secret_file=missing)))
    assert rc != 0 and "remote_secret_file" in err and missing in err and "Traceback" not in err
    rc, out, err = run(capsys, json.dumps(with_extra(cfg, remote_url="redis://u:hunter2@h:1")))
    assert rc != 0 and "remote_url" in err and "hunter2" not in err


def test_kvtier_connector_is_accepted_with_its_module_path(capsys):
    cfg = {**OFFLOADING, "kv_connector": "KvtierConnector", "kv_connector_module_path": MODULE}
    rc, out, err = run(capsys, json.dumps(cfg))
    assert (rc, err) == (0, "") and out.startswith(f"ok: KvtierOffloadingSpec ({MODULE})")
    # The request rule needs it (it measures the requests): accepted here.
    cfg = with_extra(cfg, slo_guard={"ttft_p99_ms": 500, "itl_p99_ms": 50})
    rc, out, err = run(capsys, json.dumps(cfg))
    assert (rc, err) == (0, ""), err


def test_tiering_spec_settings(capsys):
    cfg = with_extra(TIERING, secondary_tiers=[{**DISK_TIER, "policy": "s3fifo", "backpressure": {}}, {"type": "fs"}])
    rc, out, err = run(capsys, "--json", json.dumps(cfg))
    assert (rc, err) == (0, "")
    s = json.loads(out)["settings"]
    assert s["cpu_bytes_to_use"] == 32 << 30 and s["eviction_policy"] == "lru"
    disk, fs = s["secondary_tiers"]
    assert disk == {
        "type": "KvtierDiskTier",
        "checked": True,
        "disk_root": "/nvme/kv",
        "disk_bytes": 64 << 30,
        "disk_policy": "s3fifo",
        "disk_admission": "always",
        "disk_io_engine": "auto",
        "disk_queue_depth": 16,
        "locality": "LOCAL",
    }
    assert fs == {"type": "fs", "checked": False}
    rc, out, _ = run(capsys, json.dumps(cfg))
    assert rc == 0 and out.startswith(f"ok: KvtierTieringOffloadingSpec ({MODULE})\n")
    assert "  secondary_tiers[0]: KvtierDiskTier\n" in out and "    disk_bytes:         68719476736 (64 GiB)\n" in out
    assert "  secondary_tiers[1]: fs (not kvtier's: not checked here)\n" in out


def test_vllm_own_tiering_spec_with_kvtier_disk_tier(capsys):
    cfg = with_extra(TIERING, spec_name="TieringOffloadingSpec", spec_module_path=None, cpu_bytes_to_use=1 << 30)
    rc, out, _ = run(capsys, json.dumps(cfg))
    assert rc == 0 and out.startswith("ok: TieringOffloadingSpec\n")


def test_tiering_spec_with_kvtier_remote_tier(capsys, monkeypatch):
    monkeypatch.delenv("KVTIER_REMOTE_PASSWORD", raising=False)
    cfg = with_extra(
        TIERING,
        spec_name="TieringOffloadingSpec",
        spec_module_path=None,
        cpu_bytes_to_use=1 << 30,
        secondary_tiers=[DISK_TIER, {**REMOTE_TIER, "remote_deadline_s": 0.5}],
    )
    rc, out, err = run(capsys, "--json", json.dumps(cfg))
    assert (rc, err) == (0, "")
    _, remote = json.loads(out)["settings"]["secondary_tiers"]
    assert remote == {
        "type": "KvtierRemoteTier",
        "checked": True,
        "remote_url": "redis://10.0.0.5:7000",
        "remote_prefix": "kvtier",
        "remote_values": "checksummed, no secret",
        "remote_admission": "always",
        "remote_deadline_s": 0.5,
        "remote_ttl_s": None,
        "locality": "REMOTE",
    }
    # The remote tier alone is kvtier under vLLM's own spec too.
    rc, out, err = run(capsys, json.dumps(with_extra(cfg, secondary_tiers=[REMOTE_TIER])))
    assert (rc, err) == (0, "") and "  secondary_tiers[0]: KvtierRemoteTier\n" in out


def test_bare_size_numbers_are_expanded_as_vllm_does(capsys):
    # vLLM's --kv-transfer-config accepts unquoted 8G (binary) and 8g (decimal) numbers.
    text = json.dumps(OFFLOADING).replace('"8GiB"', "8G").replace('"64GiB"', "64g")
    rc, out, _ = run(capsys, "--json", text)
    s = json.loads(out)["settings"]
    assert rc == 0 and (s["cpu_bytes"], s["disk_bytes"]) == (8 << 30, 64 * 10**9)
    # Quoted text is never touched: a directory named "8G" stays one.
    rc, out, _ = run(capsys, "--json", json.dumps(with_extra(OFFLOADING, disk_root="/kv/8G")))
    assert rc == 0 and json.loads(out)["settings"]["disk_root"] == "/kv/8G"


def test_the_config_can_come_from_a_file(tmp_path, capsys):
    f = tmp_path / "kv.json"
    f.write_text(json.dumps(TIERING))
    rc, out, _ = run(capsys, "--file", str(f))
    assert rc == 0 and out.startswith("ok: KvtierTieringOffloadingSpec")
    rc, _, err = run(capsys, "--file", str(tmp_path / "missing.json"))
    assert rc == 2 and err.startswith(f"kvtier vllm-config: error: --file {tmp_path / 'missing.json'}: cannot read")


TIERING_CASES = [
    # Under the tiering spec: cpu_bytes_to_use is parsed as KvtierOffloadingSpec parses it.
    (
        with_extra(TIERING, cpu_bytes_to_use="32 gigs"),
        "kv_connector_extra_config['cpu_bytes_to_use']: '32 gigs' is not",
    ),
    (with_extra(TIERING, cpu_bytes_to_use=None), "kv_connector_extra_config['cpu_bytes_to_use']: required"),
    (with_extra(TIERING, disk_root="/kv"), "kv_connector_extra_config['disk_root']: read only by KvtierOffloadingSpec"),
    (with_extra(TIERING, store_threshold=2), "kv_connector_extra_config['store_threshold']: not supported"),
    (
        with_extra(TIERING, offload_prompt_only="false"),
        "kv_connector_extra_config['offload_prompt_only']: expected a bool",
    ),
    (
        with_extra(TIERING, secondary_tiers={"type": "KvtierDiskTier"}),
        "kv_connector_extra_config['secondary_tiers']: expected a list",
    ),
    (
        with_extra(TIERING, secondary_tiers=[{"root_dir": "/kv"}]),
        "kv_connector_extra_config['secondary_tiers']: entry 0",
    ),
    # The disk tier's own keys, with the tier's own messages.
    (with_tier(capacity_bytes=None), "secondary_tiers[type=KvtierDiskTier]['disk_bytes']: required"),
    (with_tier(capacity_bytes="lots"), "secondary_tiers[type=KvtierDiskTier]['capacity_bytes']: 'lots' is not"),
    (with_tier(root_dir=None), "secondary_tiers[type=KvtierDiskTier]['disk_root']: required"),
    (with_tier(root="/x"), "secondary_tiers[type=KvtierDiskTier]['root']: unknown key"),
    (with_tier(policy="mru"), "secondary_tiers[type=KvtierDiskTier]['policy']: unknown eviction policy"),
    (with_tier(admission="sometimes"), "secondary_tiers[type=KvtierDiskTier]['admission']"),
    (with_tier(io_engine="aio"), "secondary_tiers[type=KvtierDiskTier]['io_engine']: 'aio' is not one of"),
    (with_tier(queue_depth=0), "secondary_tiers[type=KvtierDiskTier]['queue_depth']: expected an int in 1..1024"),
    (
        with_tier(locality="NEAR"),
        "secondary_tiers[type=KvtierDiskTier]['locality']: 'NEAR' is not one of LOCAL, REMOTE",
    ),
    (with_tier(module_path=None), "secondary_tiers[type=KvtierDiskTier]['module_path']: vLLM loads KvtierDiskTier"),
    (
        with_extra(TIERING, secondary_tiers=[DISK_TIER, {**DISK_TIER, "root_dir": "/nvme/kv/"}]),
        "secondary_tiers[type=KvtierDiskTier]['root_dir']: '/nvme/kv/': also the root_dir of secondary_tiers entry 0",
    ),
    # vLLM's own tiering spec reads cpu_bytes_to_use with int().
    (
        with_extra(TIERING, spec_name="TieringOffloadingSpec"),
        "kv_connector_extra_config['cpu_bytes_to_use']: vLLM's TieringOffloadingSpec takes a number of bytes",
    ),
    (
        with_extra(TIERING, spec_name="TieringOffloadingSpec", cpu_bytes_to_use=1 << 30, secondary_tiers=[]),
        "kv_connector_extra_config['secondary_tiers']: no KvtierDiskTier or KvtierRemoteTier entry",
    ),
    (
        with_extra(TIERING, secondary_tiers=[{k: v for k, v in REMOTE_TIER.items() if k != "remote_url"}]),
        "secondary_tiers[type=KvtierRemoteTier]['remote_url']: required",
    ),
    (
        with_extra(TIERING, secondary_tiers=[{**REMOTE_TIER, "remote_url": "http://h:1"}]),
        "secondary_tiers[type=KvtierRemoteTier]['remote_url']: ",
    ),
    (
        with_extra(TIERING, secondary_tiers=[{**REMOTE_TIER, "disk_root": "/kv"}]),
        "secondary_tiers[type=KvtierRemoteTier]['disk_root']: unknown key",
    ),
    (
        with_extra(TIERING, secondary_tiers=[{**REMOTE_TIER, "module_path": "x"}]),
        "secondary_tiers[type=KvtierRemoteTier]['module_path']: vLLM loads KvtierRemoteTier",
    ),
    (
        with_extra(TIERING, remote_url="redis://h:1"),
        "kv_connector_extra_config['remote_url']: read only by KvtierOffloadingSpec",
    ),
]

OFFLOADING_CASES = [
    (with_extra(OFFLOADING, cpu_bytes_to_use="8 GB!"), "kv_connector_extra_config['cpu_bytes_to_use']: '8 GB!' is not"),
    (with_extra(OFFLOADING, disk_root=None), "kv_connector_extra_config['disk_bytes_to_use']: needs disk_root"),
    (with_extra(OFFLOADING, disk_policy="mru"), "kv_connector_extra_config['disk_policy']: unknown eviction policy"),
    (with_extra(OFFLOADING, dsik_root="/kv"), "kv_connector_extra_config['dsik_root']: unknown key"),
    (
        with_extra(OFFLOADING, slo_guard={"ttft_p99_ms": 500}),
        "kv_connector_extra_config['slo_guard']: needs kv_connector KvtierConnector",
    ),
    (
        with_extra(OFFLOADING, slo_guard={"window_s": 5}),
        "kv_connector_extra_config['slo_guard']: needs ttft_p99_ms, itl_p99_ms or both",
    ),
    (with_extra(OFFLOADING, secondary_tiers=[DISK_TIER]), "kv_connector_extra_config['secondary_tiers']: read only by"),
    (with_extra(OFFLOADING, canonical_layout=True), "kv_connector_extra_config['canonical_layout']: not supported"),
    (with_extra(OFFLOADING, spec_name=None), "kv_connector_extra_config['spec_name']: required: one of kvtier's specs"),
    (
        with_extra(OFFLOADING, spec_name="CPUOffloadingSpec"),
        "kv_connector_extra_config['spec_name']: 'CPUOffloadingSpec'",
    ),
    (
        with_extra(OFFLOADING, spec_module_path="kvtier_rs"),
        "kv_connector_extra_config['spec_module_path']: KvtierOffloadingSpec is loaded from",
    ),
    (
        {**OFFLOADING, "kv_connector": "LMCacheConnectorV1"},
        "kv_transfer_config['kv_connector']: kvtier runs under KvtierConnector or vLLM's OffloadingConnector",
    ),
    ({k: v for k, v in OFFLOADING.items() if k != "kv_role"}, "kv_transfer_config['kv_role']: required"),
    ({**OFFLOADING, "kv_connector_module_path": "x"}, "kv_transfer_config['kv_connector_module_path']: must be unset"),
    (
        {**OFFLOADING, "kv_connector": "KvtierConnector"},
        "kv_transfer_config['kv_connector_module_path']: KvtierConnector is loaded from 'kvtier_rs.integrations.vllm'",
    ),
    (
        OFFLOADING["kv_connector_extra_config"],
        "kv_transfer_config['kv_connector']: kvtier runs under KvtierConnector or vLLM's OffloadingConnector, "
        "got nothing; kvtier's keys go in kv_connector_extra_config",
    ),
    ([OFFLOADING], "kv_transfer_config: expected a JSON object"),
]


@pytest.mark.parametrize(("cfg", "message"), TIERING_CASES + OFFLOADING_CASES)
def test_a_bad_config_is_one_line_naming_the_key(capsys, cfg, message):
    rc, out, err = run(capsys, json.dumps(cfg))
    assert (rc, out) == (2, "")
    assert err.startswith(f"kvtier vllm-config: error: {message}"), err
    assert err.count("\n") == 1, err


def test_a_directory_that_is_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    rc, _, err = run(capsys, json.dumps(with_tier(root_dir=str(tmp_path / "f"))))
    assert rc == 2 and "secondary_tiers[type=KvtierDiskTier]['root_dir']: " in err and "is not a directory" in err
    rc, _, err = run(capsys, json.dumps(with_extra(OFFLOADING, disk_root=str(tmp_path / "f"))))
    assert rc == 2 and "kv_connector_extra_config['disk_root']: " in err and "is not a directory" in err
    assert [p.name for p in tmp_path.iterdir()] == ["f"]  # nothing created


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '{"kv_connector": "OffloadingConnector",',
            "not valid JSON: Expecting property name enclosed in double quotes (line 1",
        ),
        ('{"cpu_bytes_to_use": 1.5G}', "1.5G: vLLM allows no decimals with a binary suffix"),
    ],
)
def test_text_that_vllm_would_not_parse(capsys, text, message):
    rc, _, err = run(capsys, text)
    assert rc == 2 and err == f"kvtier vllm-config: error: {message}" + err.split(message, 1)[1]
    assert err.count("\n") == 1


def test_the_check_imports_no_vllm():
    # vLLM's import takes tens of seconds (torch): the check is meant to be instant.
    code = (
        "import sys; from kvtier_rs.cli import main; "
        f"rc = main(['vllm-config', {json.dumps(json.dumps(TIERING))}]); "
        "assert 'vllm' not in sys.modules and 'torch' not in sys.modules, 'imported'; sys.exit(rc)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ok: KvtierTieringOffloadingSpec")
