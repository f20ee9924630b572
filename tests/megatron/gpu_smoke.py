"""The megatron engine on GPUs without Transformer Engine (NCCL), for the GPU machine's library versions.

    torchrun --nproc_per_node N tests/megatron/gpu_smoke.py [--tp T] [--pp P] [--dtype bfloat16]
    torchrun --nproc_per_node 1 tests/megatron/gpu_smoke.py --suite recompute

Tolerances: float32 as the CPU tests (logits vs HF rel. < 1e-5, log-probs vs float64 HF max abs < 1e-4,
merged / peft exports vs trainer logits rel. < 1e-4). bfloat16 (the megatron model in bf16 with fp32 main
weights, against float32 HF on the float32 checkpoint, so weight rounding counts too): logits and exports
rel. < 3e-2, log-probs max abs < 0.1 (CPU bf16 run: 1.5e-2, 0.024).

Prints one JSON line per check from rank 0 and exits 1 if a check fails. Not collected by pytest (the GPU
machine has no pytest); it reuses the CPU tests' workers and HF references.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]


def main() -> int:
    args = argparse.ArgumentParser()
    args.add_argument("--tp", type=int, default=1)
    args.add_argument("--pp", type=int, default=1)
    args.add_argument("--suite", choices=["layout", "recompute"], default="layout")
    args.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    opts = args.parse_args()
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    workdir = Path(os.environ.get("SMOKE_DIR", tempfile.gettempdir())) / "rlbridge_gpu_smoke"
    if rank == 0:
        from conftest import _save_tiny

        workdir.mkdir(parents=True, exist_ok=True)
        _save_tiny(workdir / "qwen2", "qwen2")
    dist.barrier()
    import megatron_workers as W
    from hf_reference import load_hf, logits, peft_model, rel, response_logprobs_f64, seq_batch

    from rlbridge.engines.megatron import compat

    start = time.time()
    if opts.suite == "recompute":
        got = W.recompute_suite(str(workdir / "qwen2"))
        worst = {k: max(rel(got[k][n], got["plain"][n]) for n in got["plain"]) for k in ("uniform", "block")}
        unfixed = max(float(g.abs().sum()) for g in got["unfixed"].values())
        ok = worst["uniform"] < 1e-5 and worst["block"] < 1e-5 and unfixed == 0.0 and got["uniform_fix"]
        print(json.dumps({"worst_rel": worst, "unfixed_grad_sum": unfixed, "ok": ok}), flush=True)
        dist.destroy_process_group()
        return 0 if ok else 1
    res = W.layout_suite(str(workdir / "qwen2"), tp=opts.tp, pp=opts.pp, export=True, dtype=opts.dtype)
    results = {
        "versions": compat.versions(),
        "features": repr(compat.features()),
        "seconds": time.time() - start,
    }
    ok = True
    if rank == 0:
        cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in res.items()}
        hf = load_hf(str(workdir / "qwen2"))
        full, ragged = seq_batch(cpu["batch_full"]), W.ragged_batch()
        checks = {
            "logits_vs_hf": rel(cpu["logits_init"].float(), logits(hf, full)),
            "logprobs_vs_f64": float(
                (cpu["logprobs_init"].double() - response_logprobs_f64(hf, ragged)).abs().max()
            ),
            "sets_equal": float(not cpu["sets_equal"]),
            "steps_skipped": sum(s["skipped"] for s in cpu["steps"]),
            "merged_vs_trainer": rel(
                logits(load_hf(str(workdir / "qwen2"), state=cpu["merged"]), full),
                cpu["logits_trained"].cpu(),
            ),
            "peft_vs_trainer": rel(
                logits(
                    peft_model(str(workdir / "qwen2"), cpu["adapter"], cpu["adapter_config"], workdir / "ad"),
                    full,
                ),
                cpu["logits_trained"].cpu(),
            ),
        }
        limits = {
            "logits_vs_hf": 1e-5,
            "logprobs_vs_f64": 1e-4,
            "merged_vs_trainer": 1e-4,
            "peft_vs_trainer": 1e-4,
        }
        if opts.dtype == "bfloat16":
            limits = {"logits_vs_hf": 3e-2, "logprobs_vs_f64": 0.1, "merged_vs_trainer": 3e-2, "peft_vs_trainer": 3e-2}
        ok = all(checks[k] < limits.get(k, 0.5) for k in checks)
        results.update(checks=checks, limits=limits, ok=ok, tp=opts.tp, pp=opts.pp, dtype=opts.dtype)
        print(json.dumps(results), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
