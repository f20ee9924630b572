"""The CPU quickstart's update at its shape, float32 against bfloat16, with the top operators of one profiled step.

The batch is the CPU quickstart's: SmolLM2-135M's shape (random weights), LoRA r16 on every linear layer, 8 prompts
of 50-56 tokens x 4 responses of 10-48 tokens (rows of a prompt share it: the hf engine's shared-prompt layout),
the whole batch in one pass, 2 threads, rlbridge's CPU allocator settings expected in the environment. Per variant,
in a process of its own (`--variant`), `--steps` updates after one untimed step: wall seconds, page faults, kernel
seconds, then one step under torch.profiler (operators by self CPU time). Also a bare matrix product per dtype
(the quickstart's largest linear shape) for the machine's float32 and bfloat16 peak.

    MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1099511627776 \\
        python bench/cpu_update_dtype.py [--steps 3]

`PREFAULT_GIB=N` in the environment first touches N GiB of the process's heap (malloc, one write per page, free)
and prints its seconds: how much of the first update is the first touch of its memory.

Variants: float32; bfloat16 as the hf engine runs it on a CPU (PyTorch's math SDPA kernel,
engines/hf/model.math_sdpa_attention); bfloat16 with transformers' plain sdpa attention (PyTorch's default kernel
choice on a CPU: its flash-attention kernel).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import report  # noqa: E402

VARIANTS = {
    "float32": ("float32", "engine"),
    "bfloat16": ("bfloat16", "engine"),
    "bfloat16, default sdpa kernel": ("bfloat16", "sdpa"),
}


def matmul_gflops(dtype: Any, threads: int) -> float:
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(2048, 576, dtype=dtype), torch.randn(576, 1536, dtype=dtype)
    for _ in range(3):
        a @ b
    start, n = time.perf_counter(), 50
    for _ in range(n):
        a @ b
    return 2 * 2048 * 576 * 1536 * n / (time.perf_counter() - start) / 1e9


def one_variant(name: str, steps: int, threads: int) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.trainer_gpu import SHAPES
    from bench.update_padding import bench_engine, bench_recipe, save_model
    from rlbridge.algo.objective import LossInputs, make_loss_fn
    from rlbridge.batch import SeqBatch

    dtype, attention = VARIANTS[name]
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    vocab = int(SHAPES["smollm2-135m"]["vocab_size"])
    prompts, responses = [], []
    for _ in range(8):
        prompt = torch.randint(
            0, vocab, (int(torch.randint(50, 57, (), generator=gen)),), generator=gen
        ).tolist()
        for _ in range(4):
            length = int(torch.randint(10, 49, (), generator=gen))
            prompts.append(prompt)
            responses.append(torch.randint(0, vocab, (length,), generator=gen).tolist())
    batch = SeqBatch.from_token_lists(prompts, responses, pad_id=0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        save_model("smollm2-135m", None, model_dir)
        recipe = bench_recipe(
            model_dir, dtype, lora_rank=16, response_max=48, batch_size=8, micro_batch_size=32
        )
        engine = bench_engine(recipe, model_dir, "cpu")
    if attention == "sdpa":
        engine.hf_model.set_attn_implementation("sdpa")
    adv = torch.randn(batch.size, 1, generator=gen).expand(-1, batch.response_width) * batch.response_mask
    inputs = LossInputs(adv, batch.response_mask, None, None, None)
    loss_fn = make_loss_fn(recipe.algorithm, inputs, norm_constant=48.0, micro_scale=1.0)

    prefault = float(os.environ.get("PREFAULT_GIB", "0"))
    if prefault:
        t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        block = torch.empty(int(prefault * 2**30), dtype=torch.uint8)
        block[::4096] = 1
        del block
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        print(
            f"prefault {prefault} GiB: {time.perf_counter() - t0:.2f} s, {r1.ru_minflt - r0.ru_minflt} faults",
            file=sys.stderr,
        )
    runs = []
    for _ in range(steps + 1):
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        engine.train_step(batch, loss_fn, num_micro_batches=1)
        after = resource.getrusage(resource.RUSAGE_SELF)
        runs.append(
            {
                "wall_s": time.perf_counter() - start,
                "kernel_s": after.ru_stime - before.ru_stime,
                "page_faults": after.ru_minflt - before.ru_minflt,
            }
        )
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.train_step(batch, loss_fn, num_micro_batches=1)
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
    return {
        "variant": name,
        "steps": runs,
        "maxrss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "real_response_tokens": int(batch.response_mask.sum()),
        "response_positions": batch.size * batch.response_width,
        "top_ops_self_s": {e.key: e.self_cpu_time_total / 1e6 for e in ops},
        "matmul_gflops": matmul_gflops(getattr(torch, dtype), threads),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3, help="timed steps after one untimed")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variant", choices=list(VARIANTS), help="run one variant here and print its JSON")
    ap.add_argument("--no-save", action="store_true")
    a = ap.parse_args()
    if a.variant:
        print("RESULT " + json.dumps(one_variant(a.variant, a.steps, a.threads)))
        return
    results = []
    for name in VARIANTS:
        cmd = [
            sys.executable,
            __file__,
            "--variant",
            name,
            "--steps",
            str(a.steps),
            "--threads",
            str(a.threads),
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=os.environ).stdout
        results.append(json.loads(next(line[7:] for line in out.splitlines() if line.startswith("RESULT "))))
    rows = [
        {
            "variant": r["variant"],
            "first_step_s": round(r["steps"][0]["wall_s"], 2),
            "first_step_faults": r["steps"][0]["page_faults"],
            "update_s_median": round(statistics.median(s["wall_s"] for s in r["steps"][1:]), 2),
            "max_rss_gib": round(r["maxrss_gib"], 2),
            "top_op": max(r["top_ops_self_s"].items(), key=lambda kv: kv[1])[0][:48],
            "top_op_s": round(max(r["top_ops_self_s"].values()), 2),
            "matmul_gflops": round(r["matmul_gflops"]),
        }
        for r in results
    ]
    env = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    report(
        "cpu_update_dtype-cpu",
        {"config": vars(a), "malloc_env": env, "raw": results},
        rows,
        save=not a.no_save,
    )


if __name__ == "__main__":
    main()
