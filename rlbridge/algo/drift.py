"""run.health.max_logprob_diff_growth: whether the trainer-vs-rollout log-prob gap grows as a run goes on. Pure
Python over the metrics records (no torch): the loop asks it after every update (health.check_drift) and `rlbridge
report` replays a run's records through it."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping

DRIFT_STEPS = 3
"""On-policy steps in the baseline (the first ones) and in the window compared with it (the last ones)."""
DRIFT_FLOOR = 0.01
"""Nats: a grown gap must also be this far above its baseline. A float32 run's gap (~1e-5) doubles by noise alone,
while a bf16 run's sits a few hundredths from zero and moves by less than this (docs/defaults.md#drift-floor)."""


class DriftWatch:
    """run.health.max_logprob_diff_growth: whether the trainer-vs-rollout log-prob gap (logprob_diff_mean) has grown
    since the run began. Two sides that compute with the same weights differ by their kernels and dtypes, a gap that
    stays put (or shrinks as the policy sharpens) however far training goes; one side that computes with weights the
    other does not have (a sync that did not reach the rollout, vLLM sleep dropping weights, a compiled trainer graph
    holding the weights of its compilation) differs more as the weights move, in cases seen far below the absolute
    limit run.health.max_logprob_diff (0.5) (docs/defaults.md#drift-floor).

    Out: the median over the last DRIFT_STEPS on-policy steps is above `growth` times the median over the first
    DRIFT_STEPS, and DRIFT_FLOOR above it. Only on-policy steps count (staleness 0: the samples came from the weights
    the trainer starts the step with); an async run's stale steps differ by the policy's own movement, which the
    importance weights watch. A resumed run is seeded with its records so far (metrics.jsonl), so the baseline is
    the run's first steps, not the ones after the resume."""

    def __init__(self, growth: float | None) -> None:
        self.growth = growth
        self.values: list[float] = []
        """logprob_diff_mean of every on-policy step so far, in order."""

    def seed(self, history: Iterable[Mapping[str, object]]) -> None:
        """Take the records of a resumed run so far (metrics.jsonl, cut back to its checkpoint)."""
        for record in history:
            if record.get("kind", "train") == "train":
                self._add(record.get("logprob_diff_mean"), record.get("staleness"))

    def _add(self, diff: object, staleness: object) -> bool:
        if not isinstance(diff, (int, float)) or not math.isfinite(diff) or staleness not in (None, 0):
            return False
        self.values.append(float(diff))
        return True

    def observe(self, diff: object, staleness: object = 0) -> list[str] | None:
        """Take one step's logprob_diff_mean (None where the step has none) and its samples' staleness; what is wrong
        (one sentence, or an empty list), or None where the step is not judged (off-policy, no gap measured, too
        few steps yet, or the check off)."""
        if not self._add(diff, staleness) or self.growth is None or len(self.values) < 2 * DRIFT_STEPS:
            return None
        base = statistics.median(self.values[:DRIFT_STEPS])
        now = statistics.median(self.values[-DRIFT_STEPS:])
        if now > self.growth * base and now > base + DRIFT_FLOOR:
            return [
                f"the trainer-vs-rollout log-prob gap grew from {base:.3g} (median of the first {DRIFT_STEPS} "
                f"on-policy steps) to {now:.3g} (of the last {DRIFT_STEPS}), over run.health.max_logprob_diff_growth "
                f"{self.growth:g}x: one side likely computes with weights the other does not have"
            ]
        return []


def measures_agreement(*, bypass: bool, ppo_epochs: int, mini_batches: int) -> bool:
    """Whether a step's logprob_diff_mean measures how the two sides agree on the same weights: not in bypass mode
    with several optimizer steps per step, where the later rows' log-probs include the step's own movement
    (TrainerRole.update)."""
    return not (bypass and (ppo_epochs > 1 or mini_batches > 1))


def first_growth(records: Iterable[Mapping[str, object]], growth: float | None) -> tuple[int, str] | None:
    """The first step of a run's train records at which the watch reports, and what it says; None if it never does."""
    watch = DriftWatch(growth)
    for record in records:
        problems = watch.observe(record.get("logprob_diff_mean"), record.get("staleness"))
        if problems:
            step = record.get("step")
            return (step if isinstance(step, int) else -1), problems[0]
    return None
