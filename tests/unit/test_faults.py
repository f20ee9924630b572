"""rlbridge/faults.py: which occurrence of a point, in which rank, pauses (and writes the marker)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rlbridge import faults


def test_pause_picks_the_point_its_occurrence_and_its_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "marker"
    monkeypatch.setattr(faults, "_counts", {})
    monkeypatch.setenv(faults.PAUSE_ENV, "update#2:0, checkpoint-gather@3#1:0, checkpoint-files@1:0")
    monkeypatch.setenv(faults.MARKER_ENV, str(marker))
    monkeypatch.setenv("RANK", "1")
    for point in ("update", "update", "update", "checkpoint-gather", "checkpoint-files"):
        faults.pause(point)
    pid = os.getpid()
    assert marker.read_text().splitlines() == [f"update 2 {pid}", f"checkpoint-files 1 {pid}"]
    monkeypatch.setattr(faults, "_counts", {})
    monkeypatch.setenv("RANK", "3")
    faults.pause("checkpoint-gather")
    assert marker.read_text().splitlines()[-1] == f"checkpoint-gather 1 {pid}"
