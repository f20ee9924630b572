"""One training step of each trainer engine on CUDA (issue 14.2, item 4): hf (transformers + peft) and megatron
(Megatron-Bridge on one NCCL rank), SmolLM2-135M-Instruct, bfloat16, LoRA rank 8. Gates: the loss and the
gradient norm are finite (and the norm > 0), the step was not skipped, every trainable tensor changed, no
frozen tensor did (sum |w| of each, exactly). Each engine runs in a process of its own
(tests/gpu/train_step_job.py): a clean CUDA context and peak-memory counter, and megatron's compatibility layer
and process group stay out of the pytest process.

GPU time (estimate): hf ~15 s (imports, load, one step), megatron ~40-60 s (megatron-core + bridge imports,
build, one step). CPU dry run: ~1 min and ~3 min on 2 cores.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from tests.gpu.common import DRY_RUN, ROOT, P, figure, python, subprocess_env, time_left

pytestmark = [pytest.mark.timeout(1200 if DRY_RUN else 300)]
JOB = ROOT / "tests" / "gpu" / "train_step_job.py"


@pytest.mark.parametrize("engine", ["hf", "megatron"])
def test_one_step_moves_every_trainable_tensor_and_no_frozen_one(
    engine: str, model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "result.json"
    cmd = [
        python(),
        str(JOB),
        "--engine",
        engine,
        "--model-dir",
        str(model_dir),
        "--device",
        P.device,
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                          timeout=time_left(1100 if DRY_RUN else 240))  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    r = json.loads(out.read_text())
    figure(f"train_step_{engine}", **{k: v for k, v in r.items() if k not in ("unchanged", "frozen_changed")},
           num_unchanged=len(r["unchanged"]), num_frozen_changed=len(r["frozen_changed"]))  # fmt: skip
    assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0, r
    assert r["skipped"] == 0.0, r
    assert r["num_trainable"] > 0 and not r["unchanged"], r["unchanged"][:10]
    assert r["num_frozen"] > 0 and not r["frozen_changed"], r["frozen_changed"][:10]
