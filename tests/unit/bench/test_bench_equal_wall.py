"""bench/equal_wall.py's rules against hand computations: which step is scored (the time limit's save, an overrun measured), the arms' order per
seed, and the summary (per-seed accuracy, mean, min-max, the mean difference to TRL over the seeds both ran)."""

from __future__ import annotations

import pytest

from bench.equal_wall import rotation, scored_step, summarize


def test_the_step_the_time_limit_saved_counts_and_an_overrun_is_measured() -> None:
    ends = {1: 30.0, 2: 42.5, 3: 55.0, 4: 67.5}
    assert scored_step([3], ends, 60.0) == (3, 0.0)  # the time limit's save, inside the time
    assert scored_step([4], ends, 60.0) == (4, 7.5)  # step 4 ran past the time: scored, its overrun reported
    assert scored_step([1, 3], ends, 55.0) == (3, 0.0)  # ending exactly at the time is inside it
    assert scored_step([], ends, 60.0) == (0, 0.0)  # nothing saved: nothing to score


def test_each_arm_runs_first_once_over_three_seeds() -> None:
    arms = ["trl", "sync", "async"]
    orders = [rotation(arms, k) for k in range(3)]
    assert orders == [["trl", "sync", "async"], ["sync", "async", "trl"], ["async", "trl", "sync"]]
    assert [o[0] for o in orders] == arms
    assert rotation(arms, 3) == arms


def test_summary_matches_a_hand_computation() -> None:
    runs = [
        {"arm": "trl", "seed": 1, "steps": 10, "accuracy": 0.20},
        {"arm": "trl", "seed": 2, "steps": 12, "accuracy": 0.30},
        {"arm": "rlbridge-sync", "seed": 1, "steps": 18, "accuracy": 0.40},
        {"arm": "rlbridge-sync", "seed": 2, "steps": 20, "accuracy": 0.35},
        {
            "arm": "rlbridge-sync",
            "seed": 3,
            "steps": 19,
            "accuracy": 0.50,
        },  # TRL's seed 3 failed: not in minus_trl
        {"arm": "trl", "seed": 3, "steps": 0, "failed": True},
    ]
    s = summarize(runs)
    assert s["trl"]["accuracy"] == [0.20, 0.30] and s["trl"]["accuracy_mean"] == pytest.approx(0.25)
    sync = s["rlbridge-sync"]
    assert sync["seeds"] == [1, 2, 3] and sync["accuracy_mean"] == pytest.approx(1.25 / 3)
    assert (sync["accuracy_min"], sync["accuracy_max"]) == (0.35, 0.50)
    assert sync["steps_mean"] == pytest.approx(19.0)
    assert sync["minus_trl"] == pytest.approx(((0.40 - 0.20) + (0.35 - 0.30)) / 2)
    assert "minus_trl" not in s["trl"]
