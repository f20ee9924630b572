"""The hf engine's update in packed passes against padded ones (trainer.packed_passes, issue 47 item 3): one
engine of each layout on the same random weights and the same batch, `train_step` timed alternately.

- padded: the default layout under a token budget (rlbridge/engines/micro.py): rows sorted by length, passes of at
  most `--max-tokens` computed positions, each trimmed to its widths, SDPA with the padding mask;
- packed: `trainer.packed_passes: true` (rlbridge/engines/hf/varlen.py): each pass's real tokens as one row,
  varlen attention over the rows' boundaries (torch's varlen_attn on CUDA, one SDPA per row on the CPU), passes of
  at most `--max-tokens` real tokens;
- packed-shared (with `--samples` > 1 rows per prompt): packed passes with `trainer.shared_prompts: always`, each
  distinct prompt's tokens once per pass, its rows' responses attending to them (varlen.shared_layout).
The padded engine keeps `trainer.shared_prompts: auto` (shared prompts on a CPU where they save positions), the
packed one `never`.

Before timing, the check: each packed engine's log-probs of the batch and their gradients of one GRPO loss (the engine's
`gradients`, no step) against the padded engine's. The batch: `--batch` rows with prompt and response lengths uniform in
their ranges (bench/update_padding.py's, random ids, seeded), random weights of bench/trainer_gpu.py's shapes, LoRA
on every linear layer (`--lora-rank`, 0 = full fine-tuning), the GRPO token-mean loss of random advantages.

    python bench/packed_passes.py [--model smollm2-135m] [--layers N] [--device cuda] [--batch 512] [--samples 8]
        [--max-tokens 32768] [--lora-rank 16] [--warmup 1] [--steps 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.trainer_gpu import SHAPES  # noqa: E402
from bench.update_padding import (  # noqa: E402
    add_batch_args,
    add_model_args,
    bench_engine,
    bench_recipe,
    lengths_batch,
    save_model,
)


def engines(args: argparse.Namespace, dtype: str) -> dict[str, Any]:
    """The layouts' engines of the same random weights, all under the token budget `args.max_tokens`: padded
    (trainer.shared_prompts auto: shared prompts on a CPU), packed (no sharing) and, with --samples > 1,
    packed-shared (trainer.shared_prompts always: each distinct prompt once per packed pass)."""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        save_model(args.model, args.layers, model_dir)
        base = bench_recipe(
            model_dir, dtype, lora_rank=args.lora_rank, response_max=args.response_max,
            batch_size=max(1, args.batch // 2), device=args.device,
        )  # fmt: skip
        layouts = {"padded": (False, "auto"), "packed": (True, "never")}
        if args.samples > 1:
            layouts["packed-shared"] = (True, "always")
        out = {}
        for name, (packed, sharing) in layouts.items():
            trainer = base.trainer.model_copy(
                update={
                    "max_tokens_per_micro_batch": args.max_tokens,
                    "packed_passes": packed,
                    "shared_prompts": sharing,
                }
            )
            out[name] = bench_engine(base.model_copy(update={"trainer": trainer}), model_dir, args.device)
    padded = out["padded"]
    if args.lora_rank:  # B = 0 would leave A's gradient 0: nothing to compare
        import torch

        gen = torch.Generator().manual_seed(1)
        state = {
            n: torch.randn(t.shape, generator=gen) * 0.02 if "lora_B" in n else t
            for n, t in padded.trainable_state().items()
        }
        for engine in out.values():
            engine.load_trainable_state(state)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    add_batch_args(ap)
    ap.add_argument("--max-tokens", type=int, default=32768)
    ap.add_argument("--out", type=Path, default=None, help="folder for packed_passes.json")
    args = ap.parse_args(argv)

    import torch

    from rlbridge.algo.objective import LossInputs, make_loss_fn
    from rlbridge.engines.micro import budget_rows

    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    layouts = engines(args, dtype)
    padded = layouts["padded"]
    batch = lengths_batch(args, int(SHAPES[args.model]["vocab_size"]))
    gen = torch.Generator().manual_seed(args.seed + 1)
    adv = torch.randn(batch.size, 1, generator=gen).expand(-1, batch.response_width) * batch.response_mask
    loss_fn = make_loss_fn(
        padded.recipe.algorithm,
        LossInputs(adv, batch.response_mask, None, None, None),
        norm_constant=float(args.response_max),
        micro_scale=1.0,
    )
    # the check: each packed layout's log-probs and gradients against the padded ones (before any step)
    lp_padded = padded.logprobs(batch)
    g_padded = padded.gradients(batch, loss_fn, num_micro_batches=1)
    check = {}
    for name, engine in layouts.items():
        if engine is padded:
            continue
        g = engine.gradients(batch, loss_fn, num_micro_batches=1)
        check[name] = {
            "logprob_max_abs": float((engine.logprobs(batch) - lp_padded).abs().max()),
            "grad_max_rel": max(
                float((g[k].double() - w.double()).abs().max() / w.double().abs().max().clamp(min=1e-30))
                for k, w in g_padded.items()
            ),
        }
        del g
    del g_padded
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times: dict[str, list[float]] = {name: [] for name in layouts}
    peaks = dict.fromkeys(layouts, 0.0)
    for k in range(args.warmup + args.steps):
        for name, engine in layouts.items():  # alternating: both see the same machine load
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            metrics = engine.train_step(batch, loss_fn, num_micro_batches=1)
            sync()
            if k >= args.warmup:
                times[name].append(time.perf_counter() - start)
            if cuda:
                peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated() / 2**30)
            assert metrics["skipped"] == 0.0, metrics
    real = int(batch.attention_mask.sum())
    padded_groups = budget_rows(batch, args.max_tokens)
    result = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()} | {"dtype": dtype},
        "device_name": torch.cuda.get_device_name() if cuda else "cpu",
        "real_tokens": real,
        "padded_positions": sum(batch.select(g).trimmed().input_ids.numel() for g in padded_groups),
        "passes": {
            "padded": len(padded_groups),
            "packed": len(budget_rows(batch, args.max_tokens, packed=True)),
        },
        "step_times_s": times,
        "step_s_median": {n: statistics.median(t) for n, t in times.items()},
        "tokens_per_s": {n: real / statistics.median(t) for n, t in times.items()},
        "speedup_packed": statistics.median(times["padded"]) / statistics.median(times["packed"]),
        "speedup_vs_padded": {
            n: statistics.median(times["padded"]) / statistics.median(t)
            for n, t in times.items()
            if n != "padded"
        },
        "peak_gib": peaks,
        "check": check,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "packed_passes.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
