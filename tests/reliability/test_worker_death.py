"""A worker SIGKILLed mid-step on the default path (hf trainer + vLLM-CPU rollout, Ray): a Ray actor's death
stops the run within seconds with the worker's error and the resume command, leaves no process behind, and
the run resumes; a reward worker's death is absorbed (the sample counts as a reward error) and the run goes on.

`rlbridge train` runs as a subprocess in its own session on the tiny random Llama recipe of
tests/integration/test_resume.py (LoRA, merged weight sync), with a checkpoint after every step and one reward
worker. Fault points (rlbridge/faults.py) hold the run at the exact moments; in each run, in order:

1. `reward#10`: the reward worker's 10th sample (2 evaluation samples before training + 8 of step 1: the last
   of step 1). That process is SIGKILLed. The reward pool is built for this (rlbridge/data/reward_pool.py):
   the sample gets a reward_error ("reward worker process exited with code -9 while scoring"), a fresh worker
   takes the next samples, and the run goes on: step 1 is trained and checkpointed with reward_error 1.
2. The actor, in step 2 (parametrized):
   - `generate#3` (the rollout actor's 3rd generate: evaluation, step 1, step 2): `ray::VllmRollout` is
     SIGKILLed;
   - `update#2` (the trainer actor in the update of step 2): `ray::TrainerRole` is SIGKILLed.

   The driver must then exit 1 within KILL_BOUND_S, naming the dead worker ("rollout worker died") and printing
   `rlbridge resume RUN`; status.json says failed; step 1's checkpoint is still complete (sha256) and there is
   no step 2; every process of the run (Ray's gcs_server, raylet, agents and workers, vLLM, reward workers,
   the replacement one included) is gone: found as the driver's descendants just before the kill, and by a
   tag in their environment, which survives re-parenting to init and finds processes started after the
   snapshot. Then `rlbridge resume RUN` finishes with steps 1..STEPS once each.

The measured times are printed (run with -s) and recorded in docs/reliability.md.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
import uuid
from pathlib import Path

import psutil
import pytest
import yaml

from bench.proctree import describe
from rlbridge.run import checkpoint as ckpt
from tests.fixtures.tiny_llama import build_tiny_llama
from tests.integration.test_resume import (
    descendants,
    kill_everything,
    marker_has,
    recipe,
    run,
    start,
    train_metrics,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]
STEPS = 2
KILL_BOUND_S = 60.0
"""The driver must exit within this many seconds of the kill (it took 4.6-14 s: docs/reliability.md)."""
GONE_BOUND_S = 30.0
"""... and every process of the run must be gone within this many seconds of the driver's exit."""
TAG = "RLBRIDGE_TEST_WORKER_DEATH_TAG"
"""An environment variable every process of a run inherits (Ray workers included): finds them after the driver
is gone, when they would have been re-parented to init."""


@pytest.fixture(scope="module")
def recipe_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("worker_death")
    r = recipe(build_tiny_llama(tmp / "model"))
    r["name"] = "worker-death"
    r["run"].update(steps=STEPS, save_every=1)
    r["reward"].update(workers=1, timeout_s=120)  # one worker: its sample count says the step; no timeout
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(r))
    return path


def tagged(tag: str) -> list[psutil.Process]:
    """Live processes (zombies aside) carrying TAG=tag in their environment."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get(TAG) == tag:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def environ_size(p: psutil.Process) -> int:
    """Ray's agents (ray::DashboardAgent, ray::RuntimeEnvAgent) show an empty environment: setting their process
    title overwrote it. They are found as the raylet's children in the snapshot instead."""
    try:
        return len(p.environ())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0


def marker_pid(marker: Path, point: str) -> int:
    line = next(ln for ln in marker.read_text().splitlines() if ln.startswith(f"{point} "))
    return int(line.split()[2])


def actor_processes(proc: subprocess.Popen[bytes], cls: str) -> list[psutil.Process]:
    """The Ray worker processes of actor class `cls` under the driver: Ray titles them `ray::Cls` / `ray::Cls.method`."""
    found = []
    for p in descendants(proc):
        try:
            if " ".join(p.cmdline()).startswith(f"ray::{cls}"):
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


def find_actor(proc: subprocess.Popen[bytes], cls: str) -> psutil.Process:
    """The one Ray worker process of actor class `cls` under the driver."""
    found = actor_processes(proc, cls)
    assert len(found) == 1, (cls, describe(descendants(proc)))
    return found[0]


