"""Stalls (rlbridge/run/stalls.py): a phase far slower than its median warns with a measured cause and, past
run.health.stall_stop_s, stops the run from wherever the main thread waits.

The hang is real: a user reward function that sleeps inside a real RewardPool worker process (its third call),
so the CPU figures are those of an idle worker, not made up. The causes that need a busy machine or someone
else's GPU process are checked on given measurements (likely_cause is a pure function).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from rlbridge.data.reward_pool import RewardPool
from rlbridge.recipe.schema import HealthCfg, RewardCfg
from rlbridge.run import stalls
from rlbridge.run.stalls import StallError, StallWatch, cpu_rates, gpu_others, likely_cause, sample_cpu


def test_a_hung_reward_warns_with_its_cause_then_stops_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RLBRIDGE_TEST_HANG", f"3:{tmp_path / 'hung'}")  # the worker's 3rd call sleeps 600 s
    lines: list[str] = []
    watch = StallWatch(lines.append, factor=3.0, floor_s=1.0, stop_s=4.0, hint=" (logs: RUN/logs)")
    cfg = RewardCfg(fn="tests.fixtures.toy_rewards:hang_once", timeout_s=600, workers=1)
    with RewardPool(cfg) as pool, watch.armed():
        for _ in range(2):
            with watch("reward"):
                pool.score(["p"], ["completion"], [{}])
        start = time.monotonic()
        with pytest.raises(StallError) as e, watch("reward"):
            pool.score(["p"], ["completion"], [{}])  # blocks in the pool's wait for its worker
        took = time.monotonic() - start
    assert 4.0 <= took < 10.0, took  # stopped at stall_stop_s, from the main thread's blocking wait
    assert len(lines) >= 1, lines  # warned at max(3 x median, 1 s) = 1 s, before the stop
    first = lines[0]
    assert first.startswith("reward is stalled: running for 1 s") and "run.health.stall_factor 3" in first
    assert "the run's workers compute nothing, they wait: a hung reward function" in first, first
    assert "reward workers 0.00" in first, first  # measured: the worker process sleeps
    assert first.endswith(" (logs: RUN/logs)")
    msg = str(e.value)
    assert "reward is stalled" in msg and "Stopped after run.health.stall_stop_s 4 s" in msg
    assert "last complete checkpoint is untouched" in msg


def test_not_armed_or_off_the_main_thread_it_only_warns() -> None:
    lines: list[str] = []
    watch = StallWatch(lines.append, factor=2.0, floor_s=0.2, stop_s=0.3)
    with watch("update"):
        time.sleep(0.02)
    with watch("update"):  # not armed: past stop_s it warns, never raises
        time.sleep(1.0)
    assert lines and all("update is stalled" in x for x in lines), lines

    def worker() -> None:
        with watch.armed(), watch("update"):  # armed() off the main thread does nothing
            time.sleep(0.8)

    t = threading.Thread(target=worker)
    t.start()
    t.join()


def test_fast_phases_and_first_runs_are_quiet() -> None:
    lines: list[str] = []
    watch = StallWatch(lines.append, factor=2.0, floor_s=0.0, stop_s=0.2)
    with watch.armed():
        with watch("generate"):
            time.sleep(0.5)  # the first run: nothing to compare with, not watched
        for _ in range(3):
            with watch("generate"):
                time.sleep(0.3)  # below 2 x median 0.3-0.5 s
    assert lines == []


def test_likely_cause_from_measurements() -> None:
    idle = {"driver": 0.01, "Ray": 0.08, "TrainerRole": 0.0, "VllmRollout": 0.001}
    busy = {"driver": 0.01, "Ray": 0.05, "TrainerRole": 0.4, "VllmRollout": 0.1}
    full = {"driver": 0.01, "TrainerRole": 1.9}
    c = likely_cause("update", idle, load=0.3, cores=2, gpu=[])
    assert "compute nothing" in c and "a stuck trainer or a dead peer" in c and "load average 0.3 on 2" in c
    assert "compute nothing" in likely_cause("update", idle, load=9.0, cores=2, gpu=[])  # idle beats load
    c = likely_cause("generate", busy, load=7.5, cores=2, gpu=[])
    assert "CPU contention" in c and "TrainerRole 0.40" in c, c
    assert "more work than before" in likely_cause("update", full, load=2.0, cores=2, gpu=[])
    c = likely_cause("update", busy, load=1.0, cores=16, gpu=["pid 77 python 40000 MiB"])
    assert "GPU contention" in c and "pid 77 python 40000 MiB" in c
    assert "unknown" in likely_cause("sync", None, load=None, cores=2, gpu=[])


def test_gpu_others_leaves_out_the_runs_processes() -> None:
    out = "123, /usr/bin/python3, 20480\n456, ray::TrainerRole, 1000\n"
    assert gpu_others(frozenset({456}), query=lambda: out) == ["pid 123 python3 20480 MiB"]
    assert gpu_others(frozenset(), query=lambda: None) == []


def test_cpu_sample_sees_a_busy_child(tmp_path: Path) -> None:
    import subprocess
    import sys

    child = subprocess.Popen(
        [sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<1.5: pass"]
    )
    try:
        before = sample_cpu()
        time.sleep(1.0)
        after = sample_cpu()
    finally:
        child.wait()
    assert before is not None and after is not None and child.pid in after.pids
    assert cpu_rates(before, after)["driver"] > 0.3  # the child counts towards this process's part


def test_recipe_keys_reach_the_watch() -> None:
    w = stalls.from_recipe(HealthCfg(stall_factor=3, stall_floor_s=5, stall_stop_s=None), print)
    assert (w.factor, w.floor_s, w.stop_s) == (3, 5, None)
    assert HealthCfg().stall_stop_s == 1800.0 and HealthCfg().stall_factor == 5.0


def test_after_a_stop_the_error_that_follows_is_the_stall() -> None:
    """A driver waiting inside Ray's get() runs no Python signal handler (Ray 2.60): the stop kills the actors
    (on_stop), and the error that follows ("trainer worker died", or Ray's SystemError wrapping the handler's
    StallError) is reported as the stall."""
    from rlbridge.errors import RlbridgeError

    released = threading.Event()
    watch = StallWatch(print, factor=2.0, floor_s=0.0, stop_s=0.5)
    watch.on_stop = released.set  # stands for killing the actors: the wait below ends
    ignore_alarm = lambda *_: None  # noqa: E731  # like Ray's get(): the handler does not get to raise
    with pytest.raises(StallError, match="update is stalled"), watch.armed():
        import signal

        signal.signal(signal.SIGALRM, ignore_alarm)
        with watch("update"):
            pass
        with watch("update"):
            assert released.wait(10)
            raise RlbridgeError("trainer worker died: ...")
    with pytest.raises(ValueError), StallWatch(print).armed():  # no stall: errors pass unchanged
        raise ValueError("x")
