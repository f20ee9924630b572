"""trainer.compile (rlbridge/engines/hf.py compile_layers): the hf engine's decoder layers under torch.compile give the
eager engine's log-probs and gradients, on a tiny Llama (CPU, float32, LoRA rank 4 on every linear layer, the
spread batch of tests/unit/test_padding_free.py in 3 passes grouped by length: three shapes through one graph).

Tolerances: log-probs atol 1e-5 (measured 4.8e-6), gradients within 1e-5 of each tensor's largest entry
(measured 2.0e-6: inductor fuses and reorders float32 sums). That the layers really ran compiled is checked too
(dynamo's frame counter moves, and a graph-breaking edit would show as more frames), so eager code behind the option
cannot pass. The compile costs ~40 s of this test on 2 cores (one graph for the training pass, one more for the
no-gradient log-prob pass); the GPU figures are in bench/results/compile_layers-gpu-2026-12-03.md and
tests/gpu/test_gpu_train_step.py checks bf16 on the device.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch

from rlbridge.algo.objective import LossInputs, make_loss_fn
from rlbridge.batch import SeqBatch
from rlbridge.engines.hf import HFTrainEngine, compile_layers
from rlbridge.errors import RlbridgeError
from rlbridge.recipe.schema import Recipe
from tests.fixtures.spread import spread_lists
from tests.fixtures.tiny_llama import build_tiny_llama

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny"), num_hidden_layers=3)


def recipe(model_dir: Path, compiled: bool) -> Recipe:
    return Recipe.model_validate(
        {
            "name": "t",
            "model": {"path": str(model_dir), "dtype": "float32"},
            "lora": {"rank": 4, "alpha": 8.0, "targets": ["all-linear"]},
            "trainer": {"compile": compiled, "micro_batch_size": 3, "optim": {"lr": 1e-2}},
            "rollout": {"n": 2, "max_response_tokens": 32},
            "data": {"train": {"path": "builtin:arithmetic"}, "batch_size": 4},
            "algorithm": {"name": "grpo", "entropy_coef": 0.01},
            "cluster": {"device": "cpu"},
        }
    )


def run(model_dir: Path, compiled: bool) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    batch = SeqBatch.from_token_lists(*spread_lists(), pad_id=256)
    r = recipe(model_dir, compiled)
    eng = HFTrainEngine(r, model_dir)
    gen = torch.Generator().manual_seed(1)  # B != 0, so the adapters change the forward
    eng.load_trainable_state(
        {
            n: torch.randn(t.shape, generator=gen) * 0.2 if "lora_B" in n else t
            for n, t in eng.trainable_state().items()
        }
    )
    adv = torch.randn(batch.size, 1, generator=gen).expand(-1, batch.response_width) * batch.response_mask
    inputs = LossInputs(adv, batch.response_mask, None, None, None)
    frames = counters["frames"]["ok"]
    logp = eng.logprobs(batch)
    grads = eng.gradients(batch, make_loss_fn(r.algorithm, inputs, norm_constant=32.0), num_micro_batches=3)
    frames = counters["frames"]["ok"] - frames
    metrics = eng.train_step(
        batch, make_loss_fn(r.algorithm, inputs, norm_constant=32.0), num_micro_batches=3
    )
    return {
        "logp": logp,
        "grads": {k: v.clone() for k, v in grads.items()},
        "frames": frames,
        "metrics": metrics,
        "names": sorted(eng.hf_model.state_dict()),
        "adapter": sorted(eng.export_weights("adapter").tensors),
        "after": eng.trainable_state(),
    }


def test_compiled_layers_match_eager(model_dir: Path) -> None:
    eager, compiled = run(model_dir, False), run(model_dir, True)
    assert eager["frames"] == 0
    # one graph for every layer in each grad mode: more would mean graph breaks (or a graph per layer)
    assert 1 <= compiled["frames"] <= 4, compiled["frames"]
    real = SeqBatch.from_token_lists(*spread_lists(), pad_id=256).response_mask > 0
    assert float((eager["logp"] - compiled["logp"]).abs()[real].max()) <= 1e-5
    for name, g in eager["grads"].items():
        scale = float(g.abs().max())
        assert scale > 0, name
        assert float((compiled["grads"][name] - g).abs().max()) <= 1e-5 * scale, name
    assert compiled["metrics"]["skipped"] == 0.0
    assert abs(compiled["metrics"]["loss"] - eager["metrics"]["loss"]) <= 1e-5
    # parameter and export names are the eager model's: checkpoints and weight sync are unchanged
    assert compiled["names"] == eager["names"] and compiled["adapter"] == eager["adapter"]
    for name, w in eager["after"].items():
        assert torch.allclose(compiled["after"][name], w, atol=1e-5, rtol=1e-4), name


def test_compile_refuses_moe_and_layerless_models() -> None:
    moe = types.SimpleNamespace(config=types.SimpleNamespace(num_experts=8))
    with pytest.raises(RlbridgeError, match="not for MoE models"):
        compile_layers(moe)  # type: ignore[arg-type]
    plain = torch.nn.Linear(2, 2)
    plain.config = types.SimpleNamespace()  # type: ignore[assignment]
    with pytest.raises(RlbridgeError, match="found no decoder layer in Linear"):
        compile_layers(plain)  # type: ignore[arg-type]
