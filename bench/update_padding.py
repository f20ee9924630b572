"""The update's throughput with and without compute on padding: the hf engine's train_step on one batch of
GSM8K-like lengths, the former layout (index-order micro-batches at the whole batch's width) against the
padding-free one (rows grouped by length, each micro-batch at its own widths: rlbridge/engines/micro.py),
in the same process, alternating step by step so that both see the same machine load.

The batch: `--batch` rows with prompt lengths uniform in [--prompt-min, --prompt-max] and response lengths
uniform in [--response-min, --response-max] (random ids, seeded), `--micro` micro-batches, the GRPO loss of
rlbridge.algo.objective (token-mean, random advantages, on-policy) under LoRA (`--lora-rank`, 0 = full
fine-tuning) on a random-weight model of bench/trainer_gpu.py's shapes (`--layers` keeps the first N layers:
the CPU run uses fewer to finish in minutes). tokens/s counts the real prompt + response tokens of a step
(what both layouts train on); `slots` counts the token positions the forward passes compute, padding
included; `head_positions` those the output layer runs on (rows x (response width + 1)), which dominate
with few layers and a large vocabulary (the CPU run). The two layouts give the same gradient
(tests/unit/engines/test_padding_free.py), so only time differs.

    python bench/update_padding.py [--model smollm2-135m] [--layers 30] [--device cpu|cuda]
        [--dtype float32|bfloat16] [--batch 16] [--micro 4] [--lora-rank 16] [--warmup 1] [--steps 3]
        [--max-tokens N]

`--engine megatron` times the megatron engine instead (one rank: NCCL on a GPU, gloo on the CPU; without
pipeline and context parallelism, as its budget needs). `--max-tokens N` adds a third layout: padding-free passes formed by a token budget of N
(trainer.max_tokens_per_micro_batch) instead of `--micro` passes of equal row counts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import one_rank_group, report  # noqa: E402
from bench.trainer_gpu import SHAPES  # noqa: E402


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """--model, --layers, --device, --dtype: the random-weight model of a one-engine bench (random_engine)."""
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="keep the first N layers (default: all)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 on cuda")


def add_batch_args(ap: argparse.ArgumentParser) -> None:
    """--batch, --samples, --lora-rank, the prompt and response length ranges, --warmup, --steps, --seed: the timed
    batch of a one-engine update bench (lengths_batch)."""
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument(
        "--samples",
        type=int,
        default=1,
        help="rows per prompt (GRPO's rollout.n): --batch / --samples prompts",
    )
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--prompt-min", type=int, default=60)
    ap.add_argument("--prompt-max", type=int, default=200)
    ap.add_argument("--response-min", type=int, default=20)
    ap.add_argument("--response-max", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)


def save_model(name: str, layers: int | None, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(SHAPES[name])
    archs = cfg.pop("architectures")
    if layers:
        cfg["num_hidden_layers"] = layers
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config.architectures = archs
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(out)


def lengths_batch(args: argparse.Namespace, vocab: int) -> Any:
    import torch

    from rlbridge.batch import SeqBatch

    gen = torch.Generator().manual_seed(args.seed)
    samples = getattr(args, "samples", 1)  # rows per prompt, each with its own response
    prompts: list[list[int]] = []
    responses = []
    for i in range(
        args.batch
    ):  # the draws in this order: the batches of --samples 1 are those of earlier results
        new = i % samples == 0
        if new:
            p = int(torch.randint(args.prompt_min, args.prompt_max + 1, (), generator=gen))
        r = int(torch.randint(args.response_min, args.response_max + 1, (), generator=gen))
        if new:
            prompt = torch.randint(0, vocab, (p,), generator=gen).tolist()
        prompts.append(prompt)
        responses.append(torch.randint(0, vocab, (r,), generator=gen).tolist())
    return SeqBatch.from_token_lists(prompts, responses, pad_id=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    add_batch_args(ap)
    ap.add_argument("--micro", type=int, default=4, help="number of micro-batches")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None, help="also time a token-budget layout")
    ap.add_argument("--engine", default="hf", choices=["hf", "megatron"])
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()

    import torch

    from rlbridge.algo.objective import LossInputs, make_loss_fn
    from rlbridge.engines.micro import micro_batch_rows

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    recipe, engine = random_engine(args, dtype, max(1, args.batch // 2), engine=args.engine)
    batch = lengths_batch(args, int(SHAPES[args.model]["vocab_size"]))
    gen = torch.Generator().manual_seed(args.seed + 1)
    adv = torch.randn(batch.size, 1, generator=gen).expand(-1, batch.response_width) * batch.response_mask
    inputs = LossInputs(adv, batch.response_mask, None, None, None)
    loss_fn = make_loss_fn(
        recipe.algorithm, inputs, norm_constant=float(args.response_max), micro_scale=float(args.micro)
    )
    real = int(batch.attention_mask.sum())
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    layouts = [
        ("padded (index order, full width)", False, recipe),
        ("padding-free (by length)", True, recipe),
    ]
    if args.max_tokens:
        trainer = recipe.trainer.model_copy(update={"max_tokens_per_micro_batch": args.max_tokens})
        budget = recipe.model_copy(update={"trainer": trainer})
        layouts.append((f"padding-free, token budget {args.max_tokens}", True, budget))
    times: dict[str, list[float]] = {name: [] for name, _, _ in layouts}
    cuda = args.device.startswith("cuda")
    peaks: dict[str, float] = {name: 0.0 for name, _, _ in layouts}  # GiB allocated at most, per layout
    for step in range(args.warmup + args.steps):
        for name, padding_free, layout_recipe in layouts:  # alternating: all see the same machine load
            engine.padding_free, engine.recipe = padding_free, layout_recipe
            if args.engine == "megatron":  # it reads its budget at construction: set it per layout
                engine.max_tokens = layout_recipe.trainer.max_tokens_per_micro_batch
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            metrics = engine.train_step(batch, loss_fn, num_micro_batches=args.micro)
            sync()
            if cuda:
                peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated() / 2**30)
            if step >= args.warmup:
                times[name].append(time.perf_counter() - start)
            assert metrics["skipped"] == 0.0, metrics
    rows = []
    for name, padding_free, layout_recipe in layouts:
        step_s = statistics.median(times[name])
        max_tokens = layout_recipe.trainer.max_tokens_per_micro_batch
        groups = micro_batch_rows(batch, args.micro, by_length=padding_free, max_tokens=max_tokens)
        subs = [batch.select(g).trimmed() if padding_free else batch.select(g) for g in groups]
        computed = sum(sub.input_ids.numel() for sub in subs)
        head = sum(sub.size * (sub.response_width + 1) for sub in subs)
        rows.append(
            {
                "layout": name,
                "step_s": step_s,
                "tokens_per_s": real / step_s,
                "speedup": times_ratio(times, layouts[0][0], name),
                "passes": len(groups),
                "slots": computed,
                "padding_share": 1.0 - real / computed,
                "head_positions": head,
                "peak_gib": peaks[name],  # torch.cuda.max_memory_allocated over its steps (0 on the CPU)
            }
        )
    result = {
        "config": vars(args) | {"dtype": dtype},
        "real_tokens": real,
        "batch_width": int(batch.input_ids.shape[1]),
        "step_times_s": times,
        "speedup": rows[1]["speedup"],
        "slot_ratio": rows[0]["slots"] / rows[1]["slots"],
    }
    device = "cuda" if args.device.startswith("cuda") else "cpu"
    report(f"update_padding-{device}", result, rows, save=not args.no_save)
    for row in rows[1:]:
        print(
            f"{row['layout']} / padded tokens/s: {row['speedup']:.2f}x "
            f"({rows[0]['slots'] / row['slots']:.2f}x fewer positions)"
        )


def bench_recipe(
    model_dir: Path, dtype: str, *, lora_rank: int, response_max: int, batch_size: int,
    engine: str = "hf", device: str = "cpu", micro_batch_size: int | None = None,
) -> Any:  # fmt: skip
    """The recipe of a one-engine bench on a saved model: GRPO (token-mean), lr 1e-5, LoRA on every linear
    layer with alpha 2 x rank (none at rank 0); also used by bench/pass_cost.py."""
    from rlbridge.recipe.schema import Recipe

    trainer: dict[str, Any] = {"optim": {"lr": 1e-5}}
    if micro_batch_size is not None:
        trainer["micro_batch_size"] = micro_batch_size
    raw: dict[str, Any] = {
        "name": "bench",
        "model": {"path": str(model_dir), "dtype": dtype},
        "trainer": trainer,
        "rollout": {"n": 2, "max_response_tokens": response_max},
        "reward": {"fn": "arithmetic"},
        "data": {"train": {"path": "builtin:arithmetic"}, "batch_size": batch_size},
        "algorithm": {"name": "grpo", "loss_agg": "token-mean"},
    }
    if lora_rank:
        raw["lora"] = {"rank": lora_rank, "alpha": 2.0 * lora_rank, "targets": ["all-linear"]}
    if engine == "megatron":
        trainer["engine"] = "megatron"
        raw["cluster"] = {"device": "cuda" if device.startswith("cuda") else "cpu"}
    return Recipe.model_validate(raw)


def random_engine(
    args: argparse.Namespace, dtype: str, batch_size: int, *, engine: str = "hf"
) -> tuple[Any, Any]:
    """(recipe, engine) of a one-engine bench on random weights of `args.model`'s shape (`args.layers`,
    `args.lora_rank`, `args.response_max`, `args.device`); the model's files are gone once the engine is built."""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        save_model(args.model, args.layers, model_dir)
        recipe = bench_recipe(
            model_dir, dtype, lora_rank=args.lora_rank, response_max=args.response_max,
            batch_size=batch_size, engine=engine, device=args.device,
        )  # fmt: skip
        return recipe, bench_engine(recipe, model_dir, args.device)


def bench_engine(recipe: Any, model_dir: Path, device: str) -> Any:
    """The recipe's engine on one device: the hf engine, or the megatron engine on a one-rank group."""
    if recipe.trainer.engine == "megatron":
        from rlbridge.engines.megatron.engine import MegatronTrainEngine

        one_rank_group(recipe.cluster.device == "cuda")
        return MegatronTrainEngine(recipe, total_steps=10**6)
    from rlbridge.engines.hf.engine import HFTrainEngine

    return HFTrainEngine(recipe, model_dir, device=device, total_steps=10**6)


def times_ratio(times: dict[str, list[float]], base: str, name: str) -> float:
    """Median step time of `base` over that of `name`: how many times faster `name` trains."""
    return statistics.median(times[base]) / statistics.median(times[name])


if __name__ == "__main__":
    main()
