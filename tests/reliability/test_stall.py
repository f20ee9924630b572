"""A hung reward function stops a real run (`rlbridge train`: Ray, hf trainer, hf rollout, LoRA, tiny random
Llama) once it has stalled past run.health.stall_stop_s: exit 1 with the stall warning (phase, measured cause),
the newest complete checkpoint and `rlbridge resume RUN`; no process of the run left; the checkpoint still
verifies; then `rlbridge resume` finishes.

The reward function (tests/fixtures/toy_rewards.hang_once) sleeps 600 s in its 11th call: 2 evaluation samples,
then 4 per step (2 prompts x n=2), so the 3rd sample of step 3, after the step-2 checkpoint. It creates a flag
file first, so the resumed run does not hang again. One reward worker, reward.timeout_s 600 (so the pool's own
timeout does not end the hang first), stall_factor 2, stall_floor_s 3, stall_stop_s 8.
"""

from __future__ import annotations

import json
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


def test_a_hung_reward_stops_the_run_with_the_resume_command_and_it_resumes(tmp_path: Path) -> None:
    r = recipe(build_tiny_llama(tmp_path / "model"))
    r["name"] = "stall"
    r["rollout"].update(engine="hf", n=2)
    r["rollout"].pop("kv_cache_gib")
    r["reward"] = {"fn": "tests.fixtures.toy_rewards:hang_once", "workers": 1, "timeout_s": 600}
    r["run"].update(steps=STEPS, save_every=1)
    r["run"]["health"].update(stall_factor=2, stall_floor_s=3, stall_stop_s=8, max_logprob_diff=None)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(r))
    run_dir, log, tag = tmp_path / "run", tmp_path / "log.txt", "stall-test"
    hang = {"RLBRIDGE_TEST_HANG": f"11:{tmp_path / 'hung'}", TAG: tag}
    proc = start(["train", str(tmp_path / "recipe.yaml"), "--run-dir", str(run_dir)], log, **hang)
    try:
        wait_for(lambda: (tmp_path / "hung").exists(), proc, "the hang", log)
        t0 = time.monotonic()
        rc = proc.wait(120)
        stopped_s = time.monotonic() - t0
    finally:
        kill_everything(proc)
    out = log.read_text(errors="replace")
    print(f"\nstall: the run stopped {stopped_s:.1f} s after the reward hung (stall_stop_s 8)")
    assert rc == 1, out[-5000:]
    assert "warning reward is stalled: running for 3 s" in out, out[-5000:]
    assert "a hung reward function" in out and "reward workers 0.0" in out, out[-5000:]
    assert "error: reward is stalled" in out and "Stopped after run.health.stall_stop_s 8 s" in out
    assert f"(step 2) with: rlbridge resume {run_dir}" in out, out[-5000:]
    assert "Traceback" not in out, out[-5000:]
    assert json.loads((run_dir / "status.json").read_text())["state"] == "failed"
    assert [(i.step, i.complete) for i in ckpt.list_checkpoints(run_dir)] == [(1, True), (2, True)]
    deadline = time.monotonic() + 30
    while tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not tagged(tag), "processes of the run left behind"

    proc = start(["resume", str(run_dir)], log, **hang)
    try:
        assert proc.wait(600) == 0, log.read_text(errors="replace")[-5000:]
    finally:
        kill_everything(proc)
    assert [m["step"] for m in train_metrics(run_dir)] == list(range(1, STEPS + 1))
