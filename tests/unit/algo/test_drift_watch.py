"""run.health.max_logprob_diff_growth (algo/correction.DriftWatch, health.check_drift): a trainer-vs-rollout log-prob
gap that grows as the weights move is reported; one that stays put (bf16 noise) or shrinks is not. Judged on the
records of real H200 runs committed under bench/results/ and on hand-made series."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from rlbridge.algo.correction import MismatchNotices
from rlbridge.algo.drift import DRIFT_FLOOR, DriftWatch
from rlbridge.errors import RlbridgeError
from rlbridge.health import check_drift
from rlbridge.recipe.schema import Recipe

RESULTS = Path(__file__).resolve().parents[3] / "bench" / "results"

EAGER_GPU_RUNS = [
    "quickstart_gpu-2026-12-01/metrics.jsonl",  # 30 steps, the gap 0.027 -> 0.007 as the policy sharpens
    "gsm8k_gpu-2026-12-01/metrics.jsonl",  # 40 steps at 0.022-0.028
    "inloop-gpu-2026-12-02/32768/metrics.jsonl",
    "inloop-gpu-2026-12-02/none/metrics.jsonl",
    "logprob_passes-gpu-2026-12-03/chunk-null.metrics.jsonl",
    "rollout_correction_gpu-2026-12-01/metrics-bypass.jsonl",
]


def train_records(name: str) -> list[dict[str, Any]]:
    lines = (RESULTS / name).read_text().splitlines()
    return [r for r in map(json.loads, filter(None, lines)) if r.get("kind", "train") == "train"]


def first_out(
    values: list[float], growth: float | None = 2.0, staleness: list[int] | None = None
) -> int | None:
    """The first step (1-based) the watch reports, or None."""
    watch = DriftWatch(growth)
    for i, v in enumerate(values):
        if watch.observe(v, 0 if staleness is None else staleness[i]):
            return i + 1
    return None


def test_the_compiled_trainer_on_the_h200_is_caught_and_eager_runs_are_not() -> None:
    """bench/results/compile_loop-gpu-2026-12-03.md: compiled decoder layers whose log-probs drifted from vLLM's
    (0.026 -> 0.07, reverted); the eager runs of the same model on the same kind of GPU stay silent."""
    compiled = [r["logprob_diff_mean"] for r in train_records("compile_loop-gpu-2026-12-03.metrics.jsonl")]
    assert first_out(compiled) == 8  # median of steps 6-8 (0.053) > 2 x median of steps 1-3 (0.026)
    for name in EAGER_GPU_RUNS:
        values = [r["logprob_diff_mean"] for r in train_records(name)]
        assert first_out(values) is None, name
        assert first_out(values, growth=1.3) is None, name  # far from the limit


def test_a_rollout_that_lost_its_weights_is_caught() -> None:
    """trl#5312 (vLLM sleep level 2 dropped the weights): the gap went 0.015 -> 0.201, under an absolute limit of
    0.5; the growth watch reports it once the last 3 steps' median passes twice the first 3 steps'."""
    values = [0.015, 0.016, 0.015, 0.02, 0.03, 0.05, 0.08, 0.12, 0.16, 0.201]
    # step 6: median(0.02, 0.03, 0.05) = 0.03, not above 2 x 0.015; step 7: median(0.03, 0.05, 0.08) = 0.05 is
    assert first_out(values) == 7
    assert first_out(values, growth=5.0) == 8  # median(0.05, 0.08, 0.12) = 0.08 > 0.075
    assert first_out(values, growth=None) is None


def test_float32_noise_under_the_floor_is_not_growth() -> None:
    """A float32 run's gap (~1e-5) can double from step to step; growth needs DRIFT_FLOOR (0.01) too."""
    values = [1e-5, 2e-5, 1e-5, 5e-5, 9e-5, 4e-5, 8e-5, 3e-4, 6e-4]
    assert first_out(values) is None
    assert first_out([1e-5] * 3 + [DRIFT_FLOOR * 2] * 3) == 6


def test_a_single_spike_is_not_growth() -> None:
    """The window's median: one bad step (a long response, a rare token) does not report."""
    values = [0.03, 0.03, 0.03, 0.03, 0.9, 0.03, 0.03, 0.9, 0.03]
    assert first_out(values) is None


def test_stale_steps_of_an_async_run_are_not_judged() -> None:
    """Samples one version old differ by the policy's own movement (the importance weights watch that)."""
    values = [0.02, 0.02, 0.02] + [0.2] * 10
    assert first_out(values, staleness=[0, 0, 0] + [1] * 10) is None
    watch = DriftWatch(2.0)
    assert watch.observe(0.02, 1) is None and watch.values == []


