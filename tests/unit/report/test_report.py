"""`rlbridge report` on run directories in every state, built from files (the real run is in
tests/integration/test_report_real_run.py): finished, running (live pid), crashed (dead pid, failed),
no status file, a torn last line, a run that died before its first step."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from rlbridge.cli import app
from rlbridge.report import PLOTS, read_run, render_report

runner = CliRunner()


def make_run(
    root: Path, *, steps_done: int, planned: int = 4, status: dict | None = None, torn: bool = False
) -> Path:
    root.mkdir(parents=True)
    (root / "recipe.yaml").write_text(
        yaml.safe_dump(
            {
                "name": "unit",
                "model": {"path": "m", "dtype": "float32"},
                "run": {"steps": planned},
                "trainer": {"optim": {"clip_grad": 1.0}},
            }
        )
    )
    lines = [
        {
            "kind": "eval",
            "step": 0,
            "eval_accuracy": 0.0,
            "eval_format": 0.5,
            "eval_samples": 4.0,
            "time_eval": 1.0,
        }
    ]
    for s in range(1, steps_done + 1):
        lines.append(
            {
                "kind": "train",
                "step": s,
                "reward_mean": 0.1 * s,
                "reward_std": 0.05,
                "accuracy": 0.25,
                "kl": None,
                "entropy": 1.0,
                "grad_norm": "nan" if s == 2 else 0.5,
                "skipped": int(s == 2),
                "time_generate": 2.0,
                "time_update": 1.0,
                "time_step": 3.0,
                "tokens_per_s": 20.0,
            }
        )
    if steps_done == planned:
        lines.append(
            {
                "kind": "eval",
                "step": planned,
                "eval_accuracy": 0.5,
                "eval_format": 1.0,
                "eval_samples": 4.0,
                "time_eval": 1.0,
            }
        )
    text = "".join(json.dumps(x) + "\n" for x in lines) + (
        '{"kind": "train", "step": 9, "rew' if torn else ""
    )
    (root / "metrics.jsonl").write_text(text)
    if status is not None:
        (root / "status.json").write_text(
            json.dumps({"host": socket.gethostname(), "time": time.time(), **status})
        )
    return root


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_finished_run_report(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", steps_done=4, status={"state": "finished", "pid": 1})
    rep = render_report(run)
    assert rep.markdown == run / "report" / "report.md"
    assert [p.name for p in rep.plots] == list(PLOTS)
    assert all(p.stat().st_size > 0 for p in rep.plots)
    md = rep.markdown.read_text()
    assert "**finished**" in md and "4 done of 4 planned" in md
    assert "| accuracy | 0.0% (step 0) | 50.0% (step 4) | 50.0% (step 4) | +50.0 pts |" in md
    assert "| generate | 2.00 | 67% |" in md and "1 step(s) skipped" in md


@pytest.mark.parametrize(
    ("status", "state"),
    [
        ({"state": "running", "pid": os.getpid()}, "running"),
        ({"state": "running", "pid": None}, "crashed"),  # pid filled in below: a process that has exited
        ({"state": "failed", "pid": 1, "error": "trainer and rollout log-probs disagree"}, "crashed"),
        ({"state": "interrupted", "pid": 1, "error": "stopped by run.time_limit_s after step 2"}, "stopped"),
        ({"state": "running", "pid": 1, "host": "another-host"}, "running"),
    ],
)
def test_status_from_status_file(tmp_path: Path, status: dict, state: str) -> None:
    if status["pid"] is None:
        status = {**status, "pid": dead_pid()}
    run = make_run(tmp_path / "run", steps_done=2, status=status)
    data = read_run(run)
    assert data.status.state == state, data.status
    assert "step 2 of 4" in data.status.detail
    if "error" in status:
        assert status["error"] in data.status.detail


def test_no_status_file_is_inferred(tmp_path: Path) -> None:
    done = make_run(tmp_path / "done", steps_done=4)
    assert read_run(done).status.state == "finished"
    recent = make_run(tmp_path / "recent", steps_done=2)
    assert read_run(recent).status.state == "running"
    old = make_run(tmp_path / "old", steps_done=2)
    past = time.time() - 3600
    os.utime(old / "metrics.jsonl", (past, past))
    assert read_run(old).status.state == "incomplete"


def test_torn_last_line_and_cli(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", steps_done=3, status={"state": "running", "pid": os.getpid()}, torn=True)
    res = runner.invoke(app, ["report", str(run), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert "running" in res.output and "report.md" in res.output
    md = (tmp_path / "out" / "report.md").read_text()
    assert "1 unreadable line(s)" in md and "3 done of 4 planned" in md
    assert all((tmp_path / "out" / name).stat().st_size > 0 for name in PLOTS)


def test_run_that_died_before_its_first_step(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.yaml").write_text(yaml.safe_dump({"name": "early", "run": {"steps": 5}}))
    (run / "status.json").write_text(
        json.dumps({"state": "failed", "pid": 1, "host": socket.gethostname(), "error": "no GPU"})
    )
    rep = render_report(run)
    assert all(p.stat().st_size > 0 for p in rep.plots)
    md = rep.markdown.read_text()
    assert "**crashed**" in md and "No training step logged yet." in md and "no GPU" in md


def test_not_a_run_directory_exit_codes(tmp_path: Path) -> None:
    res = runner.invoke(app, ["report", str(tmp_path)])
    assert res.exit_code == 1 and "holds no run" in " ".join(res.output.split())
    res = runner.invoke(app, ["report", str(tmp_path / "missing")])
    assert res.exit_code == 2


def test_report_does_not_import_heavy_libraries() -> None:
    code = (
        "import sys; from rlbridge.cli import app; import rlbridge.report; "
        "print([m for m in ('torch', 'matplotlib', 'ray', 'vllm', 'wandb', 'tensorboard') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_grown_log_prob_gap_is_named(tmp_path: Path) -> None:
    """run.health.max_logprob_diff_growth replayed over the records: the H200 run with compiled trainer layers
    (bench/results/compile_loop-gpu-2026-12-03.metrics.jsonl) grew at step 8; an eager run has no such note."""
    results = Path(__file__).resolve().parents[3] / "bench" / "results"
    for name, records, expect in [
        ("compiled", results / "compile_loop-gpu-2026-12-03.metrics.jsonl", "step 8: the trainer-vs-rollout"),
        ("eager", results / "quickstart_gpu-2026-12-01" / "metrics.jsonl", None),
    ]:
        run = make_run(tmp_path / name, steps_done=0, planned=30)
        (run / "metrics.jsonl").write_text(records.read_text())
        md = " ".join(render_report(run).markdown.read_text().split())
        if expect is None:
            assert "log-prob gap grew" not in md
        else:
            assert f"**{expect} log-prob gap grew from 0.026" in md, md
            assert "(run.health.max_logprob_diff_growth)" in md
