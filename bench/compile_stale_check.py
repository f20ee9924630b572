"""Does an hf engine with compiled decoder layers (each `layer.compile(dynamic=True)`, as bench/compile_layers.py
does) follow its weights as they train? The compiled engine takes optimizer steps (lr 5e-2) from LoRA B = 0, the
state its graphs are compiled in; after each, its log-probs and gradient are compared with an eager engine loaded
with the same trainable state. A graph that kept the weights of its first call would drift step by step.
Tiny random Llama (tests/fixtures/tiny_llama.py, 2 layers), LoRA rank 4, float32 and bfloat16, on --device.

Why it exists: in the one GPU loop run with compiled layers (bench/results/compile_loop-gpu-2026-12-03.md) the
trainer-vs-rollout log-prob gap grew from 0.025 to 0.07 over 14 steps, from the first step after a weight change,
while eager runs stay at 0.027-0.031; this check passes on CPU (float32: 4e-6 after every step) and has not run on a
GPU yet. A compiled trainer option comes back only after it passes there (reverted in the session of 2026-12-03).

    python bench/compile_stale_check.py --device cuda --steps 3     # scripts/gpu_bench.sh compilestale
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()
    import torch

    from rlbridge.algo.objective import LossInputs, make_loss_fn
    from rlbridge.batch import SeqBatch
    from rlbridge.engines.hf.engine import HFTrainEngine
    from rlbridge.recipe.schema import Recipe
    from tests.fixtures.spread import spread_lists
    from tests.fixtures.tiny_llama import build_tiny_llama

    model_dir = build_tiny_llama(Path(tempfile.mkdtemp()), num_hidden_layers=2)
    batch = SeqBatch.from_token_lists(*spread_lists(), pad_id=256)
    real = batch.response_mask > 0
    gen = torch.Generator().manual_seed(1)
    adv = torch.randn(batch.size, 1, generator=gen).expand(-1, batch.response_width) * batch.response_mask

    def recipe(dtype: str) -> Recipe:
        return Recipe.model_validate(
            {
                "name": "t",
                "model": {"path": str(model_dir), "dtype": dtype},
                "lora": {"rank": 4, "alpha": 8.0, "targets": ["all-linear"]},
                "trainer": {"optim": {"lr": 5e-2}, "micro_batch_size": 8},
                "rollout": {"n": 2, "max_response_tokens": 32},
                "reward": {"fn": "arithmetic"},
                "data": {"train": {"path": "builtin:arithmetic"}, "batch_size": 4},
                "cluster": {"device": "cuda" if args.device.startswith("cuda") else "cpu"},
            }
        )

    inputs = LossInputs(adv.to(args.device), batch.response_mask.to(args.device), None, None, None)
    algorithm = recipe("float32").algorithm  # the dtype changes the model only

    def loss() -> Any:
        return make_loss_fn(algorithm, inputs, norm_constant=32.0)

    for dtype in args.dtypes.split(","):
        torch._dynamo.reset()
        compiled = HFTrainEngine(recipe(dtype), model_dir, device=args.device)
        for layer in compiled.hf_model.model.layers:
            layer.compile(dynamic=True)
        eager = HFTrainEngine(recipe(dtype), model_dir, device=args.device)
        start = compiled.logprobs(batch).cpu()
        for step in range(args.steps + 1):
            if step:
                compiled.train_step(batch, loss(), num_micro_batches=1)
            eager.load_trainable_state(compiled.trainable_state())
            lc, le = compiled.logprobs(batch).cpu(), eager.logprobs(batch).cpu()
            gc = compiled.gradients(batch, loss(), num_micro_batches=1)
            ge = eager.gradients(batch, loss(), num_micro_batches=1)
            grad = max(float((gc[k] - g).abs().max() / g.abs().max().clamp_min(1e-30)) for k, g in ge.items())
            print(
                f"{dtype} step {step}: compiled vs eager |log p| max {float((lc - le).abs()[real].max()):.3g}, "
                f"gradient max rel {grad:.3g}; eager moved from the start by {float((le - start).abs()[real].max()):.3g}",
                flush=True,
            )


if __name__ == "__main__":
    main()
