"""run.loggers: every sink gets the same records, and each one's files read back to the logged numbers.

jsonl (always), tensorboard (event files read with tensorboard's EventAccumulator), wandb offline (the
.wandb file read back with rlbridge.metrics.wandb.read_history: wandb's public API needs its server).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlbridge.metrics.log import MetricsLog
from rlbridge.metrics.sinks import scalars

RECORDS = [
    {"kind": "eval", "step": 0, "eval_accuracy": 0.25, "eval_format": 0.5, "time_eval": 1.5},
    {
        "kind": "train",
        "step": 1,
        "reward_mean": 0.1,
        "accuracy": 0.0,
        "kl": None,
        "grad_norm": 1.5,
        "skipped": False,
        "nonfinite": [],
        "time_generate": 2.0,
        "time_update": 1.0,
        "time_step": 3.0,
        "tokens_per_s": 10.0,
    },
    {
        "kind": "train",
        "step": 2,
        "reward_mean": 0.3,
        "accuracy": 0.5,
        "kl": 0.01,
        "grad_norm": float("nan"),
        "skipped": True,
        "nonfinite": ["loss"],
        "time_generate": 2.5,
        "time_update": 1.5,
        "time_step": 4.0,
        "tokens_per_s": 12.5,
    },
    {"kind": "eval", "step": 2, "eval_accuracy": 0.75, "eval_format": 1.0, "time_eval": 1.0},
]


def test_scalars_tags_numbers_only() -> None:
    assert scalars(RECORDS[1]) == {
        "train/reward_mean": 0.1,
        "train/accuracy": 0.0,
        "train/grad_norm": 1.5,
        "train/skipped": 0.0,
        "train/time_generate": 2.0,
        "train/time_update": 1.0,
        "train/time_step": 3.0,
        "train/tokens_per_s": 10.0,
    }
    assert scalars(RECORDS[0])["eval/eval_accuracy"] == 0.25


def close(a: float, b: float) -> bool:
    return (a != a and b != b) or abs(a - b) < 1e-6


@pytest.fixture()
def logged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("WANDB_API_KEY", "sk-test-secret-0123456789")  # must never reach the run directory
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = MetricsLog(
        tmp_path,
        ["jsonl", "tensorboard", "wandb"],
        2,
        name="loggers-test",
        config={"name": "loggers-test", "run": {"steps": 2}},
    )
    for r in RECORDS:
        log.write(r)
    log.close()
    return tmp_path


def test_every_logger_reads_back(logged: Path) -> None:
    lines = [json.loads(x) for x in (logged / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in lines] == [(r["kind"], r["step"]) for r in RECORDS]
    assert lines[2]["grad_norm"] == "nan" and lines[2]["nonfinite"] == ["loss"]

    from rlbridge.metrics.tensorboard import read_scalars

    tb = read_scalars(logged / "logs" / "tensorboard")
    expected: dict[str, list[tuple[int, float]]] = {}
    for r in RECORDS:
        for tag, v in scalars(r).items():
            expected.setdefault(tag, []).append((r["step"], v))
    assert set(tb) == set(expected)
    for tag, series in expected.items():
        assert [s for s, _ in tb[tag]] == [s for s, _ in series], tag
        assert all(close(a, b) for (_, a), (_, b) in zip(tb[tag], series, strict=True)), tag

    from rlbridge.metrics.wandb import read_config, read_history

    runs = list((logged / "logs" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((logged / "logs" / "wandb").iterdir())
    rows = read_history(runs[0])
    by_step: dict[int, dict[str, float]] = {}
    for row in rows:
        by_step.setdefault(row["_step"], {}).update(row)
    assert sorted(by_step) == [0, 1, 2]
    for r in RECORDS:
        for tag, v in scalars(r).items():
            got = by_step[r["step"]][tag]
            assert close(float(got), v) if not isinstance(got, str) else got.lower() == "nan", (tag, got, v)
    config = read_config(runs[0])
    assert config == {"name": "loggers-test", "run": {"steps": 2}}


def test_api_key_never_written(logged: Path) -> None:
    for f in logged.rglob("*"):
        if f.is_file():
            assert b"sk-test-secret-0123456789" not in f.read_bytes(), f


def test_failing_logger_is_dropped_and_jsonl_continues(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    class Broken:
        def write(self, record: dict) -> None:
            raise OSError("disk full")

        def close(self) -> None:
            pass

    log = MetricsLog(tmp_path, ["jsonl"], 2)
    log.sinks["tensorboard"] = Broken()
    for r in RECORDS:
        log.write(r)
    log.close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == len(RECORDS)
    assert "tensorboard" not in log.sinks


def test_wandb_mode_follows_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlbridge.metrics import wandb as wb

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert wb.mode() == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x")
    assert wb.mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wb.mode() == "disabled"


def test_missing_logger_package_is_a_recipe_issue(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from rlbridge.recipe.checks import check_loggers
    from rlbridge.recipe.schema import Recipe

    r = Recipe.model_validate(
        {
            "name": "x",
            "model": {"path": "m"},
            "data": {"train": {"path": "builtin:arithmetic"}},
            "run": {"loggers": ["console", "wandb", "tensorboard"]},
        }
    )
    out: list = []
    check_loggers(r, out)
    assert out == []
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    check_loggers(r, out)
    assert [(i.key, i.value) for i in out] == [("run.loggers.1", "wandb")] and "rlbridge[report]" in (
        out[0].fix or ""
    )
