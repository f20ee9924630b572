"""One training step of a trainer engine, in a process of its own (test_gpu_train_step.py starts it).

    python tests/gpu/train_step_job.py --engine hf|megatron --model-dir DIR --device cuda|cpu --out RESULT.json
        [--moe]   # the model is a mixture of experts (tiny-qwen3-moe-smoke): LoRA on every expert too; before the
                  # step, the engine's log-probs of the batch against transformers float32 (`gap`); experts the
                  # router sent no token may stay unchanged

SmolLM2-135M-Instruct, bfloat16, LoRA rank 8 on every projection, the fixed TEXTS of tests/gpu/common.py as
the batch (prompt + answer; loss on the answer tokens: mean negative log-prob, a small entropy bonus). Before
the step the adapters' B matrices (zero at init, so A would get no gradient on a first step) are set to small
random values, as after some training; then one `train_step` must move every trainable tensor and no frozen
one. The megatron engine gets a one-rank process group first (NCCL on CUDA, gloo on the CPU), as
trainer/group.py gives each rank; a process of its own also keeps megatron's compatibility layer out
of the pytest process. Writes the result as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tests.gpu.common import TEXTS, fixed_sequences  # noqa: E402

LORA_RANK = 8
B_STD = 1e-3


def build(engine_name: str, model_dir: str, device: str) -> tuple[Any, Any]:
    from rlbridge.recipe.schema import Recipe

    recipe = Recipe.model_validate({
        "name": "gpu-train-step", "model": {"path": model_dir, "dtype": "bfloat16"},
        "lora": {"rank": LORA_RANK, "alpha": 2 * LORA_RANK},
        "trainer": {"engine": engine_name, "micro_batch_size": 4, "optim": {"lr": 1e-4, "clip_grad": 1.0}},
        "reward": {"fn": "arithmetic"}, "data": {"train": {"path": "unused.jsonl"}, "batch_size": 1}, "run": {"steps": 10},
        "cluster": {"device": device},
        "algorithm": {"entropy_coef": 1e-3},  # the loss's entropy bonus below: trained, not a metric
    })  # fmt: skip
    if device == "cuda":
        torch.cuda.set_device(0)
    if engine_name == "hf":
        from rlbridge.engines.hf.engine import HFTrainEngine

        return HFTrainEngine(recipe, Path(model_dir), device=device), recipe
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)  # fmt: skip
    from rlbridge.engines.megatron.engine import MegatronTrainEngine

    return MegatronTrainEngine(recipe), recipe


def is_lora_b(name: str) -> bool:
    return "lora_B" in name or ".linear_out." in name  # peft / Megatron-Bridge


def reference_gap(
    engine: Any, batch: Any, rows: list[tuple[list[int], list[int]]], model_dir: str
) -> dict[str, float]:
    """The engine's log-probs of the batch (its dtype, its device) against transformers float32 on the CPU."""
    from tests.gpu.common import gap, load_hf

    lp = engine.logprobs(batch).float().cpu()
    got = [lp[i, : len(a)].tolist() for i, (_, a) in enumerate(rows)]
    return gap(load_hf(model_dir), [p for p, _ in rows], [a for _, a in rows], got)


def run(engine_name: str, model_dir: str, device: str, moe: bool = False) -> dict[str, Any]:
    from rlbridge.batch import SeqBatch
    from rlbridge.model.tokenizer import load_tokenizer

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    engine, _ = build(engine_name, model_dir, device)
    sync()
    build_s = time.perf_counter() - t0
    tok = load_tokenizer(Path(model_dir))
    rows = fixed_sequences(tok, len(TEXTS))
    batch = SeqBatch.from_token_lists([p for p, _ in rows], [a for _, a in rows], pad_id=tok.pad_token_id)

    gen = torch.Generator().manual_seed(4)
    state = engine.trainable_state()
    engine.load_trainable_state({k: (B_STD * torch.randn(v.shape, generator=gen)).to(v.device, v.dtype)
                                 if is_lora_b(k) else v for k, v in state.items()})  # fmt: skip
    ref_gap = reference_gap(engine, batch, rows, model_dir) if moe else None
    start = {k: v.detach().clone() for k, v in engine.trainable_state().items()}
    frozen = engine.frozen_fingerprint()

    def loss_fn(
        logp: torch.Tensor, entropy: torch.Tensor, rows: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        mask = batch.response_mask[rows].to(logp.device)
        n = mask.sum().clamp(min=1)
        loss = -(logp * mask).sum() / n - 1e-3 * (entropy * mask).sum() / n
        return loss, {"loss": float(loss.detach())}

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    metrics = engine.train_step(batch, loss_fn, num_micro_batches=2)
    sync()
    step_s = time.perf_counter() - t0
    book = engine.moe if moe else None
    routed = {f"{k[0]}.{k[1]}": int(v) for k, v in book.routed_tokens().items()} if book is not None else {}
    now = engine.trainable_state()
    frozen_after = engine.frozen_fingerprint()
    unchanged = sorted(k for k, v in now.items() if torch.equal(v, start[k]))
    moved_frozen = sorted(k for k, v in frozen_after.items() if v != frozen.get(k))
    # how far the step moved the adapters (relative L2, over all of them): a sanity figure, not a gate
    moved = math.sqrt(sum(float((now[k].double() - start[k].double()).norm() ** 2) for k in now))
    norm = math.sqrt(sum(float(start[k].double().norm() ** 2) for k in start))
    return {
        "engine": engine_name, "device": device, "loss": float(metrics.get("loss", float("nan"))),
        "grad_norm": float(metrics["grad_norm"]), "skipped": float(metrics.get("skipped", 0.0)),
        "num_trainable": len(now), "trainable_params": sum(v.numel() for v in now.values()),
        "num_frozen": len(frozen), "unchanged": unchanged, "frozen_changed": moved_frozen,
        "relative_update": moved / max(norm, 1e-30), "tokens": int(batch.response_mask.sum()),
        "build_s": build_s, "step_s": step_s,
        "peak_gib": torch.cuda.max_memory_allocated() / 1024**3 if cuda else 0.0,
        "dtypes": sorted({str(v.dtype).split(".")[-1] for v in now.values()}),
        **({"reference_gap": ref_gap, "routed_tokens": routed} if moe else {}),
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["hf", "megatron"], required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--device", choices=["cuda", "cpu"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--moe", action="store_true")
    args = ap.parse_args()
    result = run(args.engine, args.model_dir, args.device, moe=args.moe)
    Path(args.out).write_text(json.dumps(result, indent=1))
    if args.engine == "megatron":
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
