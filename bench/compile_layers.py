"""The hf engine's training step with its decoder layers compiled (torch.compile, one layer at a time) against
eager, in one process on the same batches: is the host-bound LoRA pass (bench/pass_cost.py: ~39k dispatched
operators, ~0.26 s on an H200 whatever its size) cheaper once compiled, and what does compiling cost?

Per mode: the first steps' seconds (the gradient check's pass, then one step per batch shape: compilation,
with a recompile per new shape unless --dynamic), then the median of `--steps` timed steps cycling over the
`--shapes` batches, and the gradient of one batch against eager's (max |difference| / max |eager|). A
random-weight model of bench/trainer_gpu.py's shapes (`--layers` keeps the first N), LoRA `--lora-rank` on every
linear layer (0: full fine-tuning), `--batch` rows of prompt [--prompt-min, --prompt-max] and response
[--response-min, --response-max] tokens, one pass per step (the token budget of recipes/quickstart-gpu.yaml), the
GRPO loss (token-mean, random advantages, on-policy). CPU, 2 layers, 4 rows: gradients 7e-7 relative to eager's.

    python bench/compile_layers.py [--device cuda] [--modes eager,default] [--batch 32] [--steps 6] [--shapes 3]
        [--model smollm2-135m] [--layers N] [--lora-rank 16] [--dynamic] [--no-save]

Modes: eager; default (inductor); reduce-overhead (inductor + CUDA graphs); max-autotune-no-cudagraphs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import report  # noqa: E402
from bench.update_padding import add_model_args, lengths_batch, random_engine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--modes", default="eager,default")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-min", type=int, default=30)
    ap.add_argument("--prompt-max", type=int, default=60)
    ap.add_argument("--response-min", type=int, default=8)
    ap.add_argument("--response-max", type=int, default=48)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--shapes", type=int, default=3, help="distinct batches (shapes) cycled over")
    ap.add_argument(
        "--dynamic", action="store_true", help="torch.compile(dynamic=True): no recompile per shape"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()

    import torch

    from rlbridge.algo.objective import LossInputs, make_loss_fn

    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    recipe, engine = random_engine(args, dtype, args.batch)
    cuda = args.device.startswith("cuda")
    vocab = engine.hf_model.config.vocab_size
    batches = []
    for i in range(args.shapes):
        args.seed = i
        batches.append(lengths_batch(args, vocab))

    def loss_fn(batch: Any) -> Any:
        gen = torch.Generator().manual_seed(1)
        adv = torch.randn(batch.size, 1, generator=gen).expand(batch.size, batch.response_width).contiguous()
        inputs = LossInputs(
            adv_bt=adv, mask_bt=batch.response_mask, old_logp_bt=None, ref_logp_bt=None, rollout_logp_bt=None
        )
        return make_loss_fn(recipe.algorithm, inputs, norm_constant=float(args.response_max))

    def timed(fn: Any) -> tuple[float, Any]:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start, out

    def step(batch: Any) -> float:
        return timed(lambda: engine.train_step(batch, loss_fn(batch), num_micro_batches=1))[0]

    start = engine.trainable_state()  # each mode's gradient check starts from the same weights
    reference = None
    rows: list[dict[str, Any]] = []
    for mode in args.modes.split(","):
        torch._dynamo.reset()
        layers = engine.hf_model.model.layers
        compile_s = 0.0
        if mode != "eager":
            options: dict[str, Any] = {"dynamic": True if args.dynamic else None}
            if mode != "default":
                options["mode"] = mode
            for layer in layers:
                layer.compile(**options)
        else:
            for layer in layers:
                layer._compiled_call_impl = None
        engine.load_trainable_state(start)
        # compiles the first shape: timed, and counted in the compile cost
        grads_s, grads = timed(lambda: engine.gradients(batches[0], loss_fn(batches[0]), num_micro_batches=1))
        grads = {k: v.detach().float().cpu() for k, v in grads.items()}
        first = [step(b) for b in batches]  # compiles (one shape each) or warms up
        times = [step(batches[i % len(batches)]) for i in range(args.steps)]
        if reference is None:
            reference = grads
        diff = max(float((grads[k] - reference[k]).abs().max()) for k in reference)
        scale = max(float(reference[k].abs().max()) for k in reference)
        median = statistics.median(times)
        compile_s = grads_s + sum(first) - median * (len(first) + 1)
        row = {
            "mode": mode,
            "first_steps_s": [round(t, 3) for t in [grads_s, *first]],
            "compile_s": round(compile_s, 1),
            "step_s_median": round(median, 4),
            "step_s_min": round(min(times), 4),
            "grad_max_rel_diff": diff / max(scale, 1e-30),
        }
        rows.append(row)
        print(row, flush=True)
    base = next((r["step_s_median"] for r in rows if r["mode"] == "eager"), None)
    for row in rows:
        row["eager_over_mode"] = None if base is None else round(base / row["step_s_median"], 2)
    settings = {k: v for k, v in vars(args).items() if k not in ("no_save", "seed")}
    tokens = [int(b.attention_mask.sum()) for b in batches]
    report(
        "compile_layers",
        {
            "settings": settings,
            "dtype": dtype,
            "tokens_per_batch": tokens,
            "versions": {"torch": torch.__version__},
        },
        rows,
        save=not args.no_save,
    )


if __name__ == "__main__":
    main()
