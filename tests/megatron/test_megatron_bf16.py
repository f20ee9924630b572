"""bfloat16 numerics of the megatron engine (TP1, tiny Qwen2, CPU gloo): megatron-core's mixed-precision
optimizer keeps float32 main weights and float32 Adam moments for a bfloat16 model, the output layer returns
unrounded float32 logits (forward.float32_output_layer) and log-softmax runs in float32
(forward.vocab_parallel_logprobs).

Tolerances: three full fine-tuning steps at lr 1e-4 move the bfloat16 engine's float32 main weights like the
float32 engine's weights, relative error of the whole update < 0.3 (the hf engine's test measures 0.17 for
the same check; bf16 gradients differ and Adam's first steps are about lr * sign(g)); bf16 log-probs vs a
float64 HF forward: mean |diff| < 0.05, max < 0.3 (bf16 rounding of weights and activations).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hf_reference import load_hf, response_logprobs_f64, seq_batch

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def runs(tiny_dirs: dict[str, str], run_workers: Any) -> dict[str, dict[str, Any]]:
    return {
        dtype: run_workers("precision_suite", 1, qwen=tiny_dirs["qwen2"], dtype=dtype)[0]
        for dtype in ("float32", "bfloat16")
    }


def update(res: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {n: res["main_after"][n].double() - t.double() for n, t in res["main_before"].items()}


def test_bf16_model_has_float32_main_weights_and_moments(runs: dict[str, dict[str, Any]]) -> None:
    bf16 = runs["bfloat16"]
    print(
        "optimizers:", bf16["optimizers"], "model:", bf16["model_dtypes"], "moments:", bf16["moment_dtypes"]
    )
    assert bf16["optimizers"] == ["Float16OptimizerWithFloat16Params"]
    assert bf16["model_dtypes"] == ["torch.bfloat16"]
    assert {str(t.dtype) for t in bf16["main_after"].values()} == {"torch.float32"}
    assert bf16["num_states"] == len(bf16["main_after"]) and bf16["moment_dtypes"] == ["torch.float32"]
    assert runs["float32"]["optimizers"] == ["FP32Optimizer"]


def test_bf16_tiny_lr_steps_move_like_float32(runs: dict[str, dict[str, Any]]) -> None:
    assert all(s["skipped"] == 0.0 for r in runs.values() for s in r["steps"])
    d16, d32 = update(runs["bfloat16"]), update(runs["float32"])
    assert d16.keys() == d32.keys()
    err = (
        sum(float((d16[n] - d32[n]).norm()) ** 2 for n in d32)
        / sum(float(d.norm()) ** 2 for d in d32.values())
    ) ** 0.5
    print(f"bf16 main-weight update vs float32: rel error {err:.3f}")
    assert err < 0.3


def test_bf16_logprobs_are_float32_and_near_float64(
    runs: dict[str, dict[str, Any]], tiny_dirs: dict[str, str]
) -> None:
    res = runs["bfloat16"]
    batch = seq_batch(res["batch_ragged"])
    got = res["logprobs"]
    assert got.dtype == torch.float32
    diff = (got.double() - response_logprobs_f64(load_hf(tiny_dirs["qwen2"]), batch)).abs()[
        batch.response_mask > 0
    ]
    print(f"bf16 log-probs vs float64 HF: mean {float(diff.mean()):.2e} max {float(diff.max()):.2e}")
    assert float(diff.mean()) < 0.05 and float(diff.max()) < 0.3


def test_bf16_output_layer_returns_unrounded_float32_logits(runs: dict[str, dict[str, Any]]) -> None:
    """bf16 input x bf16 weight, multiplied in float32: equal to the float64 product up to float32 summation."""
    res = runs["bfloat16"]
    assert res["head_dtype"] == "torch.float32"
    torch.testing.assert_close(res["head_out"].double(), res["head_exact"], rtol=1e-5, atol=1e-5)
    assert not torch.equal(res["head_out"], res["head_out"].bfloat16().float())  # not rounded to bfloat16
