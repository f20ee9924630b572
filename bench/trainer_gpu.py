"""Trainer throughput and memory on one GPU: the megatron engine against the hf engine, LoRA and full FT.

Same GPU, same random-weight model, same batch, same loss for every row: `--batch` sequences of
`--prompt` + `--response` tokens (no padding), `--micro` sequences per micro-batch, bfloat16, no activation
recompute, one optimizer step per `train_step`. The loss is the response tokens' mean negative log-prob
plus a small entropy term (both engines compute log-probs and entropies as in GRPO). Shapes:

    smollm2-135m  Llama, 30 layers, hidden 576, 9 heads / 3 KV heads, vocab 49152, tied embeddings
    qwen2.5-0.5b  Qwen2, 24 layers, hidden 896, 14 heads / 2 KV heads, vocab 151936, tied, q/k/v biases

What differs by design, and shows in the numbers: the megatron engine keeps fp32 main weights, gradients
and Adam moments (megatron-core's mixed-precision optimizer); the hf engine runs torch AdamW on the bf16
weights. The hf engine's output layer runs on the response positions only (`logits_to_keep`); megatron's
on every position. Megatron runs the local (no Transformer Engine) layer spec with unfused attention; hf
runs PyTorch SDPA.

Each configuration runs in its own process (clean peak-memory counters, one megatron parallel state), up
to one process per visible GPU at a time. Timing: `--warmup` steps, then `--steps` timed steps
(torch.cuda.synchronize around each); tokens/s counts all prompt + response tokens of a step. Memory:
peak allocated during the timed steps (weights, gradients, optimizer state and activations), and
allocated after the engine was built.

    python bench/trainer_gpu.py [--models smollm2-135m,qwen2.5-0.5b] [--batch 8] [--prompt 512]
        [--response 512] [--micro 4] [--steps 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         max_position_embeddings=8192, tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0),
    "qwen2.5-0.5b": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=32768, tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1000000.0),
    # for checking this script on a machine without a GPU (CPU, gloo; memory columns are 0 there)
    "tiny": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                 max_position_embeddings=512, tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1000000.0),
}
GIB = 1024**3


def save_model(name: str, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(SHAPES[name])
    archs = cfg.pop("architectures")
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config.architectures = archs
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)


# ----------------------------------------------------------------------------------------------- job
def run_job(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from rlbridge.batch import SeqBatch
    from rlbridge.recipe.schema import Recipe

    lora = spec["mode"] == "lora"
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    recipe = Recipe.model_validate({
        "name": "bench", "model": {"path": spec["model_dir"], "dtype": "bfloat16"},
        "lora": {"rank": 16 if lora else 0, "alpha": 32, "targets": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]},
        "trainer": {"engine": spec["engine"], "micro_batch_size": spec["micro"], "optim": {"lr": 1e-5, "clip_grad": 1.0}},
        "data": {"train": {"path": "unused.jsonl"}, "batch_size": 1}, "run": {"steps": 1000},
        "cluster": {"device": "cuda" if cuda else "cpu"},
    })  # fmt: skip
    if cuda:
        torch.cuda.set_device(0)
    start = time.perf_counter()
    if spec["engine"] == "megatron":
        import torch.distributed as dist

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        from rlbridge.engines.megatron.engine import MegatronTrainEngine

        engine: Any = MegatronTrainEngine(recipe)
    else:
        from rlbridge.engines.hf import HFTrainEngine

        engine = HFTrainEngine(recipe, Path(spec["model_dir"]), device="cuda" if cuda else "cpu")
    build_s = time.perf_counter() - start
    sync()
    built = torch.cuda.memory_allocated() if cuda else 0
    g = torch.Generator().manual_seed(0)
    vocab = SHAPES[spec["model"]]["vocab_size"]
    b, p, r = spec["batch"], spec["prompt"], spec["response"]
    ids = torch.randint(0, vocab, (b, p + r), generator=g)
    batch = SeqBatch.from_token_lists(ids[:, :p].tolist(), ids[:, p:].tolist(), pad_id=0)

    def loss_fn(logp: torch.Tensor, entropy: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        mask = batch.response_mask[rows].to(logp.device)
        n = mask.sum().clamp(min=1)
        return -(logp * mask).sum() / n - 1e-3 * (entropy * mask).sum() / n, {}

    num_micro = b // spec["micro"]
    for _ in range(spec["warmup"]):
        engine.train_step(batch, loss_fn, num_micro_batches=num_micro)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(spec["steps"]):
        t = time.perf_counter()
        m = engine.train_step(batch, loss_fn, num_micro_batches=num_micro)
        sync()
        times.append(time.perf_counter() - t)
    trainable = sum(v.numel() for v in engine.trainable_state().values())
    step_s = sorted(times)[len(times) // 2]
    return {
        "model": spec["model"], "engine": spec["engine"], "mode": spec["mode"],
        "tokens_per_s": b * (p + r) / step_s, "step_ms": 1000 * step_s,
        "peak_gib": (torch.cuda.max_memory_allocated() if cuda else 0) / GIB, "after_build_gib": built / GIB,
        "trainable_params": trainable, "grad_norm": float(m["grad_norm"]), "skipped": float(m.get("skipped", 0.0)),
        "build_s": build_s,
    }  # fmt: skip


# ------------------------------------------------------------------------------------------ driver
def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-0.5b")
    ap.add_argument("--engines", default="megatron,hf")
    ap.add_argument("--modes", default="lora,full")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--response", type=int, default=512)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=None, help="Also write the JSON and the table here (default: bench/results/).")
    ap.add_argument("--job", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.job:
        print("RESULT " + json.dumps(run_job(json.loads(args.job))), flush=True)
        return 0
    import torch

    gpus = max(torch.cuda.device_count(), 1)
    work = Path(tempfile.mkdtemp(prefix="trainer_gpu_"))
    specs = []
    for model in args.models.split(","):
        save_model(model, work / model)
        for mode in args.modes.split(","):
            for engine in args.engines.split(","):
                specs.append({"model": model, "model_dir": str(work / model), "engine": engine, "mode": mode,
                              "batch": args.batch, "prompt": args.prompt, "response": args.response, "micro": args.micro,
                              "warmup": args.warmup, "steps": args.steps})
    rows, failures = [], []
    running: list[tuple[subprocess.Popen[str], dict[str, Any], int]] = []
    free = list(range(gpus))
    while specs or running:
        while specs and free:
            spec, gpu = specs.pop(0), free.pop(0)
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu), "PYTHONWARNINGS": "ignore"}
            proc = subprocess.Popen([sys.executable, __file__, "--job", json.dumps(spec)], env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            running.append((proc, spec, gpu))
        time.sleep(0.5)
        for item in list(running):
            proc, spec, gpu = item
            if proc.poll() is None:
                continue
            running.remove(item)
            free.append(gpu)
            out = proc.stdout.read() if proc.stdout else ""
            result = [line[7:] for line in out.splitlines() if line.startswith("RESULT ")]
            if proc.returncode == 0 and result:
                rows.append(json.loads(result[-1]))
                print(f"done: {spec['model']} {spec['engine']} {spec['mode']}", file=sys.stderr, flush=True)
            else:
                failures.append({k: spec[k] for k in ("model", "engine", "mode")} | {"log": out[-3000:]})
                print(f"FAILED: {spec['model']} {spec['engine']} {spec['mode']}\n{out[-3000:]}", file=sys.stderr, flush=True)
    order: dict[tuple[str, str, str], int] = {}
    for m in args.models.split(","):
        for md in args.modes.split(","):
            for e in args.engines.split(","):
                order[(m, e, md)] = len(order)
    rows.sort(key=lambda r: order[(r["model"], r["engine"], r["mode"])])
    ratios = []
    for model in args.models.split(","):
        for mode in args.modes.split(","):
            got = {r["engine"]: r for r in rows if r["model"] == model and r["mode"] == mode}
            if {"megatron", "hf"} <= got.keys():
                ratios.append({"model": model, "mode": mode,
                               "throughput_megatron_over_hf": got["megatron"]["tokens_per_s"] / got["hf"]["tokens_per_s"],
                               "peak_megatron_over_hf": got["megatron"]["peak_gib"] / max(got["hf"]["peak_gib"], 1e-9)})
    from bench.common import markdown, report

    versions = {}
    for name in ("torch", "transformers", "peft", "megatron-core", "megatron-bridge"):
        try:
            from importlib.metadata import version

            versions[name] = version(name)
        except Exception:  # noqa: BLE001
            versions[name] = None
    gpu_name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    cols = ["model", "engine", "mode", "tokens_per_s", "step_ms", "peak_gib", "after_build_gib", "trainable_params"]
    table_rows = [{c: r[c] for c in cols} for r in rows]
    result = {"gpu": gpu_name, "versions": versions, "settings": {k: getattr(args, k) for k in
              ("batch", "prompt", "response", "micro", "warmup", "steps")}, "ratios": ratios, "failures": failures,
              "details": rows}  # fmt: skip
    report("trainer_gpu", result, table_rows, save=args.out is None)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        doc = {"benchmark": "trainer_gpu", "command": " ".join(["python", *sys.argv]), **result, "rows": table_rows}
        (out / "trainer_gpu.json").write_text(json.dumps(doc, indent=2) + "\n")
        (out / "trainer_gpu.md").write_text(markdown(table_rows) + "\n\n" + markdown(ratios) + "\n")
    print("\n" + markdown(ratios))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
