"""Trainer throughput and memory on one GPU: the megatron engine against the hf engine, LoRA and full FT.

Same GPU, same random-weight model, same batch, same loss for every row: `--batch` sequences of
`--prompt` + `--response` tokens (no padding), `--micro` sequences per micro-batch, bfloat16, activation
recompute as `--recompute` (default none), one optimizer step per `train_step`. The loss is the response
tokens' mean negative log-prob; both engines compute log-probs and entropies as in GRPO at its default
algorithm.entropy_coef 0 (the entropy a metric, without a gradient). Shapes:

    smollm2-135m  Llama, 30 layers, hidden 576, 9 heads / 3 KV heads, vocab 49152, tied embeddings
    qwen2.5-0.5b  Qwen2, 24 layers, hidden 896, 14 heads / 2 KV heads, vocab 151936, tied, q/k/v biases
    qwen2.5-7b    Qwen2, 28 layers, hidden 3584, 28 heads / 4 KV heads, vocab 152064, untied, q/k/v biases

What differs by design, and shows in the numbers: the megatron engine keeps fp32 main weights, gradients
and Adam moments (megatron-core's mixed-precision optimizer); the hf engine runs torch AdamW on the bf16
weights. The hf engine's output layer runs on the response positions only (`logits_to_keep`); megatron's
on every position. Megatron runs the local (no Transformer Engine) layer spec; its core attention is
`--attention sdpa` (rlbridge's SDPAttention on torch SDPA, the default) and/or `unfused` (megatron-core's
DotProductAttention: baddbmm, softmax, bmm), one row each, so one run shows before and after. hf runs
PyTorch SDPA.

Each configuration runs in its own process (clean peak-memory counters, one megatron parallel state), up
to one process per visible GPU at a time. Timing: `--warmup` steps, then `--steps` timed steps
(torch.cuda.synchronize around each); tokens/s counts all prompt + response tokens of a step. Memory:
peak allocated during the timed steps (weights, gradients, optimizer state and activations), and
allocated after the engine was built. With `--profile`, one more step runs under torch.profiler and the
row lists its top CUDA kernels by device time.

MFU. The chip's bf16 dense peak is measured in the same run, before the jobs, on GPU 0: the median
TFLOP/s of `--peak-reps` torch.matmul calls of two 8192x8192 bf16 matrices (2*8192^3 FLOPs each). Model
FLOPs of one step, the same for both engines (so MFU ratios equal throughput ratios), with T = batch *
(prompt + response) tokens, T_out = batch * response (the positions whose logits the loss needs), L layers,
hidden H, heads h, query groups g, head dim d = H / h, MLP width I (SwiGLU: 3 matrices), vocab V,
S = prompt + response:

    N      = L * (H*(h + 2g)*d + h*d*H + 3*H*I)           matmul weights of the layers (biases, norms left out)
    attn   = 2 * batch * L * h * d * S^2                   forward QK^T and PV, causal (half of S x S)
    full:  6*N*T + 6*V*H*T_out + 3*attn                    forward 2, backward 4 (input and weight grads)
    LoRA:  4*N*T + 4*V*H*T_out + 3*attn + 6*P_lora*T       frozen base: forward 2, backward 2 (input grads
           - 2*Q*T                                         only); P_lora = trainable adapter parameters; the
                                                           first layer's q/k/v input grads (Q = H*(h+2g)*d)
                                                           are never computed: the frozen embeddings need no
                                                           gradient (nor do that layer's q/k/v adapters' A
                                                           inputs, 2*r*H*T each, < 0.01 % at 7B: counted)

torch's FlopCounterMode on a real forward + backward agrees with this count exactly, less the causal half of
attention that an unfused kernel computes anyway (tests/unit/bench/test_model_flops.py).

MFU = model FLOPs / step time / measured peak. Not counted: megatron's output layer on the prompt positions
(work the loss does not need), elementwise work (norms, RoPE, SwiGLU, softmax, log-softmax, optimizer).

    python bench/trainer_gpu.py [--models smollm2-135m,qwen2.5-0.5b,qwen2.5-7b:8] [--engines megatron,hf]
        [--attention sdpa,unfused] [--modes lora,full] [--batch 8] [--prompt 512] [--response 512]
        [--micro 4] [--warmup 2] [--steps 5] [--profile] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
    ),
    "qwen2.5-0.5b": dict(
        model_type="qwen2",
        architectures=["Qwen2ForCausalLM"],
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
    ),
    # Qwen2.5-7B-Instruct's published architecture (rlbridge's short name qwen2.5-7b-random): untied, q/k/v biases
    "qwen2.5-7b": dict(
        model_type="qwen2",
        architectures=["Qwen2ForCausalLM"],
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
    ),
    # for checking this script on a machine without a GPU (CPU, gloo; memory columns are 0 there)
    "tiny": dict(
        model_type="qwen2",
        architectures=["Qwen2ForCausalLM"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
    ),
}
GIB = 1024**3


def shape(name: str) -> dict[str, Any]:
    """The config of a --models entry: a SHAPES name, or NAME:LAYERS for its first LAYERS layers (e.g.
    qwen2.5-7b:8: full fine-tuning of the whole 7B does not fit one 139 GiB GPU; the per-layer work is the same)."""
    base, _, layers = name.partition(":")
    cfg = dict(SHAPES[base])
    if layers:
        cfg["num_hidden_layers"] = int(layers)
    return cfg


def save_model(name: str, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = shape(name)
    archs = cfg.pop("architectures")
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config.architectures = archs
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)


def saved_model(name: str, root: Path) -> Path:
    """The random-weight model `name` (seeded: the same weights every time) saved under `root` once and reused by
    later runs on the machine: a 7B takes minutes to initialize on the CPU and 15 GB of disk per copy. Written
    to a temporary folder and renamed into place, so a run killed mid-save leaves no half model behind."""
    out = root / name.replace(":", "-layers")
    if (out / "config.json").is_file():
        return out
    tmp = root / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(name, tmp)
    tmp.rename(out)
    return out


def model_flops(
    model: str, mode: str, batch: int, prompt: int, response: int, lora_params: int
) -> dict[str, float]:
    """Model FLOPs of one train_step (the formula in the module docstring; LoRA on q/k/v, o and the MLP)."""
    c = shape(model)
    L, H, h, g, inter, V = (c[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                             "num_key_value_heads", "intermediate_size", "vocab_size"))  # fmt: skip
    d, S = H // h, prompt + response
    tokens, out_tokens = batch * S, batch * response
    n = L * (H * (h + 2 * g) * d + h * d * H + 3 * H * inter)
    attn = 2.0 * batch * L * h * d * S * S
    if mode == "full":
        total = 6.0 * n * tokens + 6.0 * V * H * out_tokens + 3 * attn
    else:
        first_qkv_input_grads = 2.0 * tokens * H * (h + 2 * g) * d
        total = 4.0 * n * tokens + 4.0 * V * H * out_tokens + 3 * attn + 6.0 * lora_params * tokens
        total -= first_qkv_input_grads
    return {"model_flops": total, "layer_matmul_params": float(n), "attention_fwd_flops": attn}


def measure_peak(reps: int) -> dict[str, Any]:
    """The chip's bf16 dense matmul TFLOP/s: median of `reps` 8192^3 matmuls (CPU: a small float32 one)."""
    import torch

    cuda = torch.cuda.is_available()
    n, dtype = (8192, torch.bfloat16) if cuda else (512, torch.float32)
    dev = "cuda" if cuda else "cpu"
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(10):
        a @ b
    sync()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        sync()
        times.append(time.perf_counter() - t)
    median = sorted(times)[len(times) // 2]
    return {"peak_tflops": 2 * n**3 / median / 1e12, "shape": f"{n}x{n}x{n}", "dtype": str(dtype).split(".")[-1],
            "reps": reps, "best_tflops": 2 * n**3 / min(times) / 1e12}  # fmt: skip


def profile_step(step: Any, top: int = 12) -> list[dict[str, Any]]:
    """One step under torch.profiler: the `top` CUDA kernels by device time (share of all kernel time)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    from torch.autograd import DeviceType

    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    kernels = [e for e in events if getattr(e, "device_type", None) == DeviceType.CUDA]
    events = kernels or events  # kernels only: an aten op's self device time repeats its kernels' time
    total = sum(e.self_device_time_total for e in events) or 1.0
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    return [{"name": e.key[:90], "ms": e.self_device_time_total / 1000, "share": e.self_device_time_total / total,
             "calls": e.count} for e in events[:top]]  # fmt: skip


# ----------------------------------------------------------------------------------------------- job
def recompute_cfg(granularity: str) -> dict[str, Any]:
    """trainer.recompute for --recompute: full recomputes every layer (uniform groups of one)."""
    if granularity == "full":
        return {"granularity": "full", "method": "uniform", "num_layers": 1}
    return {"granularity": granularity}


def build_engine(spec: dict[str, Any]) -> tuple[Any, Any, float]:
    """The job's engine on GPU 0 (or the CPU): (engine, recipe, seconds to build it). The megatron engine
    gets a one-rank process group first (NCCL, gloo on the CPU). Also used by bench/weight_sync_gpu.py."""
    import torch

    from rlbridge.recipe.schema import Recipe

    lora = spec["mode"] == "lora"
    cuda = torch.cuda.is_available()
    recipe = Recipe.model_validate({
        "name": "bench", "model": {"path": spec["model_dir"], "dtype": "bfloat16"},
        "lora": {"rank": 16 if lora else 0, "alpha": 32, "targets": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
                 "compute_dtype": spec.get("lora_dtype", "float32")},
        "trainer": {"engine": spec["engine"], "micro_batch_size": spec["micro"], "optim": {"lr": 1e-5, "clip_grad": 1.0},
                    "recompute": recompute_cfg(spec.get("recompute", "none"))},
        "reward": {"fn": "arithmetic"}, "data": {"train": {"path": "unused.jsonl"}, "batch_size": 1}, "run": {"steps": 1000},
        "cluster": {"device": "cuda" if cuda else "cpu"},
    })  # fmt: skip
    if cuda:
        torch.cuda.set_device(0)
    start = time.perf_counter()
    if spec["engine"] == "megatron":
        from bench.common import one_rank_group

        one_rank_group(cuda)
        from rlbridge.engines.megatron.engine import MegatronTrainEngine

        engine: Any = MegatronTrainEngine(recipe)
    else:
        from rlbridge.engines.hf.engine import HFTrainEngine

        engine = HFTrainEngine(recipe, Path(spec["model_dir"]), device="cuda" if cuda else "cpu")
    return engine, recipe, time.perf_counter() - start


def train_inputs(spec: dict[str, Any]) -> tuple[Any, Any, int]:
    """(batch, loss_fn, num_micro_batches) of the job's train_step: random tokens, no padding, the
    response tokens' mean negative log-prob (the engines' entropy, a metric at the recipe's entropy_coef 0, is
    not in it)."""
    import torch

    from rlbridge.batch import SeqBatch

    g = torch.Generator().manual_seed(0)
    vocab = shape(spec["model"])["vocab_size"]
    b, p, r = spec["batch"], spec["prompt"], spec["response"]
    ids = torch.randint(0, vocab, (b, p + r), generator=g)
    batch = SeqBatch.from_token_lists(ids[:, :p].tolist(), ids[:, p:].tolist(), pad_id=0)

    def loss_fn(
        logp: torch.Tensor, entropy: torch.Tensor, rows: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        mask = batch.response_mask[rows].to(logp.device)
        n = mask.sum().clamp(min=1)
        return -(logp * mask).sum() / n, {}

    return batch, loss_fn, b // spec["micro"]


def _plain_product(product: Any, hidden: Any, weight: Any, *args: Any, **kwargs: Any) -> Any:
    return product(hidden, weight, *args, **kwargs)


def exact_output_layer() -> Any:
    """The output layer's float32 product on CUDA's exact float32 matmuls (FFMA kernels) for the rest of the
    process, as before engines/float32_head: its TF32 scope replaced by the plain product. Returns the scope."""
    from rlbridge.engines import float32_head

    scoped, float32_head.scoped_product = float32_head.scoped_product, _plain_product
    return scoped


@contextmanager
def exact_output_layer_scope() -> Iterator[None]:
    """exact_output_layer inside the block only."""
    from rlbridge.engines import float32_head

    scoped = exact_output_layer()
    try:
        yield
    finally:
        float32_head.scoped_product = scoped


def run_job(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    lora = spec["mode"] == "lora"
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    engine, _, build_s = build_engine(spec)
    sync()
    built = torch.cuda.memory_allocated() if cuda else 0
    b, p, r = spec["batch"], spec["prompt"], spec["response"]
    batch, loss_fn, num_micro = train_inputs(spec)
    head_gap = None
    if spec.get("float32_head", "tf32") == "ieee":
        exact_output_layer()
    else:
        # the log-probs with the output layer's product on exact float32 matmuls and on TF32: what the scope costs
        # (0 on a CPU, whose float32 matmuls ignore the setting)
        with exact_output_layer_scope():
            exact = engine.logprobs(batch).float()
        gap = (engine.logprobs(batch).float() - exact).abs()[batch.response_mask.to(exact.device).bool()]
        head_gap = {"mean": float(gap.mean()), "max": float(gap.max())}
    tf32_gap = None
    if spec.get("fp32_matmul", "ieee") != "ieee":
        # the same log-probs with CUDA float32 matmuls exact and as asked: what the setting costs in accuracy
        # (on a CPU the setting changes nothing: the gap is 0)
        exact = engine.logprobs(batch).float()
        torch.backends.cuda.matmul.fp32_precision = spec["fp32_matmul"]
        gap = (engine.logprobs(batch).float() - exact).abs()[batch.response_mask.to(exact.device).bool()]
        tf32_gap = {"mean": float(gap.mean()), "max": float(gap.max())}
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
    attention = "sdpa (transformers)"
    if spec["engine"] == "megatron":
        names = {type(mod).__name__ for chunk in engine.model for mod in chunk.modules()}
        attention = ",".join(sorted(names & {"SDPAttention", "DotProductAttention"}))
    peak_bytes = torch.cuda.max_memory_allocated() if cuda else 0
    top = []
    if spec.get("profile") and cuda:
        try:
            top = profile_step(lambda: engine.train_step(batch, loss_fn, num_micro_batches=num_micro))
        except Exception as exc:  # noqa: BLE001  (a profiler problem must not lose the timings)
            top = [{"error": repr(exc)[:300]}]
    flops = model_flops(spec["model"], spec["mode"], b, p, r, trainable if lora else 0)
    return {
        "model": spec["model"], "engine": spec["engine"], "attention": spec["attention"], "mode": spec["mode"],
        "core_attention": attention, **flops, "achieved_tflops": flops["model_flops"] / step_s / 1e12,
        "profile_top": top,
        "tokens_per_s": b * (p + r) / step_s, "step_ms": 1000 * step_s,
        "peak_gib": peak_bytes / GIB, "after_build_gib": built / GIB,
        "trainable_params": trainable, "grad_norm": float(m["grad_norm"]), "skipped": float(m.get("skipped", 0.0)),
        "build_s": build_s, "fp32_matmul": spec.get("fp32_matmul", "ieee"), "fp32_matmul_logprob_gap": tf32_gap,
        "float32_head": spec.get("float32_head", "tf32"), "float32_head_logprob_gap": head_gap,
        "lora_dtype": spec.get("lora_dtype", "float32"),
    }  # fmt: skip


def plan_trainer_gib(row: dict[str, Any], args: argparse.Namespace, model_dir: Path) -> float:
    """`rlbridge plan`'s trainer memory per device (Memory.trainer_total) for the job's shape: the same model,
    engine, LoRA or full fine-tuning, micro-batch and sequence length, bfloat16, the job's recompute."""
    from rlbridge.model.info import read_model_info
    from rlbridge.plan import make_plan
    from rlbridge.recipe.schema import Recipe

    recipe = Recipe.model_validate({
        "name": "trainer-gpu", "model": {"path": str(model_dir), "dtype": "bfloat16"},
        "lora": {"rank": 16 if row["mode"] == "lora" else 0, "alpha": 32, "compute_dtype": args.lora_dtype},  # as run_job's
        "trainer": {"engine": row["engine"], "micro_batch_size": args.micro, "recompute": recompute_cfg(args.recompute)},
        "rollout": {"n": 1, "max_prompt_tokens": args.prompt, "max_response_tokens": args.response},
        "reward": {"fn": "arithmetic"}, "data": {"train": {"path": "builtin:arithmetic"}, "batch_size": args.batch},
        "cluster": {"device": "cuda"},
    })  # fmt: skip
    memory = make_plan(recipe, read_model_info(str(model_dir))).memory
    assert memory is not None
    return memory.trainer_total


