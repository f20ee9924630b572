"""End-to-end GRPO step: rlbridge (the quickstart) against TRL's GRPOTrainer on the same setup, CPU or GPU.

Both sides: SmolLM2-135M-Instruct in float32, LoRA r16 / alpha 32 on q,k,v,o,gate,up,down, the quickstart's
arithmetic prompts with its template and the model's chat template (the very same prompts in the same
order: rlbridge's sampler order is fed to TRL unshuffled, and the prompt token ids are checked equal),
8 prompts x 4 completions per step, at most 48 new tokens, temperature 1, rewards arithmetic + 0.2 * format
(rlbridge's own functions), GRPO advantages (group mean / std), PPO clip 0.2, KL 0, token-mean loss over
the whole batch, one AdamW step per step (lr 2e-4 constant, clip 1.0), micro-batches of 8, no gradient
checkpointing, 2 torch threads. Every remaining difference is listed in the output (`differences`).

Each tool runs as a child process for `--warmup` + `--steps` steps (the warm-up steps are not counted);
with `--rounds 2` the order alternates (rlbridge, TRL, TRL, rlbridge) to spread the load of a shared
machine. Measured from outside, the same way for both: wall time per step (arrival of rlbridge's
metrics.jsonl lines / TRL's on_step_end), CPU seconds of the whole process tree per step, peak RSS and
PSS summed over the process tree (Ray's processes, vLLM's engine, reward workers included), and the load
average. Generated tokens = response tokens (EOS included); trained tokens = prompt + response tokens.

    bash bench/setup_trl.sh                        # installs trl into the venv, changing nothing else
    python bench/trl_grpo.py [--steps 5] [--warmup 1] [--rounds 1]
    python bench/trl_grpo.py --trl-vllm-colocate   # also try TRL with use_vllm=True, vllm_mode=colocate

On a GPU (`--recipe recipes/quickstart-gpu.yaml`, cluster.device cuda): both in the recipe's dtype (bf16), TRL
always with its colocated vLLM at the recipe's rollout.gpu_memory_utilization and without its importance-sampling
correction (as rlbridge's default), `--trl-micro` for TRL's per_device_train_batch_size and `--rlbridge-set` for
overrides of rlbridge alone (e.g. its token budget); the differences that remain are in GPU_DIFFERENCES.
`bash scripts/gpu_bench.sh trl` / `trl512` run it there (bench/results/trl_grpo-gpu-2026-12-02.md).
`--also-async` and `--also NAME:KEY=VALUE` (e.g. `kl:algorithm.kl.coef=0.05`) add rlbridge runs with those
overrides (tools rlbridge-async, rlbridge-NAME) to each round, with their own medians, means and ratios; a KEY
that starts with RLBRIDGE_ is set in that run's environment instead (e.g. `nocudnn:RLBRIDGE_CUDNN_ATTENTION=0`).
`--no-plain` leaves out the plain rlbridge run (TRL and the --also runs only). Each rlbridge run's metrics.jsonl
is copied to WORK/<tool>-<round>.metrics.jsonl, its workers' logs to WORK/<tool>-<round>.metrics.<worker>.log.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.proctree import LineArrivals, TreeMemory, load_average  # noqa: E402

RECIPE = ROOT / "recipes" / "quickstart.yaml"


# ------------------------------------------------------------------------------------- shared set-up
TRL_ATTN_ENV = "RLBRIDGE_BENCH_TRL_ATTN"
"""The attention implementation TRL's model is loaded with (`attn_implementation`, as GRPOConfig's
model_init_kwargs would pass it), when set in TRL's environment (ab_rounds.py --trl-attn)."""


def recipe(steps: int, sets: list[str]) -> Any:
    from rlbridge.recipe import load_recipe

    return load_recipe(RECIPE, [f"run.steps={steps}", "data.val=null", *sets])


def on_gpu(r: Any) -> bool:
    return bool(r.cluster.device == "cuda")


def step_prompts(r: Any, steps: int) -> list[list[tuple[Any, list[int]]]]:
    """(prompt, token ids) of each step's prompts, exactly as rlbridge's loop draws them."""
    from rlbridge.data.datasets import PromptSampler, encode_prompts, load_dataset
    from rlbridge.model.cache import ensure_model
    from rlbridge.model.tokenizer import load_tokenizer

    tok = load_tokenizer(ensure_model(r.model.path))
    prompts = load_dataset(r.data.train, r.data, split="train", seed=r.run.seed)
    ids, kept, _ = encode_prompts(tok, prompts, r.data, r.rollout.max_prompt_tokens)
    sampler = PromptSampler(kept, seed=r.run.seed, shuffle=r.data.shuffle)
    return [[(kept[i], ids[i]) for i in sampler.next_indices(r.data.batch_size)] for _ in range(steps)]


