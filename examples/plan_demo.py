"""Planner demo: synthesize a trace, plan on it, write the report and figures into a folder.

    .venv/bin/python examples/plan_demo.py [OUT_DIR]     (default: ./kvtier-plan-demo)

Runs on a fresh machine with no trace at hand: the workload is generated (shared system
prompts, RAG over a shared document set, multi-turn sessions, unique prompts, Poisson arrivals).
The model is a Llama-3-8B-like shape (32 layers, 8 KV heads of 128, bf16: 128 KiB per token).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvtier_rs.planner import PlanOptions, SynthConfig, parse_size, run_plan, synthesize, write_trace
from kvtier_rs.planner.plots import write_plots
from kvtier_rs.planner.report import render_table


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "kvtier-plan-demo").resolve()
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "trace.jsonl"
    write_trace(synthesize(SynthConfig(requests=6000, seed=7)), trace)
    config = out / "model_config.json"
    config.write_text(
        json.dumps(
            {
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "hidden_size": 4096,
                "torch_dtype": "bfloat16",
            }
        )
    )
    report = run_plan(
        PlanOptions(
            trace=str(trace),
            model_config=str(config),
            gpu=parse_size("8GiB", "--gpu"),
            cpu=parse_size("64GiB", "--cpu"),
            disk=parse_size("512GiB", "--disk"),
            progress=False,
        )
    )
    report["plots"] = write_plots(report, out)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    table = render_table(report)
    (out / "report.txt").write_text(table + "\n")
    print(table)
    print(f"\nkvtier plan demo: trace, report.txt, report.json and figures written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