# ------------------------------------------------------------------------------------------ driver
def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-0.5b")
    ap.add_argument("--engines", default="megatron,hf")
    ap.add_argument("--attention", default="sdpa,unfused", help="megatron core attention(s): sdpa, unfused")
    ap.add_argument("--modes", default="lora,full")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--response", type=int, default=512)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--peak-reps", type=int, default=50)
    ap.add_argument(
        "--jobs-per-gpu",
        type=int,
        default=1,
        help="jobs sharing one GPU at a time: their peak memory stays exact (per process), their timings do not",
    )
    ap.add_argument("--profile", action="store_true", help="one extra step under torch.profiler per job")
    ap.add_argument(
        "--recompute", default="none", choices=["none", "selective", "full"], help="trainer.recompute"
    )
    ap.add_argument(
        "--fp32-matmul",
        default="ieee",
        choices=["ieee", "tf32"],
        help="torch.backends.cuda.matmul.fp32_precision in each job (process-wide: the float32 output layer, and "
        "peft's float32 adapters); with tf32 the job first measures the log-prob gap it makes on its batch",
    )
    ap.add_argument(
        "--float32-head",
        default="tf32",
        choices=["tf32", "ieee"],
        help="the output layer's float32 product: on TF32 tensor cores (engines/float32_head, the engines' way; the "
        "job first measures the log-prob gap against exact float32) or on exact float32 matmuls (as before it)",
    )
    ap.add_argument(
        "--lora-dtype",
        default="float32",
        choices=["float32", "model"],
        help="lora.compute_dtype: the hf engine's adapters in float32 (peft's default) or in the model's bfloat16 "
        "with float32 masters (megatron's adapters are always the model's dtype)",
    )
    ap.add_argument(
        "--out", default=None, help="Also write the JSON and the table here (default: bench/results/)."
    )
    ap.add_argument(
        "--models-dir",
        default=str(Path(tempfile.gettempdir()) / "trainer_gpu_models"),
        help="where the random-weight models are saved once and reused by later runs",
    )
    ap.add_argument("--job", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.job:
        spec = json.loads(args.job)
        if spec["engine"] == "megatron":
            os.environ["RLBRIDGE_MEGATRON_ATTENTION"] = spec["attention"]
        print("RESULT " + json.dumps(run_job(spec)), flush=True)
        return 0
    import torch

    gpus = max(torch.cuda.device_count(), 1)
    peak = measure_peak(args.peak_reps)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    print(
        f"measured peak: {peak['peak_tflops']:.0f} TFLOP/s ({peak['shape']} {peak['dtype']})", file=sys.stderr
    )
    models = {m: saved_model(m, Path(args.models_dir)) for m in args.models.split(",")}
    variants = [
        (e, a)
        for e in args.engines.split(",")
        for a in (args.attention.split(",") if e == "megatron" else ["sdpa"])
    ]
    specs = []
    for model in args.models.split(","):
        for mode in args.modes.split(","):
            for engine, attention in variants:
                specs.append(
                    {
                        "model": model,
                        "model_dir": str(models[model]),
                        "engine": engine,
                        "attention": attention,
                        "mode": mode,
                        "batch": args.batch,
                        "prompt": args.prompt,
                        "response": args.response,
                        "micro": args.micro,
                        "warmup": args.warmup,
                        "steps": args.steps,
                        "profile": args.profile,
                        "fp32_matmul": args.fp32_matmul,
                        "float32_head": args.float32_head,
                        "lora_dtype": args.lora_dtype,
                        "recompute": args.recompute,
                    }
                )
    order = {(s["model"], s["mode"], s["engine"], s["attention"]): i for i, s in enumerate(specs)}
    rows, failures = [], []
    running: list[tuple[subprocess.Popen[str], dict[str, Any], int]] = []
    free = [g for g in range(gpus) for _ in range(args.jobs_per_gpu)]
    started = time.perf_counter()
    while specs or running:
        while specs and free:
            spec, gpu = specs.pop(0), free.pop(0)
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu), "PYTHONWARNINGS": "ignore"}
            proc = subprocess.Popen(
                [sys.executable, __file__, "--job", json.dumps(spec)],
                env=env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
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
            label = f"{spec['model']} {spec['engine']}/{spec['attention']} {spec['mode']}"
            if proc.returncode == 0 and result:
                rows.append(json.loads(result[-1]))
                if args.out:  # rows so far, in case the whole run is cut short
                    Path(args.out).mkdir(parents=True, exist_ok=True)
                    with open(Path(args.out) / "trainer_gpu.partial.jsonl", "a") as f:
                        f.write(json.dumps({"peak": peak, **rows[-1]}) + "\n")
                print(f"done ({time.perf_counter() - started:.0f} s): {label}", file=sys.stderr, flush=True)
            else:
                failures.append(
                    {k: spec[k] for k in ("model", "engine", "attention", "mode")} | {"log": out[-3000:]}
                )
                print(f"FAILED: {label}\n{out[-3000:]}", file=sys.stderr, flush=True)
    rows.sort(key=lambda r: order[(r["model"], r["mode"], r["engine"], r["attention"])])
    for r in rows:
        r["mfu"] = r["achieved_tflops"] / peak["peak_tflops"]
        r["plan_gib"] = plan_trainer_gib(
            r, args, models[r["model"]]
        )  # issue 16 item 7: the plan against the measure
        r["plan_over_peak"] = r["plan_gib"] / max(r["peak_gib"], 1e-9)
    ratios = []
    for model in args.models.split(","):
        for mode in args.modes.split(","):
            got = {
                f"{r['engine']}_{r['attention']}" if r["engine"] == "megatron" else "hf": r
                for r in rows
                if r["model"] == model and r["mode"] == mode
            }
            pairs = [
                ("megatron_sdpa", "megatron_unfused"),
                ("megatron_sdpa", "hf"),
                ("megatron_unfused", "hf"),
            ]
            for a, b in pairs:
                if {a, b} <= got.keys():
                    ratios.append(
                        {
                            "model": model,
                            "mode": mode,
                            "compare": f"{a} / {b}",
                            "throughput": got[a]["tokens_per_s"] / got[b]["tokens_per_s"],
                            "peak_memory": got[a]["peak_gib"] / max(got[b]["peak_gib"], 1e-9),
                        }
                    )
    from bench.common import machine, markdown, report

    versions = {}
    for name in ("torch", "transformers", "peft", "megatron-core", "megatron-bridge"):
        try:
            from importlib.metadata import version

            versions[name] = version(name)
        except Exception:  # noqa: BLE001
            versions[name] = None
    gpu_name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    cols = [
        "model",
        "engine",
        "attention",
        "mode",
        "tokens_per_s",
        "step_ms",
        "mfu",
        "achieved_tflops",
        "peak_gib",
        "plan_gib",
        "plan_over_peak",
        "after_build_gib",
        "trainable_params",
    ]
    table_rows = [{c: r[c] for c in cols} for r in rows]
    formula = (
        "full: 6*N*T + 6*V*H*T_out + 3*attn; lora: 4*N*T + 4*V*H*T_out + 3*attn + 6*P_lora*T; "
        "N = L*(H*(h+2g)*d + h*d*H + 3*H*I), attn = 2*batch*L*h*d*S^2 (causal), T = batch*S, "
        "T_out = batch*response; MFU = model_flops / step time / peak"
    )
    result = {"gpu": gpu_name, "gpus": gpus, "versions": versions, "peak": peak, "flops_formula": formula,
              "settings": {k: getattr(args, k) for k in
              ("batch", "prompt", "response", "micro", "warmup", "steps", "attention", "profile", "fp32_matmul", "float32_head", "lora_dtype", "recompute")},
              "ratios": ratios, "failures": failures, "details": rows}  # fmt: skip
    report("trainer_gpu", result, table_rows, save=args.out is None)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        doc = {
            "benchmark": "trainer_gpu",
            "command": " ".join(["python", *sys.argv]),
            "machine": machine(),
            **result,
            "rows": table_rows,
        }
        (out / "trainer_gpu.json").write_text(json.dumps(doc, indent=2) + "\n")
        (out / "trainer_gpu.md").write_text(markdown(table_rows) + "\n\n" + markdown(ratios) + "\n")
    print("\n" + markdown(ratios))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
