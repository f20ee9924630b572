"""bench/size7b.py's step table, read from a run's metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

from bench.size7b import step_row, steps_of


def test_size7b_step_rows_carry_their_checkpoints_save_seconds(tmp_path: Path) -> None:
    """metrics.jsonl keeps a save in its own `checkpoint` record; the 7B table's save_s reads it (it was empty)."""
    lines = [
        {"kind": "train", "step": 1, "time_step": 2.0},
        {"kind": "train", "step": 2, "time_step": 1.0},
        {"kind": "checkpoint", "step": 2, "time_save": 0.36},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert [(r["step"], r["save_s"]) for r in map(step_row, steps_of(tmp_path))] == [(1, None), (2, 0.36)]
