"""Disk full while saving a checkpoint, on a real small filesystem: a 4 MiB tmpfs mounted (as root) over a run's
`checkpoints/` directory. Skipped, with the reason, where mounting is not allowed.

- `save_checkpoint` runs out of space in the middle of writing the tensor files: it raises RlbridgeError
  starting "disk full" (naming the directory, the free space and the newest complete checkpoint), removes
  its partial `.tmp-*` directory, publishes no `step_*` directory, and the previous checkpoint still
  verifies (sizes and sha256). A later save that fits works again.
- The loop's side (`checkpointer.Checkpointer.save`, what `loop.train` calls every run.save_every steps): the run
  STOPS (it does not continue without checkpoints) with that message plus the resume hint naming the last
  good checkpoint and `rlbridge resume RUN_DIR`; an RlbridgeError, so the CLI prints it without a traceback
  and exits 1.

Reproduce: `.venv/bin/python -m pytest tests/reliability/test_disk_full.py -v` (as root).
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rlbridge.checkpointer import Checkpointer
from rlbridge.errors import RlbridgeError
from rlbridge.run import checkpoint as ckpt
from rlbridge.run.signals import StopSignals
from rlbridge.trainer.state import SavedCheckpoint

SIZE = "4m"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A run directory whose checkpoints/ is a 4 MiB tmpfs."""
    run = tmp_path / "run"
    root = run / ckpt.CHECKPOINTS
    root.mkdir(parents=True)
    try:
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={SIZE}", "tmpfs", str(root)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot mount a tmpfs to fill up ({e}); run as root")
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill up (needs root / CAP_SYS_ADMIN): {proc.stderr.strip()}")
    try:
        yield run
    finally:
        subprocess.run(["umount", "-l", str(root)], capture_output=True, timeout=30)


def tensors(mib: float) -> dict[str, dict[str, torch.Tensor]]:
    n = int(mib * 2**20 / 4)
    return {"trainable": {"w": torch.ones(n)}, "optimizer": {"m": torch.zeros(n // 4)}}


def files_under(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_save_that_runs_out_of_space_fails_cleanly_and_keeps_the_previous_checkpoint(
    small_disk: Path,
) -> None:
    run, root = small_disk, small_disk / ckpt.CHECKPOINTS
    ckpt.save_checkpoint(run, 1, tensors=tensors(1), state={"step": 1}, recipe_yaml="a: 1\n", keep=3)
    assert ckpt.verify_checkpoint(root / "step_000001") is None

    with pytest.raises(RlbridgeError) as info:  # 6 MiB does not fit in the ~2.7 MiB left
        ckpt.save_checkpoint(run, 2, tensors=tensors(6), state={"step": 2}, recipe_yaml="a: 1\n", keep=3)
    msg = str(info.value)
    assert msg.startswith("disk full: no space left on the device of") and str(root) in msg, msg
    assert (
        "MiB free now" in msg and "step_000001, is untouched" in msg and "nothing of step 2 was kept" in msg
    )
    # safetensors reports ENOSPC as a SafetensorError, not an OSError: both are recognised
    assert type(info.value.__cause__).__name__ in ("SafetensorError", "OSError")
    assert files_under(root) == ["step_000001"]  # no step_000002, no .tmp-step_000002-<pid> left behind
    assert [(i.step, i.problem) for i in ckpt.list_checkpoints(run)] == [(1, None)]
    assert ckpt.load_checkpoint(root / "step_000001").tensors["trainable"]["w"].numel() == 2**18

    # space is freed by the failure: a save that fits works again
    ckpt.save_checkpoint(run, 2, tensors=tensors(1), state={"step": 2}, recipe_yaml="a: 1\n", keep=3)
    assert [(i.step, i.problem) for i in ckpt.list_checkpoints(run)] == [(1, None), (2, None)]


def test_disk_full_with_no_earlier_checkpoint_says_so(small_disk: Path) -> None:
    with pytest.raises(RlbridgeError, match="disk full.*there is no earlier complete checkpoint"):
        ckpt.save_checkpoint(small_disk, 1, tensors=tensors(6), state={}, recipe_yaml="a: 1\n", keep=1)
    assert files_under(small_disk / ckpt.CHECKPOINTS) == []


class Trainer:
    """TrainerRole.save_checkpoint's part that matters here, in-process (errors propagate as they do through
    the Ray actor wrapper: an RlbridgeError stays an RlbridgeError)."""

    def __init__(self, mib: list[float]) -> None:
        self.mib = mib

    def checkpoint_support(self) -> str | None:
        return None

    def save_checkpoint(
        self, run_dir: str, step: int, state: dict[str, Any], recipe_yaml: str, keep: int
    ) -> SavedCheckpoint:
        path = ckpt.save_checkpoint(
            Path(run_dir),
            step,
            tensors=tensors(self.mib.pop(0)),
            state=state,
            recipe_yaml=recipe_yaml,
            keep=keep,
        )
        return SavedCheckpoint(path=str(path), bytes=0, seconds=0.0, notes=[])


def test_the_loop_stops_with_the_disk_full_message_and_the_resume_hint(
    small_disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("rlbridge.checkpointer.resolved_yaml", lambda recipe: "a: 1\n")
    written: list[dict[str, Any]] = []
    session = SimpleNamespace(
        trainer=Trainer([1, 6]),
        started_trainer=lambda: session.trainer,
        run_dir=small_disk,
        version=1,
        kl_control=None,
        recipe=SimpleNamespace(run=SimpleNamespace(save_every=1, keep=3)),
        sampler=SimpleNamespace(state=lambda: {"epoch": 0, "index": 0}),
        metrics=SimpleNamespace(write=written.append),
        stall=lambda phase: contextlib.nullcontext(),  # Session.stall watches the save (run/stalls.py)
    )
    saver = Checkpointer(session, StopSignals(), log=lambda msg: None)  # type: ignore[arg-type]
    saver.save(1)
    with pytest.raises(RlbridgeError) as info:
        saver.save(2)
    msg = str(info.value)
    assert msg.startswith("saving checkpoint step 2 failed: disk full"), msg
    assert f"resume from {small_disk / 'checkpoints' / 'step_000001'} (step 1)" in msg
    assert msg.endswith(f"with: rlbridge resume {small_disk}")
    assert [r["step"] for r in written] == [1]  # no checkpoint record for the failed save
    assert [(i.step, i.problem) for i in ckpt.list_checkpoints(small_disk)] == [(1, None)]
