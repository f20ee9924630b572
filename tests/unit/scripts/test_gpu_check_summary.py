"""scripts/gpu_check_summary.py turns a GPU check's junit xml and GPU_FIGURE lines into markdown (it runs on the
GPU machine only after the suite: it must not fail there for the first time)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="3">
<testcase classname="tests.gpu.test_gpu_vllm_engine" name="test_a" time="12.5"/>
<testcase classname="tests.gpu.test_gpu_cli_runs" name="test_b[hf-merged]" time="80.0">
<failure message="AssertionError: exit 1 | see log">trace</failure></testcase>
<testcase classname="tests.gpu.test_gpu_train_step" name="test_c" time="0.1"><skipped message="needs CUDA"/></testcase>
</testsuite></testsuites>
"""


def test_summary_of_junit_and_figures(tmp_path: Path) -> None:
    (tmp_path / "gpu_check.xml").write_text(JUNIT)
    fig = {
        "figure": "vllm_vs_transformers_base",
        "device": "cuda",
        "mean": 0.0288,
        "tokens": 2048.0,
        "steps": [1, 2],
    }
    log = "noise\nGPU_FIGURE " + json.dumps(fig) + "\nGPU_FIGURE " + json.dumps(fig) + "\n"
    (tmp_path / "gpu_check.log").write_text(log)  # no gpu_figures.jsonl: figures come from the log, once each
    (tmp_path / "versions.txt").write_text("torch 2.11.0\n")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check_summary.py"), str(tmp_path), "--part", "1"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert out.startswith("# GPU check (part 1)") and "torch 2.11.0" in out
    assert "1 FAILED, 1 passed, 1 skipped" in out
    assert (
        "| `test_gpu_cli_runs::test_b[hf-merged]` | FAILED | 80.0 | AssertionError: exit 1 \\| see log |"
        in out
    )
    assert out.count("| vllm_vs_transformers_base | cuda | mean=0.0288, tokens=2048, steps=[1, 2] |") == 1
