"""run.loggers: every sink gets the same records, and each one's files read back to the logged numbers.

jsonl (always), tensorboard (event files read with tensorboard's EventAccumulator), wandb offline (the
.wandb file read back with rlbridge.metrics.wandb.read_history: wandb's public API needs its server).
"""

from __future__ import annotations

import json
import time
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
            "reward": {"fn": "arithmetic"},
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
    assert [(i.key, i.value) for i in out] == [("run.loggers.1", "wandb")] and "rlbridge-cli[report]" in (
        out[0].fix or ""
    )


def _attempt(run_dir: Path, steps: range) -> None:
    """One process's worth of logging (a train, or a resume): eval at 0, then train + checkpoint per step."""
    log = MetricsLog(run_dir, ["jsonl", "tensorboard", "wandb"], 4, name="resume-test", config={"x": 1})
    for s in steps:
        if s == 0:
            log.write({"kind": "eval", "step": 0, "eval_accuracy": 0.5})
            continue
        log.write({"kind": "train", "step": s, "reward_mean": s + 0.25 * (steps.start > 1)})
        log.write({"kind": "checkpoint", "step": s, "time_save": 0.1})
    log.close()


def _tb_and_wandb_steps(run_dir: Path) -> tuple[list[tuple[str, int, float]], list[tuple[int, float]]]:
    from rlbridge.metrics.tensorboard import read_events
    from rlbridge.metrics.wandb import read_history

    tb = sorted(read_events(run_dir / "logs" / "tensorboard"))
    deadline = time.monotonic() + 20
    while (
        True
    ):  # wandb's service process may still be writing the last run's file after finish() (seen under load)
        rows = [
            r for d in sorted((run_dir / "logs" / "wandb").glob("offline-run-*")) for r in read_history(d)
        ]
        if any(r.get("_step") == 4 for r in rows) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    wb = sorted((r["_step"], r["train/reward_mean"]) for r in rows if "train/reward_mean" in r)
    return tb, wb


def _wait_for_row(run_dir: Path, step: int) -> None:
    """Until an offline run under run_dir holds `step` (wandb's service may write after finish(), under load)."""
    from rlbridge.metrics.wandb import read_history

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        runs = sorted((run_dir / "logs" / "wandb").glob("offline-run-*"))
        if any(r.get("_step") == step for d in runs if any(d.glob("run-*.wandb")) for r in read_history(d)):
            time.sleep(0.5)  # its closing records
            return
        time.sleep(0.2)


def _file_bytes(root: Path, pattern: str) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.glob(pattern))}


