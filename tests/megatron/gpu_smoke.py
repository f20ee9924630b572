"""The megatron engine on GPUs without Transformer Engine (NCCL), for the GPU machine's library versions.

    torchrun --nproc_per_node N tests/megatron/gpu_smoke.py [--tp T] [--pp P] [--dtype bfloat16]
    torchrun --nproc_per_node 1 tests/megatron/gpu_smoke.py --suite recompute
    torchrun --nproc_per_node N tests/megatron/gpu_smoke.py --suite mbridge [--arch llama] [--tp T] [--pp P]

`--suite mbridge`: trainer.bridge=mbridge, full fine-tuning, float32 (megatron_workers.mbridge_suite, the CPU
test's checks): logits vs HF, trainable == optimizer == grad-buffer parameters, two steps with finite non-zero
gradient norms, merged export names and logits. Needs mbridge on the path (the shared pack_site.sh leaves it out:
`EXTRA="mbridge==0.15.1" bash ../shared/gpu/pack_site.sh`, or its pure-Python wheel on PYTHONPATH); on megatron-core
>= 0.17 it exercises compat.mbridge_model_type(). Passed on one H200 at TP1, qwen2 and llama (2026-12-01).

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
    args.add_argument("--suite", choices=["layout", "recompute", "mbridge"], default="layout")
    args.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args.add_argument(
        "--arch", choices=["qwen2", "llama"], default="qwen2", help="--suite mbridge: llama is tied"
    )
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
        _save_tiny(workdir / "llama", "llama")
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
    if opts.suite == "mbridge":
        ok = mbridge_check(str(workdir / opts.arch), opts.arch, opts.tp, opts.pp, rank, start)
        dist.barrier()
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
            limits = {
                "logits_vs_hf": 3e-2,
                "logprobs_vs_f64": 0.1,
                "merged_vs_trainer": 3e-2,
                "peft_vs_trainer": 3e-2,
            }
        ok = all(checks[k] < limits.get(k, 0.5) for k in checks)
        results.update(checks=checks, limits=limits, ok=ok, tp=opts.tp, pp=opts.pp, dtype=opts.dtype)
        print(json.dumps(results), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


def mbridge_check(model_dir: str, arch: str, tp: int, pp: int, rank: int, start: float) -> bool:
    """trainer.bridge=mbridge on this rank's GPU; rank 0 prints the checks. True when they pass (or not rank 0)."""
    import megatron_workers as W
    import torch
    from hf_reference import load_hf, logits, rel, seq_batch

    from rlbridge.engines.megatron import compat

    res = W.mbridge_suite(model_dir, tp=tp, pp=pp)
    if rank != 0:
        return True
    import mbridge.core.util

    cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in res.items()}
    hf = load_hf(model_dir)
    batch = seq_batch(cpu["batch_full"])
    merged = {k: v.cpu() for k, v in cpu["merged"].items()}
    expected = set(hf.state_dict()) - ({"lm_head.weight"} if arch == "llama" else set())
    checks = {
        "logits_vs_hf": rel(cpu["logits_init"].float(), logits(hf, batch)),
        "merged_vs_trainer": rel(logits(load_hf(model_dir, state=merged), batch), cpu["logits"].float()),
        "param_sets_differ": float(len(set(cpu["sets"].values())) != 1),
        "bad_steps": float(sum(s["skipped"] != 0.0 or not s["grad_norm"] > 0 for s in cpu["steps"])),
        "merged_names_differ": float(set(merged) != expected),
    }
    limits = {"logits_vs_hf": 1e-5, "merged_vs_trainer": 1e-4}
    ok = all(checks[k] < limits.get(k, 0.5) for k in checks)
    print(
        json.dumps(
            {
                "suite": "mbridge",
                "arch": arch,
                "tp": tp,
                "pp": pp,
                "versions": compat.versions(),
                "model_type_stand_in": not isinstance(
                    mbridge.core.util.ModelType, type
                ),  # compat's, not the enum
                "sets": cpu["sets"],
                "grad_norms": [s["grad_norm"] for s in cpu["steps"]],
                "checks": checks,
                "limits": limits,
                "ok": ok,
                "seconds": time.time() - start,
            }
        ),
        flush=True,
    )
    return ok


if __name__ == "__main__":
    sys.exit(main())