# ------------------------------------------------------------------------------------- TRL (child)
def run_trl(
    total: int,
    sets: list[str],
    out: Path,
    use_vllm: bool,
    micro: int | None = None,
    config: dict[str, Any] | None = None,
    callbacks: list[Any] | None = None,
) -> None:
    """TRL's GRPOTrainer on the recipe's settings; on a GPU recipe (cluster.device cuda) in the model's dtype with
    its colocated vLLM (always), on a CPU one in float32 with transformers generate unless `use_vllm`. `config`:
    GRPOConfig fields set last, over the ones derived from the recipe (--trl-config KEY=VALUE); `callbacks`: more
    TrainerCallbacks (bench/equal_wall.py's time limit)."""
    import torch

    r = recipe(total, sets)
    gpu = on_gpu(r)
    if not gpu:
        torch.set_num_threads(os.cpu_count() or 1)
    import datasets
    import peft
    import transformers
    import trl
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlbridge.data.datasets import render_messages
    from rlbridge.data.rewards import BUILTINS
    from rlbridge.model.cache import ensure_model
    from rlbridge.model.tokenizer import load_tokenizer
    from rlbridge.recipe.targets import hf_targets

    use_vllm = use_vllm or gpu
    micro = micro or r.trainer.micro_batch_size
    model_dir = ensure_model(r.model.path)
    plan = step_prompts(r, total)
    row_keys = list(plan[0][0][0].row)
    rows = [
        {"prompt": render_messages(p, r.data), **p.row, "answer": p.answer} for step in plan for p, _ in step
    ]
    dataset = datasets.Dataset.from_list(rows)

    def reward_fn(name: str) -> Any:
        fn = BUILTINS[name]

        def reward(prompts: list[Any], completions: list[Any], **kw: Any) -> list[float]:
            out = []
            for i, c in enumerate(completions):
                row = {k: kw[k][i] for k in row_keys}
                text = c[0]["content"] if isinstance(c, list) else c
                out.append(fn(row["question"], text, row))
            return out

        reward.__name__ = name
        return reward

    terms = r.reward.terms
    ro, opt = r.rollout, r.trainer.optim
    kwargs: dict[str, Any] = dict(
        output_dir=tempfile.mkdtemp(prefix="trl-bench-"),
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=r.run.seed,
        max_steps=total,
        use_cpu=not gpu,
        bf16=r.model.dtype == "bfloat16",
        fp16=r.model.dtype == "float16",
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=r.rollouts_per_step // micro,
        num_generations=ro.n,
        max_completion_length=ro.max_response_tokens,
        shuffle_dataset=False,
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
        gradient_checkpointing=False,
        beta=r.algorithm.kl.coef,
        loss_type="dapo",
        scale_rewards="group",
        epsilon=r.algorithm.clip.low,
        epsilon_high=r.algorithm.clip.high,
        num_iterations=1,
        reward_weights=[t.weight for t in terms],
        remove_unused_columns=False,
        dataloader_num_workers=0,
        log_completions=False,
        use_vllm=use_vllm,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=r.rollout.gpu_memory_utilization if gpu else 0.2,
        vllm_max_model_length=ro.max_prompt_tokens + ro.max_response_tokens if gpu else 512,
        # rlbridge's default: no importance weights of the rollout engine's log-probs, hence no extra forward
        # for old log-probs (TRL's default True adds one per step)
        vllm_importance_sampling_correction=False,
    )
    unknown = sorted(set(config or {}) - {f.name for f in dataclasses.fields(GRPOConfig)})
    if unknown:
        raise SystemExit(f"--trl-config: {unknown} are not GRPOConfig fields of trl {trl.__version__}")
    args = GRPOConfig(**{**kwargs, **(config or {})})
    lora = LoraConfig(
        r=r.lora.rank,
        lora_alpha=r.lora.alpha,
        lora_dropout=r.lora.dropout,
        target_modules=hf_targets(r.lora.targets),
        task_type="CAUSAL_LM",
    )
    attn = os.environ.get(TRL_ATTN_ENV) or None  # transformers' default (sdpa) unless set
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, r.model.dtype), attn_implementation=attn
    )
    record: dict[str, Any] = {
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "peft": peft.__version__,
        },
        "step_ends": [],
        "logs": [],
        "generations": [],
        "rewards_s": [],
        "config": {k: getattr(args, k, None) for k in TRL_CONFIG_SHOWN},
        "config_overrides": config or {},
        "attn_implementation": model.config._attn_implementation,
    }

    class Timing(TrainerCallback):
        def on_train_begin(self, *a: Any, **k: Any) -> None:
            record["train_begin"] = time.time()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            record["step_ends"].append(time.time())

        def on_log(
            self, _args: Any, _state: Any, _control: Any, logs: dict[str, Any] | None = None, **k: Any
        ) -> None:
            record["logs"].append(dict(logs or {}))

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward_fn(t.fn) for t in terms],
        args=args,
        train_dataset=dataset,
        processing_class=load_tokenizer(model_dir),
        peft_config=lora,
        callbacks=[Timing(), *(callbacks or [])],
    )
    record["optimizer"] = args.optim
    generate, rewards = trainer._generate_single_turn, trainer._calculate_rewards

    def timed_generate(prompt_ids: list[list[int]], *a: Any, **k: Any) -> Any:
        t = time.time()
        completion_ids, logprobs = generate(prompt_ids, *a, **k)
        record["generations"].append(
            {
                "start": t,
                "seconds": time.time() - t,
                "generated_tokens": sum(len(c) for c in completion_ids),
                "prompt_tokens": sum(len(p) for p in prompt_ids),
                "prompt_ids": [list(map(int, p)) for p in prompt_ids],
            }
        )
        return completion_ids, logprobs

    def timed_rewards(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        res = rewards(*a, **k)
        record["rewards_s"].append(time.perf_counter() - t)
        return res

    trainer._generate_single_turn, trainer._calculate_rewards = timed_generate, timed_rewards
    try:
        trainer.train()
    finally:
        # the same prompts as rlbridge, in the same order: TRL repeats each prompt n times, consecutively
        expected = [[ids for _, ids in step] for step in plan]
        got = [g.pop("prompt_ids")[:: ro.n] for g in record["generations"]]
        record["prompt_ids_match"] = got == expected[: len(got)]
        if gpu:
            record["cuda_max_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
        out.write_text(json.dumps(record, default=str))


TRL_CONFIG_SHOWN = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "steps_per_generation",
    "generation_batch_size",
    "gradient_checkpointing",
    "use_vllm",
    "vllm_mode",
    "vllm_enable_sleep_mode",
    "vllm_gpu_memory_utilization",
    "use_liger_kernel",
    "torch_compile",
    "bf16",
    "loss_type",
    "beta",
    "num_iterations",
    "vllm_importance_sampling_correction",
)
"""The GRPOConfig fields each TRL record keeps as they took effect (a tuned run shows its tuning)."""


def parse_trl_config(items: list[str]) -> dict[str, Any]:
    """--trl-config KEY=VALUE items as GRPOConfig overrides; VALUE is read as JSON where it parses (true, 512,
    0.3, null), else kept as a string."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--trl-config {item!r}: expected KEY=VALUE, e.g. gradient_checkpointing=true")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


class WeightedReward:
    """rlbridge's builtin reward `name` times `weight` as a TRL reward function: a callable instance named after the
    reward (TRL logs it under `__name__`), picklable for AsyncGRPO's spawned reward process."""

    def __init__(self, name: str, weight: float, row_keys: list[str]) -> None:
        self.__name__, self.weight, self.row_keys = name, weight, row_keys

    def __call__(self, prompts: list[Any], completions: list[Any], **kw: Any) -> list[float]:
        from rlbridge.data.rewards import BUILTINS

        fn = BUILTINS[self.__name__]
        out = []
        for i, c in enumerate(completions):
            row = {k: kw[k][i] for k in self.row_keys}
            text = c[0]["content"] if isinstance(c, list) else c
            out.append(self.weight * fn(row["question"], text, row))
        return out


# --------------------------------------------------------------------------------- the two runs
def measure(
    cmd: list[str],
    log: Path,
    lines: Path | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """Run `cmd` as a child (with `env` added to the environment) in its own process group, sampling its process
    tree; returns timing, memory, load and (optionally) the arrival time of each line of the file `lines`. Past
    `timeout_s` (or on an interrupt) the whole group is killed (`timed_out`); processes of the group still alive
    20 s after the child's exit are killed too, so the next run starts on a free machine (`leftover_killed`)."""
    load_before = load_average()
    t0 = time.time()
    timed_out = False
    with log.open("w") as f:
        proc = start_group(cmd, f, env)
        arrivals = LineArrivals(lines) if lines is not None else None
        with TreeMemory(proc.pid) as mem, arrivals if arrivals is not None else contextlib.nullcontext():
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                kill_group(proc.pid)
                rc, timed_out = proc.wait(), True
            except BaseException:
                kill_group(proc.pid)
                raise
    end = time.time()
    return {
        "rc": rc,
        "timed_out": timed_out,
        "leftover_killed": end_group(proc.pid),
        "start": t0,
        "end": end,
        "mem": mem,
        "arrivals": arrivals.lines if arrivals else [],
        "load_before": load_before,
        "load_after": load_average(),
    }


def start_group(cmd: list[str], out: IO[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`cmd` as a child in a process group of its own (its pid is the group's: kill_group / end_group end it), in the
    repository, stdout and stderr to `out`, `env` added to the environment."""
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=out,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def group_alive(pgid: int) -> list[int]:
    """The live (not zombie) processes of the process group `pgid`."""
    import psutil

    alive = []
    for proc in psutil.process_iter(["status"]):
        with contextlib.suppress(psutil.Error, OSError):
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(proc.pid) == pgid:
                alive.append(proc.pid)
    return alive


def end_group(pgid: int, grace_s: float = 20.0) -> bool:
    """Waits up to `grace_s` for the processes left in the group `pgid` (a child's children: Ray's, vLLM's) to
    end, then kills them; True when some had to be killed."""
    deadline = time.time() + grace_s
    while group_alive(pgid):
        if time.time() > deadline:
            kill_group(pgid)
            return True
        time.sleep(0.5)
    return False


def summarize(name: str, m: dict[str, Any], steps: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """steps: per step {start, end, generated_tokens, trained_tokens, generate_s}; the first `warmup` are skipped."""
    timed = steps[warmup:]
    mem: TreeMemory = m["mem"]
    wall = [s["end"] - s["start"] for s in timed]
    cpu = [mem.cpu_between(s["start"], s["end"]) for s in timed]
    seconds = sum(wall)
    gen_tokens = sum(s["generated_tokens"] for s in timed)
    train_tokens = sum(s["trained_tokens"] for s in timed)
    gen_s = sum(s["generate_s"] for s in timed)
    load = mem.load_between(timed[0]["start"], timed[-1]["end"]) if timed else None
    return {
        "tool": name,
        "steps_timed": len(timed),
        "step_s": seconds / max(len(timed), 1),
        "step_s_min": min(wall, default=0.0),
        "step_s_max": max(wall, default=0.0),
        "step_cpu_s": sum(cpu) / max(len(timed), 1),
        "generate_s": gen_s / max(len(timed), 1),
        "rest_s": (seconds - gen_s) / max(len(timed), 1),
        "generated_tokens_per_step": gen_tokens / max(len(timed), 1),
        "generated_tokens_per_s": gen_tokens / seconds if seconds else 0.0,
        "generation_phase_tokens_per_s": gen_tokens / gen_s if gen_s else 0.0,
        "trained_tokens_per_s": train_tokens / seconds if seconds else 0.0,
        "startup_s": steps[0]["start"] - m["start"] if steps else None,
        "first_step_s": steps[0]["end"] - steps[0]["start"] if steps else None,
        # process start to the end of the first step: what a user waits for the first update
        "time_to_first_step_s": steps[0]["end"] - m["start"] if steps else None,
        "total_wall_s": m["end"] - m["start"],
        "leftover_killed": m["leftover_killed"],
        **mem.result(),
        "load_avg_during_steps": load,
        "load_before": m["load_before"],
        "load_after": m["load_after"],
        "per_step_s": [round(w, 2) for w in wall],
    }


def rlbridge_cmd(verb: str, total: int, sets: list[str], *extra: str) -> list[str]:
    """`python -m rlbridge <verb>` on RECIPE for a run of `total` steps without evaluation, `sets` applied last."""
    overrides = [
        "--set",
        f"run.steps={total}",
        "--set",
        "data.val=null",
        *sum((["--set", s] for s in sets), []),
    ]
    return [sys.executable, "-m", "rlbridge", verb, str(RECIPE), *extra, *overrides]


def validate_rlbridge(total: int, sets: list[str], env: dict[str, str] | None = None) -> None:
    """`rlbridge validate-recipe` of the run that run_rlbridge would start, on this machine (its devices and the
    plan's memory check): a recipe the CLI would refuse stops the benchmark here, with the CLI's message, before
    any round spends the budget."""
    cmd = rlbridge_cmd("validate-recipe", total, sets)
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=600)
    if p.returncode != 0:
        raise SystemExit(
            f"rlbridge would refuse this run (validate-recipe rc {p.returncode}):\n{p.stdout}{p.stderr}"
        )


def run_rlbridge(
    total: int,
    warmup: int,
    sets: list[str],
    work: Path,
    plan: list[list[tuple[Any, list[int]]]],
    n: int,
    env: dict[str, str] | None = None,
    keep: Path | None = None,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """`env`: variables added to the run's environment; `keep`: where its metrics.jsonl is copied (flat);
    `timeout_s`: the run is killed past it (a failed run)."""
    run_dir = work / f"rlbridge-{time.time_ns()}"
    cmd = rlbridge_cmd("train", total, sets, "--run-dir", str(run_dir))
    m = measure(cmd, work / "rlbridge.log", run_dir / "metrics.jsonl", env=env, timeout_s=timeout_s)
    if keep is not None and (run_dir / "metrics.jsonl").exists():
        shutil.copyfile(run_dir / "metrics.jsonl", keep)
        for log_file in sorted(
            (run_dir / "logs").glob("*.log")
        ):  # the workers' logs: load and generate times
            shutil.copyfile(log_file, keep.with_suffix(f".{log_file.name}"))
    if m["rc"] != 0:
        why = f"killed after {timeout_s:.0f} s" if m["timed_out"] else f"rc {m['rc']}"
        tail = (
            (work / "rlbridge.log").read_text(errors="replace")[-800:]
            if (work / "rlbridge.log").exists()
            else ""
        )
        raise SystemExit(f"rlbridge failed ({why}); log: {work / 'rlbridge.log'}; its end:\n{tail}")
    records = [(t, json.loads(line)) for t, line in m["arrivals"]]
    train = [(t, rec) for t, rec in records if rec.get("kind") == "train"]
    steps = []
    for i, (t, rec) in enumerate(train):
        # the step began when the previous record arrived; the first one, time_step before its arrival
        start = train[i - 1][0] if i else t - rec["time_step"]
        prompt_tokens = sum(len(ids) for _, ids in plan[i]) * n
        steps.append(
            {
                "start": start,
                "end": t,
                "generated_tokens": rec["tokens"],
                "trained_tokens": rec["tokens"] + prompt_tokens,
                "generate_s": rec.get("time_generate", 0.0),
                # time_* phases, and vLLM's sleep (inside update) and wake (inside sync) on colocated GPUs
                "phases": {
                    **{k.removeprefix("time_"): v for k, v in rec.items() if k.startswith("time_")},
                    **{k: v for k, v in rec.items() if k in ("sleep_s", "wake_s")},
                },
                "reward_mean": rec.get("reward_mean"),
            }
        )
    out = summarize("rlbridge", m, steps, warmup)
    timed = steps[warmup:]
    phases = sorted({k for s in timed for k in s["phases"]})
    out["phases_s"] = {p: sum(s["phases"].get(p, 0.0) for s in timed) / max(len(timed), 1) for p in phases}
    out["reward_mean"] = [s["reward_mean"] for s in steps]
    return out


def run_trl_measured(
    total: int,
    warmup: int,
    sets: list[str],
    work: Path,
    use_vllm: bool,
    micro: int | None,
    config: list[str] | None = None,
    keep: Path | None = None,
    timeout_s: float | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """TRL in a child process (run_trl); `config`: --trl-config KEY=VALUE items; `keep`: where the child's raw
    record (per-step logs, the effective GRPOConfig) is copied; `timeout_s`: the run is killed past it; `env`:
    variables added to its environment."""
    res = work / f"trl-{time.time_ns()}.json"
    cmd = [
        sys.executable,
        __file__,
        "--recipe",
        str(RECIPE),
        *(["--trl-micro", str(micro)] if micro else []),
        "--child-trl",
        str(res),
        "--steps",
        str(total),
        "--warmup",
        "0",
        *sum((["--set", s] for s in sets), []),
        *(["--trl-vllm-colocate"] if use_vllm else []),
        *sum((["--trl-config", c] for c in config or []), []),
    ]
    m = measure(cmd, work / "trl.log", env=env, timeout_s=timeout_s)
    if m["rc"] != 0 or not res.exists():
        tail = (work / "trl.log").read_text()[-3000:]
        return {"tool": "trl", "failed": True, "rc": m["rc"], "timed_out": m["timed_out"], "log_tail": tail}
    if keep is not None:
        shutil.copyfile(res, keep)
    rec = json.loads(res.read_text())
    ends, gens = rec["step_ends"], rec["generations"]
    starts = [rec["train_begin"], *ends[:-1]]
    steps = []
    for i, (start, end) in enumerate(zip(starts, ends, strict=True)):
        g = gens[i] if i < len(gens) else {"generated_tokens": 0, "prompt_tokens": 0, "seconds": 0.0}
        steps.append(
            {
                "start": start,
                "end": end,
                "generated_tokens": g["generated_tokens"],
                "trained_tokens": g["generated_tokens"] + g["prompt_tokens"],
                "generate_s": g["seconds"],
            }
        )
    out = summarize("trl", m, steps, warmup)
    out["versions"], out["optimizer"] = rec["versions"], rec.get("optimizer")
    out["prompt_ids_match_rlbridge"] = rec["prompt_ids_match"]
    out["trl_config"] = rec.get("config")
    out["cuda_max_allocated_gib"] = rec.get("cuda_max_allocated_gib")
    out["generation_calls"] = len(gens)
    out["reward_mean"] = [lg.get("reward") for lg in rec["logs"] if "reward" in lg]
    return out


DIFFERENCES = [
    "generation: rlbridge samples with vLLM-CPU (float32, paged KV cache, continuous batching) in its own Ray "
    "actor from merged weights; TRL samples with transformers generate (use_vllm=False) on the PEFT model "
    "(LoRA layers unmerged, so every generated token also runs the adapters), in the training process, as one "
    "left-padded batch of 32 with a static KV cache per sequence",
    "weight sync: rlbridge merges the LoRA adapters into a float32 copy of the weights after every update, writes "
    "them as safetensors to a RAM-backed directory and reloads them into vLLM (time_sync); TRL has none (one model)",
    "processes: rlbridge = driver + Ray (GCS, raylet, dashboard agent, workers) + trainer actor + rollout actor + "
    "vLLM engine-core process + reward worker processes; TRL = one process. Memory is the sum over each tree",
    "sampling: different RNG streams and engines, so the completions (and their lengths) differ; compare tokens/s, "
    "not only seconds per step",
    "loss: rlbridge PPO-clip (0.2/0.2) token-mean over all response tokens of the batch; TRL loss_type='dapo' "
    "(sum over the tokens of each micro-batch / number of tokens of the whole generation batch): the same "
    "objective. TRL shuffles the 32 sequences across its 4 micro-batches; rlbridge keeps groups together",
    "advantages: both (r - group mean) / (unbiased group std + eps); eps 1e-6 (rlbridge) vs 1e-4 (TRL)",
    "old log-probs: neither recomputes them (one optimizer step per batch, on-policy: ratio 1 at the detached "
    "current log-probs); KL coefficient 0 in both (no reference forward)",
    "entropy: TRL computes per-token entropy inside the training forward (logged only); rlbridge computes it "
    "under no_grad from the same logits (entropy_coef 0)",
    "rewards: same functions (rlbridge.data.rewards arithmetic + 0.2 x format); rlbridge scores in a pool of "
    "worker processes, TRL in-process",
    "optimizer: AdamW (torch, non-fused: TRL with optim=adamw_torch, not its default fused), lr 2e-4 constant, "
    "betas (0.9, 0.999), eps 1e-8, weight decay 0, grad-norm clip 1.0, one optimizer step per step in both; "
    "TRL via accelerate/Trainer (gradient accumulation over 4 micro-batches of 8)",
    "TRL defaults changed to match: gradient_checkpointing False (TRL default True), bf16 False (TRL default "
    "True), lr_scheduler constant (Trainer default linear), shuffle_dataset False (rlbridge's order fed in)",
    "padding: TRL left-pads prompts to the longest prompt and right-pads responses to the longest response of "
    "the 32 sequences, micro-batches of 8 at that width; rlbridge (since 2026-12-02) groups the rows by length "
    "into 4 micro-batches of 8, each trimmed to its own widths (rlbridge/engines/micro.py)",
    "per step outside the timed loop: rlbridge writes metrics.jsonl + a console line, and saves a final "
    "checkpoint after the last step (not in any step); TRL logs its metrics every step (logging_steps=1)",
    "health checks: rlbridge's first-step gate snapshots the trainable weights and fingerprints the frozen ones "
    "(first update only, in the warm-up step)",
    "start-up (reported, not in the step times): rlbridge starts Ray, the trainer actor and the vLLM engine "
    "(~20 s); TRL loads the model in-process",
]


GPU_DIFFERENCES = [
    "both in the recipe's dtype (bfloat16) on one GPU, each with a colocated vLLM at the recipe's "
    "rollout.gpu_memory_utilization: rlbridge's in its rollout actor (sleeps during the update, adapter or merged "
    "sync per rollout.weight_sync), TRL's in the training process (vllm_mode colocate, no sleep mode: its default; "
    "it loads the merged weights into vLLM every step)",
    "logits: rlbridge computes the output layer in float32 (vLLM's head_dtype float32 too); TRL in bfloat16 "
    "(its cast_lm_head_to_fp32 refuses tied embeddings, which SmolLM2 has)",
    "importance sampling: off in both (TRL's vllm_importance_sampling_correction=False, which would add a "
    "forward for old log-probs; rlbridge's rollout_correction defaults change nothing)",
    "micro-batches: TRL per_device_train_batch_size = --trl-micro (default trainer.micro_batch_size) with "
    "gradient accumulation to the whole batch; rlbridge micro_batch_size or trainer.max_tokens_per_micro_batch "
    "(rows grouped by length, each pass at its own widths); the gradient is the same mean over the batch",
    *DIFFERENCES[3:10],
    "TRL defaults changed to match: gradient_checkpointing False (TRL default True), lr_scheduler constant "
    "(Trainer default linear), shuffle_dataset False (rlbridge's order fed in)",
]


ASYNC = ["rollout.mode=async", "rollout.max_staleness=1", "algorithm.rollout_correction.weights=token"]
"""--also-async: rlbridge's overlapped loop, samples one weight version old with token TIS (docs/async.md)."""


def main() -> None:
    global RECIPE
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--recipe", type=Path, default=RECIPE, help="quickstart.yaml (CPU) or quickstart-gpu.yaml"
    )
    ap.add_argument(
        "--trl-micro", type=int, help="TRL's per_device_train_batch_size (default: trainer.micro_batch_size)"
    )
    ap.add_argument("--steps", type=int, default=5, help="timed steps per tool (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1, help="runs per tool, alternating the order")
    ap.add_argument("--set", action="append", default=[], dest="sets", help="recipe override for both tools")
    ap.add_argument(
        "--rlbridge-set",
        action="append",
        default=[],
        dest="rlbridge_sets",
        help="recipe override for rlbridge only (e.g. trainer.max_tokens_per_micro_batch=32768)",
    )
    ap.add_argument(
        "--trl-vllm-colocate", action="store_true", help="TRL with use_vllm=True, vllm_mode=colocate"
    )
    ap.add_argument(
        "--also-async",
        action="store_true",
        help="also run rlbridge with rollout.mode async (max_staleness 1, token TIS; docs/async.md) in each round",
    )
    ap.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE",
        help="also run rlbridge with these overrides as tool rlbridge-NAME in each round (repeat a NAME for more "
        "than one override), e.g. kl:algorithm.kl.coef=0.05",
    )
    ap.add_argument(
        "--no-plain", action="store_true", help="leave out the plain rlbridge run (TRL, --also runs)"
    )
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument(
        "--work", type=Path, help="where the runs and their logs go (default: a new temporary folder)"
    )
    ap.add_argument(
        "--trl-config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a GRPOConfig field for TRL, set last (VALUE read as JSON where it parses), e.g. "
        "gradient_checkpointing=true, vllm_enable_sleep_mode=true, use_liger_kernel=true",
    )
    ap.add_argument("--child-trl", help=argparse.SUPPRESS)
    a = ap.parse_args()
    RECIPE = a.recipe.resolve()
    total = a.steps + a.warmup
    if a.child_trl:
        run_trl(
            total, a.sets, Path(a.child_trl), a.trl_vllm_colocate, a.trl_micro, parse_trl_config(a.trl_config)
        )
        return
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        raise SystemExit("trl is not installed: run `bash bench/setup_trl.sh` first")
    work = a.work or Path(tempfile.mkdtemp(prefix="bench-trl-"))
    work.mkdir(parents=True, exist_ok=True)
    r = recipe(total, a.sets)
    plan = step_prompts(r, total)
    runs: list[dict[str, Any]] = []
    variants = variant_sets(a)
    for k in range(a.rounds):
        order = ("rlbridge", "trl") if k % 2 == 0 else ("trl", "rlbridge")
        if a.no_plain:
            order = ("trl",)
        extra = tuple(variants)
        order = (*order, *extra) if k % 2 == 0 else (*extra, *order)
        for tool in order:
            print(f"[bench] round {k + 1}/{a.rounds}: {tool} ({total} steps)", file=sys.stderr, flush=True)
            try:
                if tool == "trl":
                    res = run_trl_measured(
                        total, a.warmup, a.sets, work, a.trl_vllm_colocate, a.trl_micro, a.trl_config
                    )
                else:
                    own, env = split_env(variants.get(tool, []))
                    sets = [*a.sets, *a.rlbridge_sets, *own]
                    keep = work / f"{tool}-{k + 1}.metrics.jsonl"
                    res = run_rlbridge(total, a.warmup, sets, work, plan, r.rollout.n, env, keep)
                    res["tool"] = tool
            except SystemExit as e:
                res = {"tool": tool, "failed": True, "error": str(e)}
            res["round"] = k + 1
            runs.append(res)
            print(
                f"[bench] {tool}: step_s {res.get('step_s')}, load {load_average()}",
                file=sys.stderr,
                flush=True,
            )
            finish(a, runs, save=not a.no_save, final=False)  # a partial result survives an interrupted run
    finish(a, runs, save=not a.no_save, final=True)


def variant_sets(a: argparse.Namespace) -> dict[str, list[str]]:
    """--also-async and --also NAME:KEY=VALUE: tool name (rlbridge-NAME) -> its recipe overrides, in order."""
    variants: dict[str, list[str]] = {"rlbridge-async": list(ASYNC)} if a.also_async else {}
    for spec in a.also:
        name, sep, override = spec.partition(":")
        if not sep or not name or "=" not in override:
            raise SystemExit(f"--also {spec!r}: expected NAME:KEY=VALUE, e.g. kl:algorithm.kl.coef=0.05")
        variants.setdefault(f"rlbridge-{name}", []).append(override)
    return variants


def split_env(overrides: list[str]) -> tuple[list[str], dict[str, str]]:
    """A variant's overrides as recipe overrides and environment variables (those whose key starts RLBRIDGE_)."""
    env = dict(o.split("=", 1) for o in overrides if o.startswith("RLBRIDGE_"))
    return [o for o in overrides if not o.startswith("RLBRIDGE_")], env


def finish(a: argparse.Namespace, runs: list[dict[str, Any]], *, save: bool, final: bool) -> None:
    variants = variant_sets(a)
    ok = {
        t: [x for x in runs if x["tool"] == t and not x.get("failed")] for t in ("rlbridge", "trl", *variants)
    }

    def mean(tool: str, key: str) -> float | None:
        vals = [x[key] for x in ok[tool] if x.get(key) is not None]
        return statistics.fmean(vals) if vals else None

    # a load spike on a shared machine can multiply one step's time: the median and the fastest of all the
    # timed steps of each tool are reported beside the mean
    steps = {t: sorted(s for x in ok[t] for s in x["per_step_s"]) for t in ok if ok[t]}
    median = {t: statistics.median(v) for t, v in steps.items()}
    ratios: dict[str, Any] = {}
    if ok["rlbridge"] and ok["trl"]:
        for key in (
            "step_s",
            "step_cpu_s",
            "generated_tokens_per_s",
            "trained_tokens_per_s",
            "peak_pss_gib",
            "peak_rss_gib",
        ):
            x, y = mean("rlbridge", key), mean("trl", key)
            ratios[f"{key}_rlbridge_over_trl"] = x / y if x and y else None
        for t in ("rlbridge", "trl"):
            ratios[f"{t}_step_s_median"], ratios[f"{t}_step_s_min"] = median[t], steps[t][0]
        ratios["step_s_median_rlbridge_over_trl"] = median["rlbridge"] / median["trl"]
        ratios["step_s_min_rlbridge_over_trl"] = steps["rlbridge"][0] / steps["trl"][0]
        ratios["rlbridge_step_faster_mean"] = mean("rlbridge", "step_s") < mean("trl", "step_s")  # type: ignore[operator]
        ratios["rlbridge_step_faster_median"] = median["rlbridge"] < median["trl"]
    for tool in variants:  # --also-async (async_...), --also NAME:...: the same medians for each variant
        if ok[tool] and ok["trl"]:
            name = tool.removeprefix("rlbridge-")
            ratios[f"{name}_step_s_median"] = median[tool]
            ratios[f"trl_over_{name}_step_s_median"] = median["trl"] / median[tool]
            ratios[f"{name}_step_s_mean"] = statistics.fmean(steps[tool])
            ratios[f"trl_over_{name}_step_s_mean"] = statistics.fmean(steps["trl"]) / statistics.fmean(
                steps[tool]
            )
            if ok["rlbridge"]:
                ratios[f"rlbridge_over_{name}_step_s_median"] = median["rlbridge"] / median[tool]
    rows = [
        {
            k: x.get(k)
            for k in (
                "tool",
                "round",
                "step_s",
                "step_cpu_s",
                "generate_s",
                "rest_s",
                "generated_tokens_per_step",
                "generated_tokens_per_s",
                "trained_tokens_per_s",
                "peak_rss_gib",
                "peak_pss_gib",
                "startup_s",
                "load_avg_during_steps",
            )
        }
        for x in runs
    ]
    from bench.common import report

    gpu = on_gpu(recipe(1, a.sets))
    result = {
        "settings": {
            "steps": a.steps,
            "warmup": a.warmup,
            "rounds": a.rounds,
            "sets": a.sets,
            "rlbridge_sets": a.rlbridge_sets,
            "variants": variants,
            "trl_vllm_colocate": a.trl_vllm_colocate or gpu,
            "trl_micro": a.trl_micro,
            "trl_config": a.trl_config,
            "recipe": f"{a.recipe} + run.steps, data.val=null",
        },
        "complete": final,
        "ratios": ratios,
        "differences": GPU_DIFFERENCES if gpu else DIFFERENCES,
        "runs": runs,
    }
    if final:
        report("trl_grpo", result, rows, save=save)
    elif save:
        with contextlib.redirect_stdout(sys.stderr):
            report("trl_grpo", result, rows, save=True)


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        raise