@pytest.mark.parametrize("case", ["resume", "rows lost in the kill"])
def test_resume_logs_each_step_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Killed after step 3 with checkpoint 2: the resume recomputes step 3 (metrics.jsonl cut back to step 2 by
    prepare_resume's truncate_metrics). TensorBoard as it reads the files (its purge marker applied) and W&B as
    `wandb sync` gives it the offline runs (the rewind applied) hold each step once, with the resumed run's
    values for step 3; the killed attempt's files are not rewritten, and read raw they do hold step 3 twice (so
    the checks can fail). "rows lost in the kill": the killed attempt's .wandb file lost its rows (wandb buffers
    them in its service process; seen after a kill -9 in tests/integration/test_resume.py): the resume logs
    steps 0-2 again from metrics.jsonl."""
    from rlbridge.metrics.tensorboard import read_events, read_scalars
    from rlbridge.metrics.wandb import read_history, read_records, synced_history, truncate_offline
    from rlbridge.run.resume import truncate_metrics

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    _attempt(tmp_path, range(0, 4))  # steps 0..3; the run dies here, its newest checkpoint is step 2
    _wait_for_row(tmp_path, 3)
    if case == "rows lost in the kill":
        truncate_offline(tmp_path / "logs" / "wandb", -1)  # every row gone, as after the kill -9
    truncate_metrics(tmp_path, 2)
    tb_dir, wb_dir = tmp_path / "logs" / "tensorboard", tmp_path / "logs" / "wandb"
    before = _file_bytes(tb_dir, "events.out.tfevents.*")
    time.sleep(
        1.1
    )  # wandb names an offline run by the second it started: a resume in the same second shares it
    _attempt(tmp_path, range(3, 5))  # the resume: steps 3 and 4 (reward_mean + 0.25 marks the new values)
    after = _file_bytes(tb_dir, "events.out.tfevents.*")
    assert all(after[name] == data for name, data in before.items())  # not rewritten

    tb = read_scalars(tb_dir)
    assert tb["train/reward_mean"] == [(1, 1.0), (2, 2.0), (3, 3.25), (4, 4.25)]
    assert [s for s, _ in tb["checkpoint/time_save"]] == [1, 2, 3, 4]
    assert [s for s, _ in tb["eval/eval_accuracy"]] == [0]
    raw = [s for t, s, _ in read_events(tb_dir) if t == "train/reward_mean"]
    assert raw.count(3) == 2  # the purge marker, not a rewrite, hides the killed attempt's step 3

    _tb_and_wandb_steps(tmp_path)  # waits until wandb's service has written the last rows
    runs = sorted(wb_dir.glob("offline-run-*"))
    assert len(runs) == 2
    rows = synced_history(wb_dir)
    assert sorted(r["_step"] for r in rows) == [0, 1, 2, 3, 4]  # each row once (step 0: the evaluation)
    assert sorted((r["_step"], r["train/reward_mean"]) for r in rows if "train/reward_mean" in r) == [
        (1, 1.0), (2, 2.0), (3, 3.25), (4, 4.25)
    ]  # fmt: skip
    branch = [r.run.branch_point for r in read_records(runs[1]) if r.WhichOneof("record_type") == "run"][0]
    if case == "resume":
        assert (branch.run, branch.value) == (runs[1].name.split("-")[-1], 2)  # rewound to the checkpoint
        assert [r["_step"] for r in read_history(runs[1])] == [3, 4]
        assert [r["_step"] for r in read_history(runs[0])] == [
            0,
            1,
            2,
            3,
        ]  # the killed attempt's: not rewritten
        union = [r["_step"] for d in runs for r in read_history(d)]
        assert union.count(3) == 2  # without W&B's rewind step 3 would show twice
    else:
        assert not branch.run  # nothing to rewind to: steps 0-2 are logged again
        assert [r["_step"] for r in read_history(runs[1])] == [0, 1, 2, 3, 4]


def test_wandb_identity_from_the_recipe_and_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlbridge.metrics.wandb import identity, read_records
    from rlbridge.recipe.schema import WandbCfg

    cfg = WandbCfg(project="grpo-runs", entity="lab", name="qwen-lora", tags=["lora", "gsm8k"])
    for var in ("WANDB_PROJECT", "WANDB_ENTITY", "WANDB_NAME", "WANDB_TAGS"):
        monkeypatch.delenv(var, raising=False)
    assert identity(cfg, "run-dir") == {
        "project": "grpo-runs", "entity": "lab", "name": "qwen-lora", "tags": ["lora", "gsm8k"]
    }  # fmt: skip
    assert identity(WandbCfg(), "run-dir") == {
        "project": "rlbridge",
        "entity": None,
        "name": "run-dir",
        "tags": [],
    }
    monkeypatch.setenv("WANDB_PROJECT", "env-project")
    monkeypatch.setenv("WANDB_NAME", "env-name")
    monkeypatch.setenv("WANDB_TAGS", "a, b")
    assert identity(cfg, "run-dir") == {
        "project": "env-project",
        "entity": "lab",
        "name": "env-name",
        "tags": ["a", "b"],
    }

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_NAME")
    log = MetricsLog(tmp_path, ["jsonl", "wandb"], 1, name="dir-name", config={}, wandb=cfg)
    log.write(RECORDS[1])
    log.close()
    _wait_for_row(tmp_path, 1)
    (run_dir,) = (tmp_path / "logs" / "wandb").glob("offline-run-*")
    run = [r.run for r in read_records(run_dir) if r.WhichOneof("record_type") == "run"][0]
    assert (run.project, run.entity, run.display_name, list(run.tags)) == (
        "env-project",
        "lab",
        "qwen-lora",
        ["a", "b"],
    )


def test_a_refused_rewind_continues_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A W&B server without rewind: the resume says so and continues the run with resume="allow"."""
    from rlbridge.metrics import wandb as wb
    from rlbridge.run.resume import truncate_metrics

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    _attempt(tmp_path, range(0, 3))
    truncate_metrics(tmp_path, 2)
    real_init, calls = wb.wandb.init, []

    def init(**kwargs: object) -> object:
        calls.append(sorted(k for k in kwargs if k in ("resume_from", "resume", "id")))
        if "resume_from" in kwargs:
            raise RuntimeError("rewind is not enabled for this entity")
        return real_init(**kwargs)

    monkeypatch.setattr(wb.wandb, "init", init)
    told: list[str] = []
    time.sleep(1.1)
    sink = wb.WandbSink(tmp_path / "logs", name="x", config={}, history=[{"step": 2}], warn=told.append)
    sink.close()
    assert calls == [["resume_from"], ["id", "resume"]]
    assert "refused to rewind" in told[0] and sink.backfilled == []


def test_a_resume_waits_while_wandb_still_holds_the_run() -> None:
    """After a kill -9 the killed run's wandb service can hold the run id for a while; a resume started at once
    got wandb's "run ID ... is in use" as a traceback (seen in test_resume on a loaded machine). The init is
    retried while that is the answer, then refused with what to do; any other error passes at once."""
    from rlbridge.errors import RlbridgeError
    from rlbridge.metrics.wandb import init_when_free

    answers: list[object] = [
        RuntimeError("run ID abc is in use"),
        RuntimeError("run ID abc is in use"),
        "run",
    ]

    def init() -> object:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert init_when_free("abc", init, wait_s=10) == "run" and not answers

    def held() -> object:
        raise RuntimeError("run ID abc is in use")

    with pytest.raises(RlbridgeError, match="W&B run abc is still held .* WANDB_MODE=disabled"):
        init_when_free("abc", held, wait_s=0.2)

    def broken() -> object:
        raise ValueError("no network")

    with pytest.raises(ValueError, match="no network"):
        init_when_free("abc", broken, wait_s=10)
