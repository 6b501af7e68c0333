"""Trace readers, model byte accounting and size parsing: formats, gzip, auto-detection, and
errors that name the file, line and field."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.traces import SHARED_TRACES as TRACES
from support.traces import needs_traces

from kvtier_rs._core import KvTierError
from kvtier_rs.cli import main
from kvtier_rs.planner.errors import PlanError, TraceError
from kvtier_rs.planner.model import bytes_per_token_from_config
from kvtier_rs.planner.traces import chain_hash, detect_format, read_trace
from kvtier_rs.planner.units import parse_size


def write_lines(path: Path, records) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


MOON = [
    {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]},
    {"timestamp": 1500, "input_length": 600, "output_length": 5, "hash_ids": [0, 2]},
]


def test_mooncake_reader_and_gzip(tmp_path):
    p = write_lines(tmp_path / "t.jsonl", MOON)
    d = read_trace(p)
    assert (d.format, d.block_size, d.n_requests) == ("mooncake", 512, 2)
    assert list(d.keys) == [0, 1, 0, 2] and list(d.offsets) == [0, 2, 4]
    assert list(d.timestamps_s) == [0.0, 1.5]  # milliseconds to seconds
    gz = tmp_path / "t.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write(p.read_text())
    assert list(read_trace(gz).keys) == list(d.keys)


@pytest.mark.parametrize(
    "bad,field",
    [
        ({"timestamp": 0, "input_length": 1000, "hash_ids": "x"}, "hash_ids"),
        ({"timestamp": 0, "input_length": -1, "hash_ids": []}, "input_length"),
        ({"timestamp": "soon", "input_length": 10, "hash_ids": [1]}, "timestamp"),
        ({"timestamp": 0, "input_length": 100, "hash_ids": [1, 2]}, "input_length"),
        ({"timestamp": 0, "input_length": 100, "hash_ids": [1, -2]}, "hash_ids"),
        ({"timestamp": 0, "hash_ids": [1]}, "input_length"),
    ],
)
def test_malformed_record_names_file_line_and_field(tmp_path, bad, field):
    p = write_lines(tmp_path / "bad.jsonl", [MOON[0], bad, MOON[1]])
    with pytest.raises(TraceError) as e:
        read_trace(p, "mooncake")
    assert (e.value.where, e.value.field) == ("2", field)
    assert str(p) in str(e.value) and f"'{field}'" in str(e.value)
    d = read_trace(p, "mooncake", skip_bad=True)
    assert (d.n_requests, d.skipped) == (2, 1)


def test_invalid_json_line_and_skip_bad(tmp_path):
    p = write_lines(tmp_path / "j.jsonl", [MOON[0], "{not json", MOON[1]])
    with pytest.raises(TraceError, match=r"j.jsonl:2: not valid JSON"):
        read_trace(p)
    assert read_trace(p, skip_bad=True).skipped == 1


def test_block_size_per_record_and_flag(tmp_path):
    recs = [
        {**MOON[0], "block_size": 1000, "hash_ids": [7]},
        {**MOON[1], "block_size": 1000, "hash_ids": [7]},
    ]
    d = read_trace(write_lines(tmp_path / "b.jsonl", recs))
    assert d.block_size == 1000
    mixed = [recs[0], {**recs[1], "block_size": 256}]
    with pytest.raises(TraceError, match="block_size"):
        read_trace(write_lines(tmp_path / "m.jsonl", mixed))
    with pytest.raises(TraceError, match="block_size"):
        read_trace(write_lines(tmp_path / "f.jsonl", recs), block_size=512)


def test_bailian_detection_and_seconds(tmp_path):
    recs = [
        {
            "chat_id": 1,
            "parent_chat_id": -1,
            "timestamp": 2.5,
            "input_length": 40,
            "output_length": 3,
            "type": "text",
            "turn": 1,
            "hash_ids": [1, 2, 3],
        }
    ]
    p = write_lines(tmp_path / "bl.jsonl", recs)
    d = read_trace(p)
    assert (d.format, d.block_size, list(d.timestamps_s)) == ("bailian", 16, [2.5])


def test_kvcache_tester_single_and_many_conversations(tmp_path):
    conv = {
        "block_size": 4,
        "hash_id_scope": "local",
        "requests": [
            {"t": 0, "in": 9, "out": 1, "hash_ids": [1, 2]},
            {"t": 3, "in": 13, "out": 1, "hash_ids": [1, 2, 3]},
        ],
    }
    p = tmp_path / "c.json"
    p.write_text(json.dumps(conv, indent=2))  # pretty-printed: spans lines
    assert detect_format(p) == "kvcache-tester"
    d = read_trace(p)
    assert (d.block_size, list(d.keys), list(d.input_tokens)) == (4, [1, 2, 1, 2, 3], [9, 13])
    many = tmp_path / "many.json"
    many.write_text(json.dumps([conv, {**conv, "requests": [{"t": 1, "in": 5, "out": 1, "hash_ids": [1]}]}]))
    d2 = read_trace(many)
    # Local ids of the second conversation are a different key space, merged in time order.
    assert d2.n_requests == 3 and d2.keys[2] not in (d2.keys[0], d2.keys[1])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**conv, "requests": [{"t": 0, "in": "many", "hash_ids": []}]}))
    with pytest.raises(TraceError, match=r"requests\[0\]: field 'in'"):
        read_trace(bad)


def test_token_trace_is_chain_hashed(tmp_path):
    recs = [
        {"timestamp": 0, "token_ids": list(range(40))},
        {"timestamp": 1, "token_ids": list(range(32)) + [99] * 3},
    ]
    d = read_trace(write_lines(tmp_path / "tok.jsonl", recs), block_size=16)
    assert d.format == "tokens"
    a, b = list(d.keys[0:3]), list(d.keys[3:6])
    assert a[:2] == b[:2] and a[2] != b[2]  # shared 32-token prefix, different tails
    assert chain_hash(list(range(16)), 16) != chain_hash(list(range(1, 17)), 16)
    # A block's key depends on its whole prefix, not just its own tokens.
    assert chain_hash([1] * 16 + [2] * 16, 16)[1] != chain_hash([3] * 16 + [2] * 16, 16)[1]


@needs_traces
def test_shared_trace_facts():
    d = read_trace(TRACES / "weka_kvcachetester_trace_0001.json")
    assert (d.format, d.block_size, d.n_requests) == ("kvcache-tester", 64, 41)
    m = read_trace(TRACES / "mooncake_conversation_trace.jsonl")
    assert (m.n_requests, len(m.keys), len(set(m.keys))) == (12031, 288500, 182790)


def test_unknown_format_and_empty(tmp_path):
    with pytest.raises(PlanError, match="cannot tell the trace format"):
        read_trace(write_lines(tmp_path / "u.jsonl", [{"a": 1}]))
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(PlanError, match="empty"):
        read_trace(tmp_path / "e.jsonl")
    with pytest.raises(PlanError, match="no such trace"):
        read_trace(tmp_path / "missing.jsonl")


def cfg(tmp_path, **kw) -> Path:
    p = tmp_path / "config.json"
    p.write_text(json.dumps(kw))
    return p


def test_model_bytes_gqa_mla_and_windows(tmp_path):
    llama = cfg(
        tmp_path,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        hidden_size=4096,
        torch_dtype="bfloat16",
    )
    assert bytes_per_token_from_config(llama).bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert bytes_per_token_from_config(llama, "fp8").bytes_per_token == 2 * 32 * 8 * 128
    mla = cfg(
        tmp_path,
        num_hidden_layers=61,
        num_attention_heads=128,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        torch_dtype="bfloat16",
    )
    m = bytes_per_token_from_config(mla)
    assert m.bytes_per_token == 61 * (512 + 64) * 2 and "MLA" in m.notes[0]
    hybrid = cfg(
        tmp_path,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        torch_dtype="float16",
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        sliding_window=128,
    )
    assert bytes_per_token_from_config(hybrid).bytes_per_token == 2 * 2 * 2 * 64 * 2
    swa = cfg(tmp_path, num_hidden_layers=32, num_attention_heads=32, hidden_size=4096, sliding_window=4096)
    with pytest.raises(PlanError, match="sliding window of 4096"):
        bytes_per_token_from_config(swa)
    qwen = cfg(
        tmp_path,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=256,
        sliding_window=4096,
        use_sliding_window=False,
        torch_dtype="bfloat16",
    )
    assert bytes_per_token_from_config(qwen).bytes_per_token == 2 * 2 * 2 * 64 * 2
    with pytest.raises(PlanError, match="num_hidden_layers"):
        bytes_per_token_from_config(cfg(tmp_path, hidden_size=1))
    with pytest.raises(PlanError, match="no such file"):
        bytes_per_token_from_config(tmp_path / "nope.json")


def test_sizes():
    assert parse_size("40GiB", "--gpu").value == 40 * 2**30
    assert parse_size("2TB", "--disk").value == 2 * 10**12
    s = parse_size("5000blocks", "--cpu")
    assert s.in_blocks and s.blocks(None, "--cpu") == 5000
    assert parse_size("1MiB", "--cpu").blocks(1000, "--cpu") == 1048
    for bad in ["40", "forty GiB", "3 parsecs", "0blocks"]:
        with pytest.raises(PlanError, match="--gpu"):
            parse_size(bad, "--gpu")
    with pytest.raises(PlanError, match="needs --bytes-per-token"):
        parse_size("1GiB", "--gpu").blocks(None, "--gpu")


def test_planner_errors_are_kvtier_errors():
    with pytest.raises(KvTierError) as e:
        parse_size("3parsecs", "--gpu")
    assert isinstance(e.value, PlanError)
    assert str(e.value) == "--gpu: '3parsecs' is not a byte size (e.g. 4096, '64MiB', '2GB')"
    assert issubclass(TraceError, KvTierError)


REC = b'{"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [1, 2]}\n'
HUGE = 10**20


def plan_fails(capsys, *argv: str) -> str:
    """Run `kvtier plan ARGV` through the console script's entry point: it must exit with status 2
    and one line on stderr, never a traceback. Returns that line."""
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize(
    "name,content,args,words",
    [
        (
            "huge_input.jsonl",
            b'{"timestamp": 0, "input_length": %d, "hash_ids": [1, 2]}\n' % HUGE,
            [],
            [":1: field 'input_length'", "<= 1000000000"],
        ),
        (
            "huge_output.jsonl",
            b'{"timestamp": 0, "input_length": 1000, "output_length": %d, "hash_ids": [1]}\n' % HUGE,
            [],
            [":1: field 'output_length'", "<= 1000000000"],
        ),
        # Each fits u64, but their sum would wrap: rejected per record, at parse time.
        (
            "u64_max.jsonl",
            b'{"timestamp": 0, "input_length": %d, "hash_ids": [1]}\n' % (2**64 - 1) * 3,
            [],
            [":1: field 'input_length'", "<= 1000000000"],
        ),
        (
            "huge_record_block_size.jsonl",
            b'{"timestamp": 0, "input_length": 10, "hash_ids": [1], "block_size": %d}\n' % HUGE,
            [],
            [":1: field 'block_size'", "<= 1048576"],
        ),
        ("empty_list.json", b"[]\n", [], ["no conversations"]),
        (
            "tester_huge_block_size.json",
            b'{"block_size": %d, "requests": [{"t": 0, "in": 10, "hash_ids": [1]}]}\n' % HUGE,
            [],
            ["field 'block_size'", "<= 1048576"],
        ),
        (
            "tester_huge_in.json",
            b'{"block_size": 16, "requests": [{"t": 0, "in": %d, "hash_ids": [1]}]}\n' % HUGE,
            [],
            ["requests[0]: field 'in'", "<= 1000000000"],
        ),
        ("not_utf8.jsonl", b"\xff\xfe\x00garbage\n", [], [":1: not valid UTF-8", "0xff"]),
        ("bad_utf8_line2.jsonl", REC + b'{"timestamp": 5, "x": "\xff"}\n' + REC, [], [":2: not valid UTF-8"]),
        (
            "tester_not_utf8.json",
            b'{"block_size": 16,\n "x": "\xff", "requests": []}\n',
            ["--trace-format", "kvcache-tester"],
            [":2: not valid UTF-8", "column 8"],
        ),
        ("corrupt.jsonl.gz", b"\x1f\x8bgarbagegarbage", [], ["corrupt gzip file"]),
        ("truncated.jsonl.gz", gzip.compress(REC)[:30], [], ["truncated gzip file"]),
        ("ok.jsonl", REC, ["--block-size", str(HUGE)], ["--block-size", "1048576"]),
    ],
)
def test_bad_trace_file_is_a_one_line_error(tmp_path, capsys, name, content, args, words):
    p = tmp_path / name
    p.write_bytes(content)
    err = plan_fails(capsys, str(p), *args)
    for w in words:
        assert w in err


def test_directory_or_fifo_is_named_as_such(tmp_path, capsys):
    assert "is a directory" in plan_fails(capsys, str(tmp_path))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert "not a regular file" in plan_fails(capsys, str(fifo))


def test_skip_bad_skips_non_utf8_and_out_of_range_lines(tmp_path, capsys):
    p = tmp_path / "t.jsonl"
    p.write_bytes(REC + b'{"x": "\xff"}\n' + b'{"timestamp": 1, "input_length": %d, "hash_ids": [1]}\n' % HUGE + REC)
    args = ["plan", str(p), "--skip-bad", "--warmup", "0", "--capacities", "1", "--format", "json", "--no-progress"]
    assert main(args) == 0
    trace = json.loads(capsys.readouterr().out)["trace"]
    assert (trace["requests"], trace["skipped_records"]) == (2, 2)
    assert "t.jsonl:2: not valid UTF-8" in trace["skipped_examples"][0]
    assert "t.jsonl:3: field 'input_length'" in trace["skipped_examples"][1]


def test_detection_reads_a_first_line_longer_than_64k(tmp_path, capsys):
    n = 16000  # a 256k-token prompt in 16-token blocks: a ~140 KB first line
    rec = {"timestamp": 0, "input_length": n * 16, "hash_ids": list(range(10**6, 10**6 + n)), "block_size": 16}
    p = write_lines(tmp_path / "long.jsonl", [{**rec, "timestamp": i} for i in range(3)])
    assert len(p.read_text().split("\n", 1)[0]) > 1 << 16
    assert detect_format(p) == "mooncake"
    assert main(["plan", str(p), "--capacities", "100", "--format", "json", "--no-progress"]) == 0
    trace = json.loads(capsys.readouterr().out)["trace"]
    assert (trace["format"], trace["block_size"], trace["requests"]) == ("mooncake", 16, 3)


def run_without_read_override(*argv: str) -> subprocess.CompletedProcess:
    """`kvtier ARGV` in a child that mode bits apply to, even when the tests run as root."""
    cmd = [sys.executable, "-m", "kvtier_rs.cli", *argv]
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("SKIPPED LOUDLY: running as root without setpriv (util-linux): cannot make a file unreadable")
        cmd = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *cmd]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.stderr.startswith("setpriv:"):
        pytest.skip(f"SKIPPED LOUDLY: setpriv cannot drop capabilities here: {r.stderr.strip()}")
    return r


def test_unreadable_trace_and_model_config(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(REC)
    conf = cfg(tmp_path, num_hidden_layers=2, num_attention_heads=4, hidden_size=256)
    for unreadable, args in [(trace, [str(trace)]), (conf, [str(trace), "--model-config", str(conf)])]:
        unreadable.chmod(0)
        try:
            r = run_without_read_override("plan", *args)
        finally:
            unreadable.chmod(0o644)
        assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
        assert f"{unreadable}: cannot read: Permission denied" in r.stderr


@pytest.mark.parametrize(
    "fields,words",
    [
        ({"torch_dtype": 5}, ["field 'torch_dtype'", "dtype name", "got 5"]),
        ({"num_key_value_heads": -8}, ["field 'num_key_value_heads'", "positive integer", "got -8"]),
        ({"head_dim": 0}, ["field 'head_dim'", "positive integer", "got 0"]),
        ({"num_hidden_layers": "32"}, ["field 'num_hidden_layers'", "positive integer", "got '32'"]),
        ({"hidden_size": 16}, ["'hidden_size' (16) is smaller than 'num_attention_heads' (32)"]),
        ({"num_hidden_layers": 10**9}, ["KV bytes per token", "1073741824 (1 GiB)"]),
        ({"kv_lora_rank": 0}, ["field 'kv_lora_rank'", "positive integer"]),
    ],
)
def test_nonsensical_model_config_values_name_the_field(tmp_path, capsys, fields, words):
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(REC)
    conf = cfg(tmp_path, **{"num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 4096, **fields})
    err = plan_fails(capsys, str(trace), "--model-config", str(conf), "--cpu", "10GiB")
    assert err.startswith(f"kvtier plan: error: --model-config: {conf}: ")
    for w in words:
        assert w in err


def test_model_config_that_is_a_directory(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(REC)
    err = plan_fails(capsys, str(trace), "--model-config", str(tmp_path))
    assert f"--model-config: {tmp_path}: cannot read: Is a directory" in err


GOOD = [json.dumps(r) for r in MOON]


@pytest.mark.parametrize(
    "first,reason",
    [
        ("{not json", "not valid JSON"),
        ('{"timestamp": 0, "input_length": 1000, "hash_ids": [0, 1]', "not valid JSON"),  # truncated
        ('{"timestamp": 0, "input_length": 1000}', "field 'hash_ids': missing"),
        ('{"timestamp": 0}', "field 'input_length': missing"),
        ("42", "expected a JSON object"),
        (b"\xff\xfe garbage", "not valid UTF-8"),
    ],
)
def test_skip_bad_skips_a_bad_first_line_too(tmp_path, capsys, first, reason):
    p = tmp_path / "first_bad.jsonl"
    p.write_bytes((first if isinstance(first, bytes) else first.encode()) + b"\n" + "\n".join(GOOD).encode() + b"\n")
    # Without --skip-bad: the first line is reported as a bad record (file, line 1, what is wrong).
    with pytest.raises(TraceError) as e:
        read_trace(p)
    assert e.value.where == "1" and reason in str(e.value)
    d = read_trace(p, skip_bad=True)
    assert (d.format, d.n_requests, d.skipped) == ("mooncake", 2, 1)
    assert d.skipped_examples[0].startswith(f"{p}:1: ") and reason in d.skipped_examples[0]
    args = ["plan", str(p), "--skip-bad", "--warmup", "0", "--capacities", "1", "--format", "json", "--no-progress"]
    assert main(args) == 0
    trace = json.loads(capsys.readouterr().out)["trace"]
    assert (trace["format"], trace["requests"], trace["skipped_records"]) == ("mooncake", 2, 1)


def test_skip_bad_skips_several_bad_lines_before_the_first_good_one(tmp_path):
    p = write_lines(tmp_path / "t.jsonl", ["{oops", "", "[1, 2", '{"timestamp": 0}', *GOOD, "{bad again"])
    d = read_trace(p, skip_bad=True)
    assert (d.n_requests, d.skipped) == (2, 4)
    assert [x.split(": ")[0] for x in d.skipped_examples] == [f"{p}:{n}" for n in (1, 3, 4, 7)]


def test_a_trace_with_no_usable_line_is_one_clear_error(tmp_path, capsys):
    p = write_lines(tmp_path / "junk.jsonl", ["{oops", '{"timestamp": 0, "input_length": -1, "hash_ids": []}'])
    err = plan_fails(capsys, str(p), "--skip-bad")
    assert "no usable requests" in err and "skipped 2 bad records" in err
    junk = write_lines(tmp_path / "junk2.jsonl", ["{oops", "{nope"])
    err = plan_fails(capsys, str(junk), "--skip-bad")
    assert f"{junk}:1: not valid JSON" in err


def test_skip_bad_skips_bad_lines_of_a_conversation_per_line_tester_file(tmp_path):
    conv = {"block_size": 4, "requests": [{"t": 0, "in": 9, "hash_ids": [1, 2]}, {"t": 1, "in": 5, "hash_ids": [1]}]}
    p = write_lines(tmp_path / "convs.jsonl", ["{broken", conv, {**conv, "requests": conv["requests"][:1]}])
    with pytest.raises(TraceError, match=r"convs.jsonl:1: not valid JSON"):
        read_trace(p)
    d = read_trace(p, skip_bad=True)
    assert (d.format, d.n_requests, d.skipped) == ("kvcache-tester", 3, 1)


def test_a_broken_pretty_printed_document_names_the_line_where_it_breaks(tmp_path):
    p = tmp_path / "doc.json"
    text = json.dumps({"block_size": 4, "requests": [{"t": 0, "in": 9, "hash_ids": [1, 2]}]}, indent=2)
    p.write_text(text.replace('"in": 9', '"in" 9'))
    line = next(i for i, s in enumerate(p.read_text().splitlines(), 1) if '"in" 9' in s)
    for skip in (False, True):  # one document: nothing in it can be skipped
        with pytest.raises(TraceError, match=rf"doc.json:{line}: not valid JSON"):
            read_trace(p, skip_bad=skip)


def _moon(ts: float) -> dict:
    return {"timestamp": ts, "input_length": 1000, "hash_ids": [0, 1]}


def test_a_timestamp_going_backwards_is_a_bad_record(tmp_path, capsys):
    """Requests replay in file order, and reuse times are differences of timestamps: a record
    earlier than the one before it is refused like any bad record, naming its line, or skipped
    and counted with --skip-bad (later records compare with the last one kept)."""
    p = write_lines(tmp_path / "back.jsonl", [_moon(5000), _moon(5000), _moon(1000), _moon(7000), _moon(6000)])
    with pytest.raises(TraceError) as e:
        read_trace(p)
    assert (e.value.where, e.value.field) == ("3", "timestamp")
    assert "1000 is earlier than 5000 on line 2" in str(e.value)
    d = read_trace(p, skip_bad=True)
    assert (list(d.timestamps_s), d.skipped) == ([5.0, 5.0, 7.0], 2)
    assert "back.jsonl:5: field 'timestamp': 6000 is earlier than 7000 on line 4" in d.skipped_examples[1]
    err = plan_fails(capsys, str(p))
    assert "back.jsonl:3: field 'timestamp'" in err
    args = ["plan", str(p), "--skip-bad", "--warmup", "0", "--capacities", "1", "--format", "json", "--no-progress"]
    assert main(args) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["trace"]["skipped_records"] == 2
    # Two reuses at 0 s (5.0 -> 5.0) and two at 2 s (5.0 -> 7.0), none negative or clamped.
    assert (rep["questions"]["reuse"]["time_s"]["count"], rep["questions"]["reuse"]["time_s"]["mean"]) == (4, 1.0)


def test_backwards_timestamps_in_tokens_and_tester_traces(tmp_path):
    tok = write_lines(
        tmp_path / "tok.jsonl", [{"timestamp": 2, "token_ids": [1] * 20}, {"timestamp": 1, "token_ids": [1]}]
    )
    with pytest.raises(TraceError, match=r"tok.jsonl:2: field 'timestamp': 1 is earlier than 2 on line 1"):
        read_trace(tok, block_size=16)
    conv = {"block_size": 4, "requests": [{"t": 3, "in": 4, "hash_ids": [1]}, {"t": 2, "in": 4, "hash_ids": [1]}]}
    p = tmp_path / "c.json"
    p.write_text(json.dumps(conv))
    with pytest.raises(TraceError, match=r"requests\[1\]: field 't': 2 is earlier than 3 in requests\[0\]"):
        read_trace(p)
    assert read_trace(p, skip_bad=True).skipped == 1
    # Conversations side by side: each must keep its own order; the merge interleaves them by time.
    other = {"block_size": 4, "requests": [{"t": 1, "in": 4, "hash_ids": [7]}, {"t": 5, "in": 4, "hash_ids": [7]}]}
    many = tmp_path / "many.json"
    many.write_text(json.dumps([other, {**conv, "requests": conv["requests"][:1]}]))
    assert list(read_trace(many).timestamps_s) == [1.0, 3.0, 5.0]
    many.write_text(json.dumps([other, conv]))
    with pytest.raises(TraceError, match=r"conversation 1: requests\[1\]: field 't': 2 is earlier than 3"):
        read_trace(many)


@pytest.mark.parametrize(
    ("record", "field"),
    [
        ('{"timestamp": 1%s, "input_length": 10, "hash_ids": [1]}' % ("0" * 400), "timestamp"),
        ('{"timestamp": 1, "input_length": 1e300, "hash_ids": [1]}', "input_length"),
        ('{"timestamp": 1, "input_length": 10, "output_length": 1%s, "hash_ids": [1]}' % ("0" * 400), "output_length"),
    ],
)
def test_a_number_too_large_for_a_float_is_a_bad_record(tmp_path, capsys, record, field):
    """A JSON integer beyond a float's range in a number field was an OverflowError traceback
    (math.isfinite on the int); a huge value was echoed in full (hundreds of digits). Now the
    record is bad like any other, named by line and field, skippable, the value shown bounded."""
    p = tmp_path / "huge.jsonl"
    p.write_text(record + "\n" + json.dumps(MOON[1]) + "\n")
    err = plan_fails(capsys, str(p))
    assert f"huge.jsonl:1: field '{field}'" in err and len(err) < 300, err
    d = read_trace(p, skip_bad=True)
    assert (d.n_requests, d.skipped) == (1, 1)


@pytest.mark.parametrize("option", ["--gpu", "--cpu"])
def test_a_block_count_of_thousands_of_digits_is_a_one_line_error(tmp_path, capsys, option):
    """int() refuses strings of more than 4300 digits: parse_size converted the count before
    bounding it, so such a count was a ValueError traceback instead of the usual bound."""
    p = write_lines(tmp_path / "t.jsonl", MOON)
    err = plan_fails(capsys, str(p), option, "9" * 5000 + "blocks")
    assert f"{option}: at most 1000000000000 (10^12) blocks" in err and len(err) < 200, err
    with pytest.raises(PlanError, match="at most"):
        parse_size("1" + "0" * 4400 + "blocks", "--disk")
    assert parse_size("0" * 5000 + "7blocks", "--disk").value == 7


@pytest.mark.parametrize("scope", ["Local", "GLOBAL", "", 1, None, ["local"], {"local": True}])
def test_an_unknown_hash_id_scope_is_a_bad_conversation(tmp_path, scope):
    """hash_id_scope is "local" (ids unique inside one conversation; the default when absent) or
    "global". Anything else was taken as global, merging the ids of different conversations;
    it is now refused naming the file and field, and --skip-bad skips that conversation."""
    conv = {"block_size": 4, "requests": [{"t": 0, "in": 9, "hash_ids": [1, 2]}]}
    p = tmp_path / "scope.json"
    p.write_text(json.dumps([{**conv, "hash_id_scope": scope}, conv]))
    with pytest.raises(TraceError) as e:
        read_trace(p)
    assert (e.value.where, e.value.field) == ("conversation 0", "hash_id_scope")
    assert str(p) in str(e.value) and "expected 'local' or 'global'" in str(e.value)
    d = read_trace(p, skip_bad=True)
    assert (d.n_requests, d.skipped) == (1, 1)


def test_hash_id_scope_local_global_and_absent(tmp_path):
    conv = {"block_size": 4, "requests": [{"t": 0, "in": 9, "hash_ids": [1, 2]}]}
    for scope, shared in (("local", False), (None, False), ("global", True)):
        c = conv if scope is None else {**conv, "hash_id_scope": scope}
        p = tmp_path / f"{scope}.json"
        p.write_text(json.dumps([c, c]))
        d = read_trace(p)
        # Global ids name the same blocks in every conversation; local (the default) ones do not.
        assert (list(d.keys[0:2]) == list(d.keys[2:4])) is shared
