"""A multi-rank megatron save that fails (issue 45): the previous checkpoint stays complete, no half step shows.

4 gloo ranks (TP2 x PP2, LoRA) save through TrainerRole. A layout-free save gathers the full tensors to global
rank 0, the only rank that writes (rlbridge/engines/megatron/state.py); rlbridge/run/checkpoint.py writes them
into `.tmp-step_XXXXXX-<pid>`, the manifest last, and renames the directory into place. What can go wrong, done
for real:

- disk full: RUN_DIR/checkpoints is a 2 MiB tmpfs (mounted here; needs root, else this part is skipped with the
  reason), filled to within 16 KiB after step 1, so rank 0 gets ENOSPC from the kernel while writing step 2's
  tensor files: RlbridgeError "disk full ...", its `.tmp-*` removed, no `step_000002`, step 1 verifies (sizes
  and sha256); the other ranks are not affected (they write nothing);
- SIGKILL of a non-writing rank (3) in the middle of the gather (RLBRIDGE_FAULT_PAUSE `checkpoint-gather@3`):
  rank 0 fails in the collective before it writes anything: no `step_000002`, no `.tmp-*`;
- SIGKILL of the writer (rank 0) with the tensor files written and the manifest not (`checkpoint-files`): a
  `.tmp-step_000002-<pid>` directory is left, never a `step_000002`; the newest complete checkpoint is step 1,
  which a new 4-rank launch had loaded just before (after the two failures above), and the next save removes
  the leftover (its process is dead).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rlbridge.run import checkpoint as ckpt

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent


def _launch_and_kill(kwargs: dict[str, Any], pause: str, tmp: Path, timeout: float = 240) -> dict[str, Any]:
    """Run save_faults_suite on 4 ranks with RLBRIDGE_FAULT_PAUSE=`pause`; SIGKILL the process that pauses there.
    Returns the launcher's exit code and output, the killed pid and rank 0's events."""
    marker, events = tmp / "marker", Path(kwargs["events"])
    marker.unlink(missing_ok=True)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "RLBRIDGE_FAULT_PAUSE": pause,
        "RLBRIDGE_FAULT_MARKER": str(marker),
        "MT_LAUNCHER_GRACE": "10",  # the surviving ranks report what they saw before the launcher stops them
    }
    out = tmp / "launcher.log"
    start = time.time()
    with open(out, "w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                str(HERE / "launcher.py"),
                "save_faults_suite",
                "4",
                str(tmp),
                json.dumps(kwargs),
            ],
            cwd=HERE.parents[1],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        killed = None
        try:
            while proc.poll() is None and time.time() - start < timeout:
                if killed is None and marker.is_file() and marker.read_text().strip():
                    killed = int(marker.read_text().split()[2])
                    os.kill(killed, signal.SIGKILL)
                time.sleep(0.1)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    text = out.read_text()
    print(f"launch with {pause} killed pid {killed}, exit {proc.returncode}, {time.time() - start:.1f}s")
    assert killed is not None, f"nobody paused at {pause}:\n{text[-4000:]}"
    lines = events.read_text().splitlines() if events.is_file() else []
    return {"rc": proc.returncode, "log": text, "events": [json.loads(line) for line in lines]}


@pytest.fixture(scope="module")
def runs(tiny_dirs: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    run = tmp_path_factory.mktemp("mt_save_faults") / "run"
    root = run / ckpt.CHECKPOINTS
    root.mkdir(parents=True)
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(root)], capture_output=True, text=True
    )
    disk_full = mount.returncode == 0
    try:
        out: dict[str, Any] = {"run": run, "disk_full": disk_full, "mount": mount.stderr.strip()}
        for phase, pause in (
            ("first", f"checkpoint-gather@3#{3 if disk_full else 2}:120"),
            ("second", "checkpoint-files@0:120"),
        ):
            tmp = tmp_path_factory.mktemp(f"mt_save_faults_{phase}")
            kwargs = dict(
                qwen=tiny_dirs["qwen2"], run_dir=str(run), events=str(tmp / "events.jsonl"), phase=phase
            )
            out[phase] = _launch_and_kill({**kwargs, "disk_full": disk_full}, pause, tmp)
            out[phase]["names"] = sorted(p.name for p in root.iterdir())
            out[phase]["listing"] = [(i.step, i.problem) for i in ckpt.list_checkpoints(run)]
        yield out
    finally:
        if disk_full:
            subprocess.run(["umount", "-l", str(root)], capture_output=True)


def _events(launch: dict[str, Any], what: str) -> list[dict[str, Any]]:
    return [e for e in launch["events"] if e["event"] == what]


def test_disk_full_on_the_writing_rank(runs: dict[str, Any]) -> None:
    if not runs["disk_full"]:
        pytest.skip(f"cannot mount a tmpfs to fill up (needs root / CAP_SYS_ADMIN): {runs['mount']}")
    first = runs["first"]
    (failed,) = [e for e in _events(first, "save failed") if e["step"] == 2 and "disk full" in e["error"]]
    assert failed["error"].startswith("RlbridgeError: disk full: no space left on the device of"), failed
    assert "step_000001, is untouched" in failed["error"] and "nothing of step 2 was kept" in failed["error"]
    assert failed["listing"] == [[1, None]]
    (after,) = _events(first, "after disk full")
    assert after["names"] == ["filler", "step_000001"]  # no .tmp-step_000002-*, no step_000002


def test_a_rank_killed_during_the_gather_leaves_no_trace(runs: dict[str, Any]) -> None:
    first = runs["first"]
    assert first["rc"] == 1
    assert [e["step"] for e in _events(first, "saved")] == [1]
    failed = [e for e in _events(first, "save failed") if "disk full" not in e["error"]]
    print("rank 0 saw:", failed)
    # rank 0 failed in the collective (gloo: the peer's connection closed) or was stopped still waiting in it
    assert all(e["listing"] == [[1, None]] for e in failed), failed
    assert first["names"] == ["step_000001"] and first["listing"] == [(1, None)]


def test_the_writer_killed_mid_write_leaves_a_tmp_dir_only(runs: dict[str, Any]) -> None:
    second = runs["second"]
    assert second["rc"] == 1
    assert [e["note"] for e in _events(second, "loaded")] == ["step1"]  # step 1 loaded after the failures
    assert _events(second, "saved") == []
    assert second["listing"] == [(1, None)]
    names = second["names"]
    assert names[-1] == "step_000001" and len(names) == 2 and names[0].startswith(".tmp-step_000002-"), names
    leftover = runs["run"] / ckpt.CHECKPOINTS / names[0]
    assert {p.name for p in leftover.iterdir()} == {"trainable.safetensors", "optimizer.safetensors"}
    info = ckpt.latest_complete(runs["run"], log=print)
    assert info is not None and info.step == 1
    # the next save (any process) removes the dead writer's leftover
    said: list[str] = []
    ckpt.save_checkpoint(
        runs["run"],
        2,
        tensors={"t": {"x": torch.ones(2)}},
        state={},
        recipe_yaml="a: 1\n",
        keep=3,
        log_fn=said.append,
    )
    assert said == [f"removed {names[0]} (left by an interrupted save)"]
    assert [i.step for i in ckpt.list_checkpoints(runs["run"]) if i.complete] == [1, 2]
