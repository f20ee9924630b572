"""`rlbridge train recipes/moe-lora-cpu.yaml`: GRPO + LoRA (attention and every expert) on the tiny random Qwen3-MoE
with the megatron engine (1 CPU rank) and transformers rollouts, merged sync, driven by the loop (docs/moe.md).

Asserted: every step trained (grad norm > 0, nothing skipped) and passed the first-step gate, which checks each
expert the router sent tokens to; the float32 trainer's log-probs equal the rollout's (mean |diff| < 1e-5, max
< 1e-4; measured 1.2-2.0e-6 / 5.7e-6-1.1e-5) after every merged sync, so each expert's delta reached the rollout.
The comparison with the dense model of the same size, and in
bfloat16, is bench/moe_logprob_gap.py (figures in docs/moe.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_grpo_on_the_tiny_moe(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "RLBRIDGE_CACHE": str(tmp_path / "cache"),
        "PYTHONWARNINGS": "ignore",
        "COLUMNS": "200",
    }
    run_dir = tmp_path / "run"
    start = time.time()
    res = subprocess.run(
        [sys.executable, "-m", "rlbridge", "train", "recipes/moe-lora-cpu.yaml", "--set", "run.steps=3"]
        + ["--run-dir", str(run_dir)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=480,
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    print(f"rlbridge train moe-lora-cpu (3 steps): {time.time() - start:.0f} s")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    for r in train:
        assert r["skipped"] == 0 and r["grad_norm"] > 0, r
        assert r["logprob_diff_mean"] < 1e-5 and r["logprob_diff_max"] < 1e-4, r
    check_exports(run_dir, env, tmp_path)


def check_exports(run_dir: Path, env: dict[str, str], tmp_path: Path) -> None:
    """export-hf of the megatron run (a CPU process, no Megatron): every expert's merged weight equals a float64
    merge of the checkpoint's Megatron LoRA (base + alpha / rank x B @ A, fc1's B rows [gate; up]); the adapter-only
    export loads in peft (experts as packed target_parameters) with the merged export's logits."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = {}
    for kind in ("merge-lora", "adapter-only"):
        out[kind] = tmp_path / kind
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "rlbridge",
                "export-hf",
                str(run_dir),
                "--out",
                str(out[kind]),
                f"--{kind}",
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    ckpt = sorted((run_dir / "checkpoints").iterdir())[-1]
    lora = load_file(str(ckpt / "trainable.safetensors"))
    base_dir = Path(env["RLBRIDGE_CACHE"]) / "models" / "tiny-qwen3-moe-smoke"
    base = load_file(str(base_dir / "model.safetensors"))
    merged = load_file(str(out["merge-lora"] / "model.safetensors"))
    scale = 16 / 8  # recipes/moe-lora-cpu.yaml: alpha 16, rank 8
    worst = 0.0
    for layer in (0, 1):
        for e in range(4):
            m = f"decoder.layers.{layer}.mlp.experts.local_experts.{e}."
            h = f"model.layers.{layer}.mlp.experts.{e}."
            fc1 = (
                scale
                * lora[m + "linear_fc1.adapter.linear_out.weight"].double()
                @ lora[m + "linear_fc1.adapter.linear_in.weight"].double()
            )
            fc2 = (
                scale
                * lora[m + "linear_fc2.adapter.linear_out.weight"].double()
                @ lora[m + "linear_fc2.adapter.linear_in.weight"].double()
            )
            half = fc1.shape[0] // 2
            for name, delta in (("gate_proj", fc1[:half]), ("up_proj", fc1[half:]), ("down_proj", fc2)):
                key = f"{h}{name}.weight"
                assert float(delta.abs().max()) > 0, key  # the expert trained
                worst = max(worst, float((merged[key].double() - base[key].double() - delta).abs().max()))
    assert worst < 1e-6, worst  # measured 1.5e-8
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    model = AutoModelForCausalLM.from_pretrained(out["merge-lora"], dtype=torch.float32).eval()
    adapted = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), str(out["adapter-only"])
    ).eval()
    with torch.no_grad():
        ref, got = model(ids).logits, adapted(ids).logits
    assert float((got - ref).norm() / ref.norm()) < 1e-5  # measured 9.3e-7


def test_routing_replay_through_the_cli(tmp_path: Path) -> None:
    """`--set rollout.routing_replay=true` in bfloat16: the transformers rollout records every position's experts,
    the megatron trainer replays them in each forward (tests/megatron/test_megatron_moe.py checks the replay
    itself against transformers'), and the run trains."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RLBRIDGE_CACHE": str(tmp_path / "cache")}
    env.update(PYTHONWARNINGS="ignore", COLUMNS="200")
    run_dir = tmp_path / "run"
    sets = ["rollout.routing_replay=true", "model.dtype=bfloat16", "run.steps=2"]
    sets += ["run.health.max_logprob_diff=null", "data.val=null"]  # bf16 gap > the recipe's float32 limit
    cmd = [sys.executable, "-m", "rlbridge", "train", "recipes/moe-lora-cpu.yaml", "--run-dir", str(run_dir)]
    res = subprocess.run(
        cmd + [x for s in sets for x in ("--set", s)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, (res.stdout + res.stderr)[-6000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert r["skipped"] == 0 and r["grad_norm"] > 0, r
        assert r["routing_replayed"] > r["tokens"], r  # prompt and response positions
