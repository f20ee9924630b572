"""TRL's own asynchronous GRPO (`trl.experimental.async_grpo.AsyncGRPOTrainer`, TRL 1.16) on a recipe's work: the B
side of `bench/ab_rounds.py --trl-async` ("async vs async").

What TRL's docs ask for, on one GPU: a vLLM server started the way `trl vllm-serve` starts it (its `build_command`:
NCCL weight-transfer config, processed log-probs, here with `--enable-lora --max-lora-rank R --max-loras
max_staleness + 2` and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, so each sync loads the LoRA adapter rather than merged
weights: TRL's advice for PEFT) at the recipe's rollout.gpu_memory_utilization, sharing the GPU with the trainer;
the trainer with `max_staleness` = rlbridge's rollout.max_staleness, the whole batch in one micro-batch
(`per_device_train_batch_size` = prompts x samples, gradient accumulation 1, `token_budget=0`: TRL's fixed-count
batcher, so every optimizer step trains exactly one batch of samples, packed without padding), the model in the
recipe's dtype. The same prompts in the same order (the rollout worker walks the dataset in order), the same reward
functions with their weights folded in (AsyncGRPO sums rewards with weight 1), lr, AdamW settings and clip as the
recipe; gradient checkpointing only with --gradient-checkpointing (the 512-rollout size needs it for one
micro-batch).

AsyncGRPO's tree attention loads FlashAttention-3 from the Hugging Face Hub (`kernels.get_kernel(
"kernels-community/flash-attn3")`), which a machine without network cannot fetch: there, `kernels` is replaced by a
stand-in whose `flash_attn_varlen_func` is torch's own `torch.nn.attention.varlen.varlen_attn` (FlashAttention-2
kernels inside torch, forward and backward); the record says which (`attention`).

    python bench/trl_async.py --recipe recipes/quickstart-gpu.yaml --steps 9 --staleness 1 --out RECORD.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import trl_grpo  # noqa: E402


# ------------------------------------------------------------------------------------------ pieces testable on CPU
def reward_funcs(terms: list[Any], row_keys: list[str]) -> list[Any]:
    """One picklable reward function per recipe reward term, its weight folded in (trl_grpo.WeightedReward)."""
    return [trl_grpo.WeightedReward(t.fn, t.weight, row_keys) for t in terms]


def server_command(model_dir: str, r: Any, port: int, staleness: int) -> list[str]:
    """The `trl vllm-serve` command line (TRL's own build_command) for the recipe's model, lengths, memory share and
    LoRA rank, with adapter loading on (`max_staleness + 2` adapters: TRL's check for adapter sync)."""
    from trl.experimental.async_grpo.async_grpo_trainer import round_lora_rank
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    ro, cpu = r.rollout, not trl_grpo.on_gpu(r)
    args = ScriptArguments(
        model=model_dir,
        host="127.0.0.1",
        port=port,
        gpu_memory_utilization=ro.gpu_memory_utilization,
        dtype=r.model.dtype,
        max_model_len=ro.max_prompt_tokens + ro.max_response_tokens,
        enforce_eager=cpu,  # vLLM-CPU: as rlbridge's engine there
    )
    extra = ["--enable-lora", "--max-lora-rank", str(round_lora_rank(r.lora.rank))]
    extra += ["--max-loras", str(staleness + 2)]
    # vLLM-CPU as rlbridge's engine runs there (its KV cache, 32-token blocks, step tokens, unchunked prefills,
    # without which a seeded request fails on the CPU build: "CPU Generator does not use offset")
    if cpu:
        from rlbridge.rollout.vllm_compat import engine_kwargs

        kw = engine_kwargs(model_dir, ro, r.model, lora_rank=r.lora.rank, seed=r.run.seed, cpu=True)
        for key in ("kv_cache_memory_bytes", "block_size", "max_num_batched_tokens"):
            extra += [f"--{key.replace('_', '-')}", str(kw[key])]
        if not kw["enable_chunked_prefill"]:
            extra.append("--no-enable-chunked-prefill")
    return build_command(args, extra)


def segment_attention(q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, scale: float | None, causal: bool) -> Any:
    """Variable-length attention one segment at a time with torch's SDPA (any device, differentiable): segment i's
    queries q[cu_q[i]:cu_q[i+1]] attend to its keys k[cu_k[i]:cu_k[i+1]], causally aligned at the end (query j of
    Lq sees keys up to j + Lk - Lq, FlashAttention's convention); GQA by repeating K/V per head group. Layout
    (tokens, heads, head_dim), as flash_attn_varlen_func's."""
    import torch
    import torch.nn.functional as F

    groups = q.shape[1] // k.shape[1]
    outs = []
    for i in range(len(cu_q) - 1):
        qs = q[int(cu_q[i]) : int(cu_q[i + 1])].transpose(0, 1)
        ks = k[int(cu_k[i]) : int(cu_k[i + 1])].repeat_interleave(groups, dim=1).transpose(0, 1)
        vs = v[int(cu_k[i]) : int(cu_k[i + 1])].repeat_interleave(groups, dim=1).transpose(0, 1)
        mask = None
        if causal:
            lq, lk = qs.shape[1], ks.shape[1]
            rows = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
            mask = torch.arange(lk, device=q.device)[None, :] <= rows
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale).transpose(0, 1))
    return torch.cat(outs, dim=0)