def test_a_resumed_run_keeps_the_baseline_of_its_first_steps() -> None:
    """Seeded with the records before the resume (metrics.jsonl), the watch judges the steps after it against the
    run's first steps, not against a baseline made of the already-drifted steps after the resume."""
    history = [
        {"kind": "train", "step": i + 1, "logprob_diff_mean": v, "staleness": 0}
        for i, v in enumerate([0.02, 0.02, 0.02, 0.03])
    ] + [{"kind": "eval", "step": 4, "eval_accuracy": 0.5}]
    watch = DriftWatch(2.0)
    watch.seed(history)
    assert watch.values == [0.02, 0.02, 0.02, 0.03]
    assert watch.observe(0.05) is None  # 5 steps: not judged yet
    problems = watch.observe(0.06)  # last 3: 0.03, 0.05, 0.06 -> 0.05 > 2 x 0.02
    assert problems is not None and len(problems) == 1 and "grew from 0.02" in problems[0]
    fresh = DriftWatch(2.0)  # without the history: the drifted steps would be the baseline
    assert [fresh.observe(v) for v in (0.05, 0.06, 0.07, 0.08, 0.09, 0.1)][-1] == []


def recipe(mini: int | None = None, **health: Any) -> Recipe:
    """8 prompts x 4 a step, mini-batches of `mini` prompts, run.health as given."""
    data = {"train": {"path": "builtin:arithmetic"}, "batch_size": 8, "mini_batch_size": mini}
    body = {
        "name": "t",
        "model": {"path": "x"},
        "data": data,
        "reward": {"fn": "arithmetic"},
        "rollout": {"n": 4},
        "run": {"health": health},
    }
    return Recipe.model_validate(body)


def test_the_loop_warns_once_then_every_tenth_step_and_tells_the_end(
    capsys: pytest.CaptureFixture[str],
) -> None:
    r, watch, notices = recipe(), DriftWatch(2.0), MismatchNotices(back="the gap is back")
    values = [0.02] * 3 + [0.1] * 20 + [0.02] * 3
    for step, v in enumerate(values, start=1):
        check_drift(r, watch, v, 0, step, notices)
    text = " ".join(capsys.readouterr().err.split())
    # judged from step 6 (3 + 3 steps); back at step 25, whose last 3 are 0.1, 0.02, 0.02
    assert re.findall(r"step (\d+):", text) == ["6", "16", "25"], text
    assert "step 6: rollout and trainer disagree: the trainer-vs-rollout log-prob gap grew from 0.02" in text
    assert "to 0.1 (of the last 3), over run.health.max_logprob_diff_growth 2x" in text
    assert "a weight sync that did not reach the rollout" in text
    assert "step 25: the gap is back (outside since step 6)" in text


def test_the_loop_stops_when_asked_and_the_key_turns_it_off() -> None:
    values = [0.02] * 3 + [0.1] * 3
    watch = DriftWatch(2.0)
    with pytest.raises(RlbridgeError, match=r"step 6: .*grew from 0\.02 .*on_mismatch: stop"):
        for step, v in enumerate(values, start=1):
            check_drift(recipe(on_mismatch="stop"), watch, v, 0, step)
    off = recipe(max_logprob_diff_growth=None)
    watch = DriftWatch(off.run.health.max_logprob_diff_growth)
    for step, v in enumerate(values, start=1):
        check_drift(off, watch, v, 0, step)


def test_the_key_is_validated() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="max_logprob_diff_growth"):
        recipe(max_logprob_diff_growth=1.0)


def test_bypass_with_several_optimizer_steps_is_not_watched() -> None:
    """There the later mini-batches' log-probs were computed after this step's first optimizer steps."""
    from rlbridge.health import agreement_gap

    m = {"logprob_diff_mean": 0.03}
    plain = recipe()
    assert agreement_gap(plain, m, 64) == 0.03
    assert agreement_gap(plain, {}, 64) is None

    def bypass(mini: int | None = None, epochs: int = 1) -> Recipe:
        r = recipe(mini)
        algorithm = r.algorithm.model_copy(
            update={"rollout_correction": r.algorithm.rollout_correction.model_copy(update={"bypass": True})}
        )
        trainer = r.trainer.model_copy(update={"ppo_epochs": epochs})
        return r.model_copy(update={"algorithm": algorithm, "trainer": trainer})

    assert agreement_gap(bypass(), m, 32) == 0.03  # one mini-batch: every row at the rollout's weights
    assert agreement_gap(bypass(4), m, 32) is None  # 2 mini-batches
    assert agreement_gap(bypass(epochs=2), m, 32) is None
    assert agreement_gap(recipe(4), m, 32) == 0.03  # old log-probs computed first
