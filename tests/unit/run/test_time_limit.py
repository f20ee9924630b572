"""run.time_limit_s's stop rule (run/time_limit.py) on a fake clock, the process age it counts from, and the stop it requests (signals.StopSignals, exit code 75)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlbridge.recipe.schema import RunCfg
from rlbridge.run.signals import EXIT_CODES, TIME_LIMIT, Interrupted, StopSignals
from rlbridge.run.time_limit import TimeLimit

ROOT = Path(__file__).resolve().parents[3]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def steps_run(limit: TimeLimit, clock: Clock, durations: list[float], save_s: float) -> int:
    """The step after which the limit stops the run (0: none did)."""
    limit.begin()
    for step, seconds in enumerate(durations, 1):
        clock.now += seconds
        if limit.stop_after_step(step, save_s):
            return step
    return 0


def test_stops_after_the_last_step_whose_successor_and_save_would_not_fit() -> None:
    clock = Clock()
    limit = TimeLimit(100.0, clock, age_s=10.0)  # the command has run 10 s when the loop builds it
    clock.now = 10.0  # start-up: the first step begins 20 s into the command
    # steps of 10 s end at 30, 40, ... 90 s; after step 7 (90 s) the next and a 2 s save would end at 102 s
    assert steps_run(limit, clock, [10.0] * 20, save_s=2.0) == 7
    assert clock.now - 10.0 + 20.0 == 90.0  # the stopped step ended inside the limit, its save too (92 s)


def test_a_long_first_step_is_the_estimate_only_until_a_second_step_has_run() -> None:
    # step 1 takes 60 s (compile, warm-up), then 10 s each: steps end at 60, 70, 80, 90, ... s
    clock = Clock()
    # after step 1 (60 s) the estimate is 60 s: with a 110 s limit, the run stops there (the next "ends" at 120)
    assert steps_run(TimeLimit(110.0, clock, age_s=0.0), clock, [60.0] + [10.0] * 30, save_s=0.0) == 1
    clock = Clock()
    # with 130 s, step 2 (70 s) runs and the estimate becomes 10 s: step 8 ends at 130 s and is the last
    assert steps_run(TimeLimit(130.0, clock, age_s=0.0), clock, [60.0] + [10.0] * 30, save_s=0.0) == 8
    # a slow later step (25 s: a periodic save in it) is the estimate while it is one of the last three:
    # steps end at 60, 70, 95, 105, 115, 125, ... s
    durations = [60.0, 10.0, 25.0] + [10.0] * 30
    clock = Clock()
    assert steps_run(TimeLimit(130.0, clock, age_s=0.0), clock, durations, save_s=0.0) == 5  # 115 + 25 > 130
    clock = Clock()
    assert steps_run(TimeLimit(160.0, clock, age_s=0.0), clock, durations, save_s=0.0) == 9  # 155 + 10 > 160


def test_a_limit_of_minutes_is_noted_by_the_plan() -> None:
    """validate-recipe and plan print the plan's notes: a limit under 10 minutes says its unit and what it implies
    (a limit meant in minutes, written as seconds, would stop the job minutes in); none for an hour or no limit."""
    from rlbridge.plan import make_plan
    from rlbridge.recipe.load import load_recipe

    def notes(*sets: str) -> list[str]:
        recipe = load_recipe(str(ROOT / "recipes" / "quickstart.yaml"), list(sets))
        return [n for n in make_plan(recipe, None).notes if n.startswith("run.time_limit_s")]

    assert notes("run.time_limit_s=240") == [
        "run.time_limit_s is 240 seconds (4.0 min), start-up included (a cluster job's limit less a margin, in "
        "seconds): where start-up takes most of it, each run saves after its first step and stops"
    ]
    assert notes("run.time_limit_s=3600") == [] and notes() == []


def test_no_limit_never_stops() -> None:
    clock = Clock()
    assert steps_run(TimeLimit(None, clock, age_s=1e9), clock, [1e6] * 5, save_s=1e6) == 0
    assert RunCfg().time_limit_s is None


def test_process_age_counts_from_the_process_start() -> None:
    """A child started at a known time reports its age: what the child ran so far, less the few ms before the
    kernel created it (psutil's create_time is not precise enough: /proc/stat's boot time is whole seconds)."""
    before = time.time()
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(before)], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout.split()
    age, since_before = float(out[0]), float(out[1])
    assert since_before - 0.05 <= age <= since_before + 0.011, (age, since_before)  # /proc's ticks: 10 ms
    assert age > 0.0


PROBE = """
import sys, time
sys.path.insert(0, ".")
from rlbridge.run.time_limit import process_age_s
age = process_age_s()
print(age, time.time() - float(sys.argv[1]))
"""


def test_the_stop_is_requested_once_and_exits_75() -> None:
    stop = StopSignals()
    stop.request(TIME_LIMIT)
    stop.request("SIGTERM")  # a stop already requested keeps its reason
    assert stop.requested == TIME_LIMIT
    assert Interrupted(TIME_LIMIT, 3, None, "").exit_code == EXIT_CODES[TIME_LIMIT] == 75
    signalled = StopSignals()
    signalled.requested = "SIGTERM"
    signalled.request(TIME_LIMIT)
    assert signalled.requested == "SIGTERM"


def test_before_any_save_the_stop_counts_an_estimated_save() -> None:
    """A 7B full fine-tune without periodic saves, 60 s steps, a 3600 s limit: counting the stop-save as 0 s (as
    before) the run saved step 60 at 3600 s, its ~3.5 min save ending past the limit (a cluster kills the job
    mid-save: nothing to resume from); with the estimate (7.6e9 params x 12 bytes at 0.4 GiB/s = 212 s) it saves
    step 56, the save ending at ~3572 s."""
    from rlbridge.run.time_limit import ASSUMED_WRITE_BYTES_S, CHECKPOINT_BYTES_PER_PARAM, save_estimate_s

    estimate = save_estimate_s(7_600_000_000)
    assert estimate == 7_600_000_000 * CHECKPOINT_BYTES_PER_PARAM / ASSUMED_WRITE_BYTES_S
    assert 200 < estimate < 220
    clock = Clock()
    last = steps_run(TimeLimit(3600.0, clock, age_s=0.0), clock, [60.0] * 100, save_s=estimate)
    assert last == 56 and last * 60.0 + estimate <= 3600.0 < (last + 1) * 60.0 + estimate
    clock = Clock()
    assert steps_run(TimeLimit(3600.0, clock, age_s=0.0), clock, [60.0] * 100, save_s=0.0) == 60


def test_the_estimate_is_a_resumed_runs_newest_save_when_it_has_one() -> None:
    from rlbridge.run.time_limit import save_estimate_s

    history = [
        {"kind": "train", "step": 1},
        {"kind": "checkpoint", "step": 1, "time_save": 95.0},
        {"kind": "checkpoint", "step": 2, "time_save": 80.5},
        {"kind": "train", "step": 3},
    ]
    assert save_estimate_s(7_600_000_000, history) == 80.5
    assert save_estimate_s(None) == 0.0 and save_estimate_s(0, [{"kind": "train"}]) == 0.0


def test_the_checkpointer_expects_the_estimate_until_its_first_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checkpointer.expected_save_s (what the loop passes to the stop rule): the plan's LoRA parameter count before
    a save (4,055,040 trainable: ~0.1 s; twice that with PPO's critic), then the measured seconds of the last save."""
    from types import SimpleNamespace

    from rlbridge.checkpointer import Checkpointer
    from rlbridge.run.time_limit import save_estimate_s
    from rlbridge.trainer.state import SavedCheckpoint

    monkeypatch.setattr("rlbridge.checkpointer.resolved_yaml", lambda recipe: "a: 1\n")
    written: list[dict[str, object]] = []
    trainer = SimpleNamespace(
        checkpoint_support=lambda: None,
        save_checkpoint=lambda *a: SavedCheckpoint(
            path=str(tmp_path / "c"), bytes=10, seconds=3.25, notes=[]
        ),
    )
    session = SimpleNamespace(
        started_trainer=lambda: trainer,
        plan=SimpleNamespace(memory=SimpleNamespace(trainable_params=4_055_040)),
        metrics=SimpleNamespace(history=[], write=written.append),
        run_dir=tmp_path,
        version=0,
        kl_control=None,
        recipe=SimpleNamespace(run=SimpleNamespace(keep=2), algorithm=SimpleNamespace(has_critic=False)),
        sampler=SimpleNamespace(state=lambda: {}),
        stall=lambda phase: contextlib.nullcontext(),
    )
    saver = Checkpointer(session, StopSignals(), log=lambda msg: None)  # type: ignore[arg-type]  # a fake session
    assert saver.expected_save_s() == save_estimate_s(4_055_040) and 0.05 < saver.expected_save_s() < 0.2
    saver.save(1)
    assert saver.expected_save_s() == 3.25 and written[0]["time_save"] == 3.25
    session.recipe.algorithm.has_critic = True  # PPO: the critic is saved beside the policy
    ppo = Checkpointer(session, StopSignals(), log=print)  # type: ignore[arg-type]  # a fake session
    assert ppo.expected_save_s() == save_estimate_s(2 * 4_055_040)