VLLM_CPU_CLI = (
    "import importlib.metadata as m, runpy, sys; v = m.version; "
    "m.version = lambda n: v('vllm-cpu') if n == 'vllm' else v(n); "
    "sys.argv[0] = 'vllm'; runpy.run_module('vllm.entrypoints.cli.main', run_name='__main__')"
)
"""vLLM's CLI asks for the version of the distribution `vllm`; the CPU build is installed as `vllm-cpu`."""


def cpu_build_launch(cmd: list[str]) -> list[str]:
    """`cmd` (python -m vllm.entrypoints.cli.main ...) as is, or through VLLM_CPU_CLI where only vllm-cpu is
    installed (a CPU dry run)."""
    import importlib.metadata

    try:
        importlib.metadata.version("vllm")
        return cmd
    except importlib.metadata.PackageNotFoundError:
        return [cmd[0], "-c", VLLM_CPU_CLI, *cmd[3:]]


def varlen_stand_in() -> types.SimpleNamespace:
    """`flash_attn_varlen_func` with FlashAttention's signature on torch's varlen_attn (rlbridge's
    engines/hf/varlen.varlen_cuda: GQA by `enable_gqa` or K/V repeated, causal as window (w, 0) or `is_causal`). On
    CPU tensors (varlen_attn is CUDA only) segment_attention, so that the whole loop can be dry-run there."""
    from torch.nn.attention.varlen import varlen_attn  # noqa: F401  # a torch without it fails here, not mid-run

    from rlbridge.engines.hf.varlen import varlen_cuda

    def flash_attn_varlen_func(
        q: Any,
        k: Any,
        v: Any,
        cu_seqlens_q: Any,
        cu_seqlens_k: Any,
        max_seqlen_q: int,
        max_seqlen_k: int,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        softcap: float | None = None,
    ) -> Any:
        if softcap:
            raise NotImplementedError("softcap: not in torch's varlen_attn")
        if q.device.type == "cpu":
            if window_size[0] != -1:
                raise NotImplementedError("a sliding window on CPU")
            return segment_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
        return varlen_cuda(
            q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), softmax_scale,
            causal=causal, window=tuple(window_size),
        )  # fmt: skip

    return types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func)


def attention_backend(force_torch: bool) -> str:
    """Where the `kernels` package is missing (or `force_torch`), AsyncGRPO's attention loader returns the stand-in
    (varlen_stand_in) instead of fetching FlashAttention-3 from the Hub; which attention runs."""
    if not force_torch and importlib.util.find_spec("kernels") is not None:
        return "kernels-community/flash-attn3 via the kernels package (Hub)"
    from trl.experimental.async_grpo import packing

    stand_in = varlen_stand_in()
    packing._flash_attn = lambda: stand_in  # tree_attention looks it up at each call
    return (
        "torch.nn.attention.varlen.varlen_attn (FlashAttention-2 in torch; on CPU tensors segment_attention) "
        "in place of the Hub's flash-attn3"
    )


