"""What one training pass costs the host: the hf engine's pass against plain transformers + peft on the same rows.

At 512 rollouts the in-loop update on an H200 took 16.6 s in 64 passes of 8 rows and 1.5 s in 6 passes of a
32768-token budget (bench/results/inloop-gpu-2026-12-02.md): each pass costs ~0.26 s whatever its size, so the
passes are host-bound. This bench counts what a pass dispatches and times it, for

- `engine`: HFTrainEngine.train_step over `--passes` micro-batches (forward, loss closure with its metrics,
  backward; its one optimizer step is spread over the passes), and
- `plain`: the same model (peft under LoRA), the same micro-batches: forward, log-probs of the response tokens,
  a sum, backward. What the engine adds is the difference.

Per pass: wall ms (median of `--steps` after one warm-up), aten operators dispatched (torch.profiler, nested
ones included), and on CUDA the kernels launched and their summed GPU time (busy = kernel time / wall). A
random-weight model of bench/trainer_gpu.py's shapes (`--layers` keeps the first N), `--dtype` (default
float32 on cpu, bfloat16 on cuda: peft's float32 adapters on a 16-bit base add a cast per adapted module),
`--rows` rows of prompt 30 and response `--response` tokens per pass.

    python bench/pass_cost.py [--model smollm2-135m] [--layers 30] [--device cpu|cuda] [--dtype ...]
        [--lora-rank 16] [--rows 8] [--response 76] [--passes 8] [--steps 3] [--no-save]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import report  # noqa: E402
from bench.trainer_gpu import SHAPES  # noqa: E402
from bench.update_padding import bench_engine, bench_recipe, save_model  # noqa: E402


def profile(fn: Callable[[], None], passes: int, cuda: bool) -> dict[str, float]:
    """Operators and kernels of one call of `fn` (which runs `passes` passes), per pass."""
    import torch
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    out = {"aten_ops": sum(e.count for e in events if e.key.startswith("aten::")) / passes}
    if cuda:
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        out["kernels"] = len(kernels) / passes
        out["kernel_ms"] = sum(e.device_time_total for e in kernels) / 1000 / passes
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--response", type=int, default=76)
    ap.add_argument("--passes", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()

    import torch

    from rlbridge.algo.objective import LossInputs, make_loss_fn
    from rlbridge.batch import SeqBatch
    from rlbridge.engines.hf.token_stats import response_logits, token_logprobs
    from rlbridge.engines.micro import forward_batch, micro_batch_rows

    cuda = args.device.startswith("cuda")
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        save_model(args.model, args.layers, model_dir)
        recipe = bench_recipe(
            model_dir, dtype, lora_rank=args.lora_rank, response_max=args.response,
            batch_size=args.rows * args.passes // 2, micro_batch_size=args.rows,
        )  # fmt: skip
        engine = bench_engine(recipe, model_dir, args.device)
    vocab = int(SHAPES[args.model]["vocab_size"])
    gen = torch.Generator().manual_seed(0)
    n = args.rows * args.passes
    prompts = [torch.randint(0, vocab, (30,), generator=gen).tolist() for _ in range(n)]
    responses = [torch.randint(0, vocab, (args.response,), generator=gen).tolist() for _ in range(n)]
    batch = SeqBatch.from_token_lists(prompts, responses, pad_id=0)
    adv = torch.randn(n, 1, generator=gen).expand(-1, batch.response_width) * batch.response_mask
    # the loop always passes the rollout's log-probs (the mismatch metrics are part of a pass)
    rollout = torch.full((n, batch.response_width), -2.0) * batch.response_mask
    inputs = LossInputs(adv, batch.response_mask, None, None, rollout)
    loss_fn = make_loss_fn(
        recipe.algorithm, inputs, norm_constant=float(args.response), micro_scale=float(args.passes)
    )
    groups = micro_batch_rows(batch, args.passes, by_length=True, max_tokens=None)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def engine_step() -> None:
        engine.train_step(batch, loss_fn, num_micro_batches=args.passes)

    def plain_step() -> None:
        engine.model.train()
        for rows in groups:
            sub = forward_batch(batch, rows, engine.device, trim=True)
            logp = token_logprobs(response_logits(engine.model, sub), sub.response_ids)
            ((logp * sub.response_mask).sum() / 1000).backward()
        engine.optimizer.zero_grad(set_to_none=True)

    rows_out = []
    for name, fn in (("plain", plain_step), ("engine", engine_step)):
        times = []
        for step in range(1 + args.steps):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            if step:
                times.append(time.perf_counter() - start)
        wall_ms = statistics.median(times) / args.passes * 1000
        row: dict[str, Any] = {"pass": name, "wall_ms": wall_ms, **profile(fn, args.passes, cuda)}
        if cuda:
            row["gpu_busy"] = row["kernel_ms"] / wall_ms
        rows_out.append(row)
    plain, eng = rows_out
    result = {
        "config": vars(args) | {"dtype": dtype},
        "engine_over_plain_wall": eng["wall_ms"] / plain["wall_ms"],
        "engine_over_plain_ops": eng["aten_ops"] / plain["aten_ops"],
    }
    report(f"pass_cost-{'cuda' if cuda else 'cpu'}", result, rows_out, save=not args.no_save)


if __name__ == "__main__":
    main()
