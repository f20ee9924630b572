"""A hung phase stops a real run (`rlbridge train`: Ray, hf trainer, hf rollout, LoRA, tiny random Llama) once
it has stalled past run.health.stall_stop_s: exit 1 with the stall warning (phase, measured cause), the newest
complete checkpoint and `rlbridge resume RUN`; no process of the run left; the checkpoint still verifies; then
`rlbridge resume` finishes.

The hang (parametrized; the default suite runs "update", the harder path):
- "update": the trainer actor sleeps 600 s at the start of its 3rd update (fault point update#3, after the
  step-2 checkpoint), so the driver waits inside Ray's get(), where the stop's exception comes out wrapped
  by Ray (rlbridge/run/stalls.py unwraps it). A resumed process counts its updates from 1: no hang again.
- "reward": the reward function (tests/fixtures/toy_rewards.hang_once) sleeps 600 s in its 11th call (2
  evaluation samples, then 4 per step: the 3rd sample of step 3); it creates a flag file first, so the resumed
  run does not hang again. One reward worker, reward.timeout_s 600 (the pool's own timeout must not end the
  hang first). Run it with RLBRIDGE_TEST_STALL_ALL=1 (it passed on 2026-12-01, 102 s; the same hang in a real
  reward worker is in tests/unit/run/test_stalls.py).

stall_factor 2, stall_floor_s 3, stall_stop_s 8.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import yaml

from rlbridge.run import checkpoint as ckpt
from tests.fixtures.tiny_llama import build_tiny_llama
from tests.integration.test_resume import kill_everything, recipe, start, train_metrics, wait_for
from tests.reliability.test_worker_death import TAG, tagged

pytestmark = [pytest.mark.integration, pytest.mark.slow]
STEPS = 3
CAUSES = {
    "update": "a stuck trainer or a dead peer",
    "reward": "a hung reward function",
}


@pytest.mark.parametrize(
    "hang",
    [
        "update",
        pytest.param(
            "reward",
            marks=pytest.mark.skipif(
                not os.environ.get("RLBRIDGE_TEST_STALL_ALL"),
                reason="set RLBRIDGE_TEST_STALL_ALL=1 (CI time)",
            ),
        ),
    ],
)
def test_a_hung_phase_stops_the_run_with_the_resume_command_and_it_resumes(tmp_path: Path, hang: str) -> None:
    r = recipe(build_tiny_llama(tmp_path / "model"))
    r["name"] = "stall"
    r["rollout"].update(engine="hf", n=2)
    r["rollout"].pop("kv_cache_gib")
    r["reward"] = {"fn": "tests.fixtures.toy_rewards:hang_once", "workers": 1, "timeout_s": 600}
    r["run"].update(steps=STEPS, save_every=1)
    r["run"]["health"].update(stall_factor=2, stall_floor_s=3, stall_stop_s=8, max_logprob_diff=None)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(r))
    run_dir, log, tag = tmp_path / "run", tmp_path / "log.txt", "stall-test"
    marker = tmp_path / "hung"
    env = (
        {"RLBRIDGE_TEST_HANG": f"11:{marker}", TAG: tag}
        if hang == "reward"
        else {"RLBRIDGE_FAULT_PAUSE": "update#3:600", "RLBRIDGE_FAULT_MARKER": str(marker), TAG: tag}
    )
    proc = start(["train", str(tmp_path / "recipe.yaml"), "--run-dir", str(run_dir)], log, **env)
    try:
        wait_for(marker.exists, proc, "the hang", log)
        t0 = time.monotonic()
        rc = proc.wait(120)
        stopped_s = time.monotonic() - t0
    finally:
        kill_everything(proc)
    out = " ".join(log.read_text(errors="replace").split())  # rich wraps the long lines
    print(f"\nstall: the run stopped {stopped_s:.1f} s after the {hang} hung (stall_stop_s 8)")
    assert rc == 1, out[-5000:]
    assert f"warning {hang} is stalled: running for 3 s" in out, out[-5000:]
    assert CAUSES[hang] in out, out[-5000:]
    assert ("reward workers 0.0" if hang == "reward" else "TrainerRole 0.0") in out, out[-5000:]
    assert f"error: {hang} is stalled" in out and "Stopped after run.health.stall_stop_s 8 s" in out
    assert f"(step 2) with: rlbridge resume {run_dir}" in out, out[-5000:]
    if hang == "update":  # the wait inside Ray ended by killing the actors (on_stop), reported as the stall
        assert "worker died" not in out, out[-5000:]
    assert "Traceback" not in out, out[-5000:]
    assert json.loads((run_dir / "status.json").read_text())["state"] == "failed"
    assert [(i.step, i.complete) for i in ckpt.list_checkpoints(run_dir)] == [(1, True), (2, True)]
    deadline = time.monotonic() + 30
    while tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not tagged(tag), "processes of the run left behind"

    proc = start(["resume", str(run_dir)], log, **env)
    try:
        assert proc.wait(600) == 0, log.read_text(errors="replace")[-5000:]
    finally:
        kill_everything(proc)
    assert [m["step"] for m in train_metrics(run_dir)] == list(range(1, STEPS + 1))
