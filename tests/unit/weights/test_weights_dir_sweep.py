"""RAM-backed weight directories of dead processes are swept (kill -9'd runs left 540 MB each in /dev/shm)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