def async_config(r: Any, total: int, staleness: int, checkpointing: bool, base_url: str, out_dir: str) -> Any:
    """AsyncGRPOConfig on the recipe's work (see the module docstring)."""
    from trl.experimental.async_grpo import AsyncGRPOConfig

    ro, opt = r.rollout, r.trainer.optim
    return AsyncGRPOConfig(
        output_dir=out_dir,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=r.run.seed,
        max_steps=total,
        dtype=r.model.dtype,
        bf16=r.model.dtype == "bfloat16",
        per_device_train_batch_size=r.rollouts_per_step,
        gradient_accumulation_steps=1,
        token_budget=0,
        num_generations=ro.n,
        max_completion_length=ro.max_response_tokens,
        temperature=ro.temperature,
        top_p=ro.top_p,
        top_k=0 if ro.top_k < 0 else ro.top_k,
        learning_rate=opt.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.betas[0],
        adam_beta2=opt.betas[1],
        adam_epsilon=opt.eps,
        max_grad_norm=opt.clip_grad,
        optim="adamw_torch",
        gradient_checkpointing=checkpointing,
        epsilon=r.algorithm.clip.low,
        epsilon_high=r.algorithm.clip.high,
        max_staleness=staleness,
        vllm_server_base_url=base_url,
        dataloader_num_workers=0,
    )


# ------------------------------------------------------------------------------------------ the run (child process)
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_async(a: argparse.Namespace) -> None:
    """Server, trainer, timed steps; writes the record (run_trl's shape) to a.out even when training fails."""
    import torch

    r = trl_grpo.recipe(a.steps, a.sets)
    attention = attention_backend(a.torch_varlen)
    if not torch.cuda.is_available():  # a CPU dry run: AsyncGRPO reads the GPU's name for its MFU metric only
        from trl.experimental.async_grpo import async_grpo_trainer

        async_grpo_trainer.get_peak_flops_per_device = lambda *_a, **_k: 1.0
    import datasets
    import trl
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    from rlbridge.data.datasets import render_messages
    from rlbridge.model.cache import ensure_model
    from rlbridge.model.tokenizer import load_tokenizer
    from rlbridge.recipe.targets import hf_targets

    model_dir = str(ensure_model(r.model.path))
    plan = trl_grpo.step_prompts(r, a.steps)
    row_keys = list(plan[0][0][0].row)
    rows = [
        {"prompt": render_messages(p, r.data), **p.row, "answer": p.answer} for step in plan for p, _ in step
    ]
    port = free_port()
    cmd = cpu_build_launch(server_command(model_dir, r, port, a.staleness))
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    if not trl_grpo.on_gpu(r):  # vLLM-CPU's platform check reads the version of a distribution named vllm
        env["VLLM_TARGET_DEVICE"] = "cpu"
    record: dict[str, Any] = {
        "versions": {"trl": trl.__version__, "torch": torch.__version__},
        "attention": attention,
        "server_command": cmd,
        "step_ends": [],
        "logs": [],
        "generations": [],
        "process_start": a.process_start,
    }
    server_log = a.out.with_suffix(".server.log").open("w")
    server = subprocess.Popen(cmd, stdout=server_log, stderr=subprocess.STDOUT, env=env)
    record["server_started"] = time.time()

    class Timing(TrainerCallback):
        def on_train_begin(self, *_a: Any, **_k: Any) -> None:
            record["train_begin"] = time.time()

        def on_step_end(self, *_a: Any, **_k: Any) -> None:
            record["step_ends"].append(time.time())

        def on_log(self, *_a: Any, **k: Any) -> None:
            record["logs"].append(dict(k.get("logs") or {}))

    try:
        args = async_config(
            r, a.steps, a.staleness, a.gradient_checkpointing, f"http://127.0.0.1:{port}", tempfile.mkdtemp()
        )
        lora = LoraConfig(
            r=r.lora.rank,
            lora_alpha=r.lora.alpha,
            lora_dropout=r.lora.dropout,
            target_modules=hf_targets(r.lora.targets),
            task_type="CAUSAL_LM",
        )
        trainer = AsyncGRPOTrainer(
            model=model_dir,
            reward_funcs=reward_funcs(r.reward.terms, row_keys),
            args=args,
            train_dataset=datasets.Dataset.from_list(rows),
            processing_class=with_response_template(load_tokenizer(Path(model_dir)), record),
            peft_config=lora,
            callbacks=[Timing()],
        )
        record["config"] = {k: getattr(args, k, None) for k in ASYNC_CONFIG_SHOWN}
        record["lora_sync"] = trainer._lora_sync
        trainer.train()
        if torch.cuda.is_available():
            record["cuda_max_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
        server_log.close()
        a.out.write_text(json.dumps(record, default=str))


def with_response_template(tok: Any, record: dict[str, Any]) -> Any:
    """AsyncGRPO parses each completion into a message with the tokenizer's response template, which TRL knows
    for a list of chat templates; SmolLM2's is not in it but is ChatML (`<|im_start|>assistant\n ... <|im_end|>`),
    whose template TRL ships as `qwen3_template`: that one is set where TRL finds none (recorded)."""
    from trl.chat_template_utils import add_response_schema, qwen3_template

    try:
        add_response_schema(tok)
        record["response_template"] = "TRL's own for this chat template"
    except ValueError:
        if "<|im_start|>assistant" not in (tok.chat_template or ""):
            raise
        tok.response_template = qwen3_template
        record["response_template"] = "ChatML: TRL's qwen3_template (the model's chat template is ChatML)"
    return tok


ASYNC_CONFIG_SHOWN = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "token_budget",
    "max_staleness",
    "max_inflight_tasks",
    "gradient_checkpointing",
    "dtype",
    "bf16",
    "num_generations",
    "max_completion_length",
    "learning_rate",
    "epsilon",
    "epsilon_high",
)


