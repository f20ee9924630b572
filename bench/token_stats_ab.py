"""The hf engine's update on a CPU with the log-prob/entropy pass of engines/hf/token_stats.py against autograd's
`gather - logsumexp` + softmax entropy (the former code), alternating step by step in one process, with the
process's page faults and kernel time per step. Run it twice to see the allocator's part: once plainly, once
with the glibc settings rlbridge gives its CPU workers (cluster/ray_cluster.CPU_MALLOC):

    python bench/token_stats_ab.py [--steps 3] [--batch 32] [--micro 4]
    MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1099511627776 python bench/token_stats_ab.py

The batch: the CPU quickstart's shape (SmolLM2-135M shape with random weights, float32, LoRA r16 on every
linear layer, 32 rows, prompts 50-56 and responses 10-48 tokens, 4 padding-free micro-batches). The first
round is a warm-up (not timed)."""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import report  # noqa: E402
from bench.trainer_gpu import SHAPES  # noqa: E402
from bench.update_padding import bench_engine, bench_recipe, lengths_batch, save_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()

    import torch

    from rlbridge.algo.objective import LossInputs, make_loss_fn
    from rlbridge.engines.hf import engine as hf
    from rlbridge.engines.hf.token_stats import logprobs_and_entropy, token_entropy, token_logprobs

    torch.set_num_threads(args.threads)

    def autograd_stats(logits: Any, ids: Any) -> tuple[Any, Any]:
        logp = token_logprobs(logits, ids)
        with torch.no_grad():
            return logp, token_entropy(logits)

    shape = argparse.Namespace(
        batch=args.batch, prompt_min=50, prompt_max=56, response_min=10, response_max=48, seed=0
    )
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        save_model("smollm2-135m", None, model_dir)
        recipe = bench_recipe(model_dir, "float32", lora_rank=16, response_max=48, batch_size=args.batch // 2)
        engine = bench_engine(recipe, model_dir, "cpu")
    engine.padding_free = True
    batch = lengths_batch(shape, int(SHAPES["smollm2-135m"]["vocab_size"]))
    gen = torch.Generator().manual_seed(1)
    adv = torch.randn(batch.size, 1, generator=gen).expand(-1, batch.response_width) * batch.response_mask
    inputs = LossInputs(adv, batch.response_mask, None, None, None)
    loss_fn = make_loss_fn(recipe.algorithm, inputs, norm_constant=48.0, micro_scale=float(args.micro))
    variants = {"autograd (former)": autograd_stats, "token_stats": logprobs_and_entropy}
    seen: dict[str, list[tuple[float, float, int]]] = {name: [] for name in variants}
    for step in range(args.steps + 1):
        for name, fn in variants.items():
            hf.logprobs_and_entropy = fn  # what HFTrainEngine._micro_step calls
            before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            engine.train_step(batch, loss_fn, num_micro_batches=args.micro)
            wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
            if step:
                seen[name].append(
                    (wall, after.ru_stime - before.ru_stime, after.ru_minflt - before.ru_minflt)
                )
    hf.logprobs_and_entropy = logprobs_and_entropy
    rows = [
        {
            "variant": name,
            "update_s": statistics.median(w for w, _, _ in runs),
            "kernel_s": statistics.median(k for _, k, _ in runs),
            "page_faults": int(statistics.median(f for _, _, f in runs)),
        }
        for name, runs in seen.items()
    ]
    import os

    env = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    result = {"config": vars(args), "malloc_env": env, "raw": seen}
    report("token_stats_ab-cpu", result, rows, save=not args.no_save)


if __name__ == "__main__":
    main()