def stop_after_kill(
    proc: subprocess.Popen[bytes], victim: psutil.Process, tag: str, log: Path, error: str
) -> tuple[int, dict[str, float]]:
    """SIGKILL `victim`; returns the driver's exit code and the seconds from the kill until `error` was in the
    log ("error"), until the driver exited ("exit") and until every process of the run was gone ("gone").
    Fails on a hang or on processes left behind."""
    tree = [psutil.Process(proc.pid), *descendants(proc)]
    untagged = [p for p in tree if p.pid not in {q.pid for q in tagged(tag)} and environ_size(p)]
    assert not untagged, f"the tag should reach every process of the run: {describe(untagged)}"
    t0 = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    times: dict[str, float] = {}
    while proc.poll() is None:
        if "error" not in times and error in log.read_text(errors="replace"):
            times["error"] = time.monotonic() - t0
        if time.monotonic() - t0 > KILL_BOUND_S:
            kill_everything(proc)
            raise AssertionError(f"the driver did not exit within {KILL_BOUND_S} s of the kill (hang)")
        time.sleep(0.05)
    times["exit"] = time.monotonic() - t0
    times.setdefault("error", times["exit"])  # printed on the way out
    _, alive = psutil.wait_procs(tree, timeout=GONE_BOUND_S)
    left = tagged(tag)
    times["gone"] = time.monotonic() - t0
    if alive or left:
        kill_everything(proc)
        for p in left:
            p.kill()
    assert not alive and not left, f"left running: {describe(alive)} {describe(left)}"
    return proc.returncode, times


def kill_reward_worker(proc: subprocess.Popen[bytes], marker: Path, log: Path) -> float:
    """SIGKILL the reward worker held at `reward#10`; returns the seconds until the run reported the sample's
    reward error (the driver noticed, a fresh worker started, the step goes on)."""
    wait_for(marker_has(marker, "reward 10"), proc, "the last reward of step 1", log)
    victim = psutil.Process(marker_pid(marker, "reward 10"))
    assert "worker_main" in " ".join(victim.cmdline()) and victim.ppid() == proc.pid
    t0 = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    wait_for(lambda: REWARD_ERROR in log.read_text(errors="replace"), proc, "the reward error", log)
    return time.monotonic() - t0


REWARD_ERROR = "reward worker process exited with code -9 while scoring"
ACTORS = {  # which: (Ray actor class, fault point where it is killed, its marker line)
    "rollout": ("VllmRollout", "generate#3", "generate 3"),
    "trainer": ("TrainerRole", "update#2", "update 2"),
}


@pytest.mark.parametrize("which", list(ACTORS))
def test_a_killed_worker_stops_the_run_within_seconds_and_it_resumes(
    recipe_file: Path, tmp_path: Path, which: str
) -> None:
    cls, point, reached = ACTORS[which]
    run_dir, log, marker, tag = tmp_path / "run", tmp_path / "log.txt", tmp_path / "marker", uuid.uuid4().hex
    proc = start(
        ["train", str(recipe_file), "--run-dir", str(run_dir)],
        log,
        RLBRIDGE_FAULT_PAUSE=f"reward#10:300,{point}:300",
        RLBRIDGE_FAULT_MARKER=str(marker),
        **{TAG: tag},
    )
    try:
        reward_s = kill_reward_worker(proc, marker, log)
        wait_for(marker_has(marker, reached), proc, f"the {which} at {point}", log)
        victim = find_actor(proc, cls)
        assert victim.pid == marker_pid(marker, reached)  # the process held at the fault point
        assert [i.step for i in ckpt.list_checkpoints(run_dir) if i.complete] == [1]
        rc, t = stop_after_kill(proc, victim, tag, log, f"{which} worker died")
    finally:
        kill_everything(proc)
    out = log.read_text(errors="replace")
    print(
        f"\n{which}: SIGKILL of the reward worker at reward#10: reward error {reward_s:.1f} s after, the run went on; "
        f"SIGKILL of ray::{cls} at {point}: error printed {t['error']:.1f} s after, driver exit {rc} {t['exit']:.1f} s, "
        f"every process of the run gone {t['gone']:.1f} s; left behind: 0"
    )
    assert rc == 1, out[-5000:]
    assert f"error: {which} worker died" in out and f"class_name: {cls}" in out, out[-5000:]
    assert f"(step 1) with: rlbridge resume {run_dir}\n" in out, out[-5000:]
    assert "Traceback" not in out, out[-5000:]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed" and f"{which} worker died" in status["error"]
    assert [(i.step, i.complete) for i in ckpt.list_checkpoints(run_dir)] == [(1, True)]  # sha256 checked
    assert [(r["step"], r["reward_error"]) for r in train_metrics(run_dir)] == [(1, 1.0)]

    rc, out = run(["resume", str(run_dir)], log)
    assert rc == 0, out[-5000:]
    assert f"step_000001 (step 1 of {STEPS})" in out
    assert [r["step"] for r in train_metrics(run_dir)] == list(range(1, STEPS + 1))
    assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"
