"""SDPAttention, the local spec's core attention on torch SDPA, against megatron-core's DotProductAttention.

The checks live in attention_check.py (the GPU machine runs the same script without pytest): float64 on
CPU, GQA and multi-head, rlbridge's padded mask, an exactly causal mask, no mask with a causal mask type,
softmax_scale with apply_query_key_layer_scaling; outputs and q/k/v gradients to max abs error < 1e-10;
dropout only in training mode; the layer spec's switch (RLBRIDGE_MEGATRON_ATTENTION).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent


def test_sdpa_attention_matches_dot_product_attention() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("RLBRIDGE_MEGATRON_ATTENTION", None)
    proc = subprocess.run(
        [sys.executable, str(HERE / "attention_check.py"), "--device", "cpu"],
        cwd=HERE.parents[1], env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ATTENTION_CHECK ")]
    assert lines, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads(lines[-1].split(" ", 1)[1])
    failed = [r for r in report["results"] if not r["ok"]]
    assert report["ok"] and not failed and proc.returncode == 0, json.dumps(failed, indent=1)
    names = {r["case"] for r in report["results"]}
    assert {"padded_gqa2", "causal_mask_gqa3", "no_mask_causal_type", "dropout", "layer_spec"} <= names
