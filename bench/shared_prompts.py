"""The hf engine's update and log-prob pass with each distinct prompt run once per pass (trainer.shared_prompts
always) against the plain passes (never), on a GRPO-shaped batch: `--prompts` prompts x `--n` responses, in the
same process, alternating step by step so that both see the same machine load.

Prompt lengths uniform in [--prompt-min, --prompt-max], response lengths uniform in [--response-min,
--response-max] (random ids, seeded), `--micro` micro-batches (or passes by `--max-tokens`), the GRPO loss
(token-mean, random advantages, on-policy) under LoRA (`--lora-rank`, 0 = full fine-tuning) on a random-weight
model of bench/trainer_gpu.py's shapes. tokens/s counts the real prompt + response tokens of every row (what
the plain passes train on); `positions` counts the positions the passes compute (padding included). Both
layouts give the same log-probs and gradients (tests/unit/engines/test_shared_prompts.py), so only time differs.

    python bench/shared_prompts.py [--model smollm2-135m] [--device cpu|cuda] [--prompts 8] [--n 4]
        [--prompt-min 40] [--prompt-max 56] [--response-min 8] [--response-max 48] [--micro 4]
        [--max-tokens N] [--steps 3]
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
from bench.trainer_gpu import SHAPES  # noqa: E402
from bench.update_padding import add_model_args, random_engine  # noqa: E402


def grpo_batch(args: argparse.Namespace, vocab: int) -> Any:
    import torch

    from rlbridge.batch import SeqBatch

    gen = torch.Generator().manual_seed(args.seed)
    prompts, responses = [], []
    for _ in range(args.prompts):
        p = int(torch.randint(args.prompt_min, args.prompt_max + 1, (), generator=gen))
        prompt = torch.randint(0, vocab, (p,), generator=gen).tolist()
        for _ in range(args.n):
            r = int(torch.randint(args.response_min, args.response_max + 1, (), generator=gen))
            prompts.append(prompt)
            responses.append(torch.randint(0, vocab, (r,), generator=gen).tolist())
    return SeqBatch.from_token_lists(prompts, responses, pad_id=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--micro", type=int, default=4, help="number of micro-batches")
    ap.add_argument("--max-tokens", type=int, default=None, help="passes by a token budget instead")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--prompt-min", type=int, default=40)
    ap.add_argument("--prompt-max", type=int, default=56)
    ap.add_argument("--response-min", type=int, default=8)
    ap.add_argument("--response-max", type=int, default=48)
    ap.add_argument("--logprob-chunk", type=int, default=4, help="trainer.logprob_chunk_size")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()

    import torch

    from rlbridge.algo.objective import LossInputs, make_loss_fn
    from rlbridge.engines.hf import shared_prompts
    from rlbridge.engines.micro import micro_batch_rows

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    base, engine = random_engine(args, dtype, args.prompts)
    batch = grpo_batch(args, int(SHAPES[args.model]["vocab_size"]))
    gen = torch.Generator().manual_seed(args.seed + 1)
    adv = torch.randn(batch.size, 1, generator=gen).expand(-1, batch.response_width) * batch.response_mask
    loss_fn = make_loss_fn(
        base.algorithm,
        LossInputs(adv, batch.response_mask, None, None, None),
        norm_constant=float(args.response_max),
        micro_scale=float(args.micro),
    )
    layouts = {}
    for mode in ("never", "always"):
        trainer = base.trainer.model_copy(
            update={
                "shared_prompts": mode,
                "max_tokens_per_micro_batch": args.max_tokens,
                "logprob_chunk_size": args.logprob_chunk,
            }
        )
        layouts[mode] = base.model_copy(update={"trainer": trainer})
    real = int(batch.attention_mask.sum())
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times: dict[str, dict[str, list[float]]] = {m: {"update": [], "logprobs": []} for m in layouts}
    peaks = {m: 0.0 for m in layouts}
    for step in range(args.warmup + args.steps):
        for mode, recipe in layouts.items():  # alternating: both see the same machine load
            engine.recipe = recipe
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            sync()
            start = time.perf_counter()
            metrics = engine.train_step(batch, loss_fn, num_micro_batches=args.micro)
            sync()
            mid = time.perf_counter()
            engine.logprobs(batch)
            sync()
            end = time.perf_counter()
            assert metrics["skipped"] == 0.0, metrics
            if cuda:
                peaks[mode] = max(peaks[mode], torch.cuda.max_memory_allocated() / 2**30)
            if step >= args.warmup:
                times[mode]["update"].append(mid - start)
                times[mode]["logprobs"].append(end - mid)
    plain_groups = micro_batch_rows(batch, args.micro, max_tokens=args.max_tokens)
    shared_groups = shared_prompts.grouped_rows(batch, args.micro, max_tokens=args.max_tokens)
    _, prompt_of = shared_prompts.prompt_index(batch)
    prompt_len, response_len = shared_prompts.widths(batch)
    positions = {
        "never": shared_prompts.plain_positions(plain_groups, prompt_len, response_len),
        "always": sum(
            shared_prompts.shared_positions(g.tolist(), prompt_of, prompt_len, response_len)
            for g in shared_groups
        ),
    }
    passes = {"never": len(plain_groups), "always": len(shared_groups)}
    rows = []
    for mode in layouts:
        update_s = statistics.median(times[mode]["update"])
        logprobs_s = statistics.median(times[mode]["logprobs"])
        rows.append(
            {
                "layout": "plain passes (never)" if mode == "never" else "shared prompts (always)",
                "update_s": update_s,
                "update_tokens_per_s": real / update_s,
                "logprobs_s": logprobs_s,
                "passes": passes[mode],
                "positions": positions[mode],
                "peak_gib": peaks[mode],
            }
        )
    speedup = rows[0]["update_s"] / rows[1]["update_s"]
    result = {
        "config": vars(args) | {"dtype": dtype},
        "real_tokens": real,
        "times_s": times,
        "update_speedup": speedup,
        "logprobs_speedup": rows[0]["logprobs_s"] / rows[1]["logprobs_s"],
        "position_ratio": positions["never"] / positions["always"],
    }
    device = "cuda" if cuda else "cpu"
    report(f"shared_prompts-{device}", result, rows, save=not args.no_save)
    print(
        f"shared / plain: update {speedup:.2f}x, log-probs {result['logprobs_speedup']:.2f}x "
        f"({result['position_ratio']:.2f}x fewer positions)"
    )


if __name__ == "__main__":
    main()