# ------------------------------------------------------------------------------------------ measured from outside
def run_trl_async_measured(
    total: int,
    warmup: int,
    sets: list[str],
    work: Path,
    staleness: int,
    checkpointing: bool,
    keep: Path | None = None,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """This script as a child process, measured like bench/trl_grpo.py's runs (its server in the same process
    group, so its memory is counted and it ends with the run); the summary of its timed steps."""
    import shutil

    res = work / f"trl-async-{time.time_ns()}.json"
    cmd = [
        sys.executable,
        __file__,
        "--recipe",
        str(trl_grpo.RECIPE),
        "--steps",
        str(total),
        "--staleness",
        str(staleness),
        "--out",
        str(res),
        *sum((["--set", s] for s in sets), []),
        *(["--gradient-checkpointing"] if checkpointing else []),
    ]
    m = trl_grpo.measure(cmd, work / "trl-async.log", timeout_s=timeout_s)
    if keep is not None:
        for src, suffix in ((res, ".record.json"), (res.with_suffix(".server.log"), ".server.log")):
            if src.exists():
                shutil.copyfile(src, keep.with_suffix(suffix))
    if m["rc"] != 0 or not res.exists():
        tail = (work / "trl-async.log").read_text()[-3000:]
        return {
            "tool": "trl-async",
            "failed": True,
            "rc": m["rc"],
            "timed_out": m["timed_out"],
            "log_tail": tail,
        }
    rec = json.loads(res.read_text())
    if not rec.get("step_ends"):
        tail = (work / "trl-async.log").read_text()[-3000:]
        return {
            "tool": "trl-async",
            "failed": True,
            "rc": m["rc"],
            "error": "no step ended",
            "log_tail": tail,
        }
    ends = rec["step_ends"]
    starts = [rec["train_begin"], *ends[:-1]]
    steps = [
        {"start": s, "end": e, "generated_tokens": 0, "trained_tokens": 0, "generate_s": 0.0}
        for s, e in zip(starts, ends, strict=True)
    ]
    out = trl_grpo.summarize("trl-async", m, steps, warmup)
    out["versions"], out["attention"] = rec["versions"], rec["attention"]
    out["trl_config"], out["lora_sync"] = rec.get("config"), rec.get("lora_sync")
    out["cuda_max_allocated_gib"] = rec.get("cuda_max_allocated_gib")
    out["reward_mean"] = [lg.get("reward") for lg in rec["logs"] if "reward" in lg]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", type=Path, default=trl_grpo.RECIPE)
    ap.add_argument("--steps", type=int, required=True, help="optimizer steps in all (warm-up included)")
    ap.add_argument("--staleness", type=int, required=True, help="AsyncGRPOConfig.max_staleness")
    ap.add_argument("--out", type=Path, required=True, help="the record (JSON)")
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument(
        "--torch-varlen", action="store_true", help="torch's varlen_attn even where kernels exists"
    )
    a = ap.parse_args()
    a.process_start = time.time()
    trl_grpo.RECIPE = a.recipe.resolve()
    run_async(a)


if __name__ == "__main__":
    main()
