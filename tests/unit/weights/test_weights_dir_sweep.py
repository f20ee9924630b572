"""RAM-backed weight directories: those of dead processes are swept (kill -9'd runs left 540 MB each in /dev/shm),
and weights that /dev/shm cannot hold go to the temp dir, or are refused before anything is written."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from rlbridge.errors import RlbridgeError
from rlbridge.weights import WeightExport, WeightSync, directory
from rlbridge.weights.directory import ram_tempdir, sweep_stale


def test_sweep_removes_only_what_dead_processes_left(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)
    names = {
        "dead": f"rlbridge-merged-{dead_pid}-abc123",
        "mine": f"rlbridge-adapter-{os.getpid()}-xyz_9",
        "old": "rlbridge-merged-0k17ghab",
        "new": "rlbridge-adapter-9vclb95k",
        "other": "psm_1234",
    }
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"x")
    os.utime(tmp_path / names["old"], (0, 0))
    assert sorted(sweep_stale(tmp_path)) == sorted([names["dead"], names["old"]])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([names["mine"], names["new"], names["other"]])


def test_ram_tempdir_names_carry_the_pid() -> None:
    path = ram_tempdir("rlbridge-merged-")
    try:
        assert path.name.startswith(f"rlbridge-merged-{os.getpid()}-") and path.is_dir()
    finally:
        path.rmdir()


def _places(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """Two real directories standing for /dev/shm and the system temp dir."""
    shm, disk = tmp_path / "shm", tmp_path / "disk"
    shm.mkdir()
    disk.mkdir()
    monkeypatch.setattr(directory, "_ram_base", lambda: shm)
    monkeypatch.setattr(tempfile, "tempdir", str(disk))
    return shm, disk


def test_weights_larger_than_any_free_space_are_refused_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shm, disk = _places(tmp_path, monkeypatch)
    need = shutil.disk_usage(tmp_path).free * 2  # this filesystem's real free space cannot hold it
    with pytest.raises(RlbridgeError) as err:
        ram_tempdir("rlbridge-merged-", need)
    msg = str(err.value)
    assert f"{need / 2**30:.2f} GiB to write" in msg and str(shm) in msg and str(disk) in msg
    assert "rollout.weight_sync adapter" in msg and "rollout.weight_transport cuda_ipc" in msg
    assert not list(shm.iterdir()) and not list(disk.iterdir())


def test_weights_that_do_not_fit_dev_shm_go_to_the_temp_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    shm, disk = _places(tmp_path, monkeypatch)
    free = {shm: 64 * 2**20, disk: 100 * 2**30}  # a container's default /dev/shm; a disk with room
    monkeypatch.setattr(directory, "_free_bytes", lambda p: free[p])
    small = ram_tempdir("rlbridge-adapter-", 10 * 2**20)
    assert small.parent == shm
    with caplog.at_level(logging.WARNING, logger=directory.__name__):
        big = ram_tempdir("rlbridge-merged-", 15 * 2**30)
    assert big.parent == disk and big.name.startswith(f"rlbridge-merged-{os.getpid()}-")
    assert "do not fit" in caplog.text and "--shm-size" in caplog.text


def test_export_nbytes_counts_floating_tensors_in_the_rollout_dtype() -> None:
    weights = WeightExport(
        WeightSync.MERGED,
        {"w": torch.zeros(4, 8, dtype=torch.float32), "ids": torch.zeros(3, dtype=torch.int64)},
    )
    assert weights.nbytes() == 4 * 8 * 4 + 3 * 8
    assert weights.nbytes(torch.bfloat16) == 4 * 8 * 2 + 3 * 8
