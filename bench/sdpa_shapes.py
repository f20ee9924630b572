"""What a batch width the trainer has not seen before costs: the hf engine's LoRA update (TrainerRole.update, the
quickstart's settings: SmolLM2-135M shape with random weights, LoRA r16 on every linear layer, 32 rows, token TIS,
a 32768-token budget, so one pass) on a fixed sequence of 15 batches whose widths (prompt + response) come back or
are new, each update timed (and profiled with cProfile when it takes 2.5x the median of the earlier ones).

Why it exists: in the GPU quickstart's async runs (bench/results/trl_grpo-gpu-2026-12-04.md) a few updates took
1.5-2.2 s instead of 0.3 with the GPU idle: each at the first step whose responses all stopped before the length
limit, i.e. at a batch width not seen before. On an H200 (torch 2.11) such an update spends ~0.55 s in the 30
forward calls of scaled_dot_product_attention and ~0.6 s more in the backward, both on the host: torch's cuDNN
attention builds its plans per shape. `--no-cudnn-sdp` (torch.backends.cuda.enable_cudnn_sdp(False)) measures the
same updates on the other attention kernels; `--width-multiple N` (trainer.pass_width_multiple) the same updates
with each pass widened to a multiple of N columns (masked), so fewer distinct widths reach the attention.

    python bench/sdpa_shapes.py --device cuda [--no-cudnn-sdp] [--width-multiple 16] [--cuda-graphs --no-profile]
    python bench/sdpa_shapes.py --device cpu --layers 2 --no-save        # the CPU dry run (no cuDNN there)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PLAN = [(40, 48), (40, 48), (40, 47), (38, 40), (40, 48), (35, 30), (40, 48), (33, 20), (40, 48), (33, 12),
        (33, 12), (40, 48), (31, 9), (29, 26), (40, 48)]  # fmt: skip
"""(longest prompt, longest response) of each batch: rows draw their lengths below these (seeded)."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=None, help="keep the first N layers (default: all 30)")
    ap.add_argument("--no-cudnn-sdp", action="store_true", help="torch.backends.cuda.enable_cudnn_sdp(False)")
    ap.add_argument("--width-multiple", type=int, default=1, help="trainer.pass_width_multiple (default 1)")
    ap.add_argument("--cuda-graphs", action="store_true", help="trainer.cuda_graphs (engines/hf/graphs.py)")
    ap.add_argument(
        "--no-profile", action="store_true", help="no cProfile around the updates (it adds host time)"
    )
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    import torch
    import transformers

    from bench.common import report
    from bench.update_padding import save_model
    from rlbridge.batch import SeqBatch
    from rlbridge.recipe.schema import Recipe, round_width
    from rlbridge.trainer.role import TrainerRole

    if args.no_cudnn_sdp:
        torch.backends.cuda.enable_cudnn_sdp(False)
    cuda = args.device.startswith("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        save_model("smollm2-135m", args.layers, model)
        r = Recipe.model_validate(
            {
                "name": "sdpa-shapes",
                "model": {"path": str(model), "dtype": "bfloat16" if cuda else "float32"},
                "lora": {"rank": 16, "alpha": 32, "targets": ["all-linear"]},
                "trainer": {
                    "engine": "hf",
                    "optim": {"lr": 2e-4, "clip_grad": 1.0},
                    "micro_batch_size": 8,
                    "max_tokens_per_micro_batch": 32768,
                    "pass_width_multiple": args.width_multiple,
                    "cuda_graphs": args.cuda_graphs,
                },  # fmt: skip
                "rollout": {"n": 4, "max_response_tokens": 48},
                "algorithm": {
                    "name": "grpo",
                    "kl": {"coef": 0.0},
                    "rollout_correction": {"weights": "token"},
                },
                "reward": {"fn": "arithmetic"},
                "data": {"train": {"path": "builtin:arithmetic"}, "batch_size": 8},
                "cluster": {"device": "cuda" if cuda else "cpu"},
            }
        )
        trainer = TrainerRole(r, str(model))
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, attention "
        f"{trainer.engine.hf_model.config._attn_implementation}, cuDNN attention "  # type: ignore[attr-defined]
        f"{'on' if torch.backends.cuda.cudnn_sdp_enabled() else 'off'}",
        flush=True,
    )
    gen = torch.Generator().manual_seed(0)

    def batch(prompt_max: int, response_max: int) -> SeqBatch:
        prompts, responses = [], []
        for _ in range(32):
            p = int(torch.randint(max(4, prompt_max - 10), prompt_max + 1, (), generator=gen))
            n = int(torch.randint(max(1, response_max // 3), response_max + 1, (), generator=gen))
            prompts.append(torch.randint(0, 49000, (p,), generator=gen).tolist())
            responses.append(torch.randint(0, 49000, (n,), generator=gen).tolist())
        return SeqBatch.from_token_lists(prompts, responses, pad_id=0)

    rows: list[dict[str, Any]] = []
    seen: set[int] = set()
    for i, (prompt_max, response_max) in enumerate(PLAN):
        b = batch(prompt_max, response_max)
        adv = torch.randn(b.response_mask.shape, generator=gen) * b.response_mask
        logp = torch.where(b.response_mask > 0, -torch.rand(b.response_mask.shape, generator=gen), 0.0)
        prof = cProfile.Profile()
        start = time.perf_counter()
        if not args.no_profile:
            prof.enable()
        metrics = trainer.update(b, adv, logp, None)
        prof.disable()
        seconds = time.perf_counter() - start
        width = round_width(int(b.input_ids.shape[1]), args.width_multiple)  # the one pass's width
        rows.append({"update": i, "width": width, "response_width": b.response_width, "new_width": width not in seen,
                     "seconds": seconds, "graphed_passes": metrics.get("cuda_graph_passes")})  # fmt: skip
        print(f"update {i}: width {width} (response {b.response_width}){'' if width in seen else ', new'}: "
              f"{seconds:.3f} s", flush=True)  # fmt: skip
        if (
            i >= 2
            and not args.no_profile
            and seconds > 2.5 * statistics.median(row["seconds"] for row in rows[:-1])
        ):
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(4)
            print(text.getvalue()[:3000], flush=True)
        seen.add(width)
    later = rows[1:]  # the first update also starts the engine's kernels
    new = [row["seconds"] for row in later if row["new_width"]]
    again = [row["seconds"] for row in later if not row["new_width"]]
    result = {
        "device": args.device,
        "cudnn_sdp": bool(torch.backends.cuda.cudnn_sdp_enabled()),
        "width_multiple": args.width_multiple,
        "cuda_graphs": args.cuda_graphs,
        "all_s": sum(row["seconds"] for row in rows),
        "distinct_widths": len(seen),
        "torch": torch.__version__,
        "first_update_s": rows[0]["seconds"],
        "new_width_median_s": statistics.median(new),
        "seen_width_median_s": statistics.median(again),
    }
    report("sdpa_shapes", result, rows, save=not args.no_save)


if __name__ == "__main__":
    main()
