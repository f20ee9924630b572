"""`rlbridge resume` up to the point where training starts (no Ray): the recipe round trip it relies on, the
checkpoint it picks and the ones it skips, refused and accepted --set changes, metrics cut back, signals."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from rlbridge.cli import app
from rlbridge.recipe import run_checks
from rlbridge.recipe.load import build_recipe, load_recipe_data
from rlbridge.recipe.schema import Recipe
from rlbridge.run import checkpoint as ckpt
from rlbridge.run.directory import resolved_yaml
from rlbridge.run.resume import find_checkpoint, prepare_resume, rollout_seed, truncate_metrics
from rlbridge.run.signals import StopSignals
from tests.fixtures.tiny_llama import build_tiny_llama

ROOT = Path(__file__).resolve().parents[3]
runner = CliRunner()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize("path", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.stem)
def test_resolved_recipe_loads_again(path: Path) -> None:
    """The run directory and every checkpoint hold the resolved recipe (every default written out); resume must
    be able to load it and pass the same checks (a check that asks whether a key was written would refuse it)."""
    recipe = build_recipe(*load_recipe_data(path))
    again = Recipe.model_validate(yaml.safe_load(resolved_yaml(recipe)))
    assert again == recipe and resolved_yaml(again) == resolved_yaml(recipe)
    issues = lambda r: [(i.key, i.message) for i in run_checks(r, model_checks=False)[0]]  # noqa: E731
    assert issues(again) == issues(recipe)  # the shipped recipes' data paths may be absent here: same issues


def make_run(tmp_path: Path, model_dir: Path, steps: tuple[int, ...] = (2, 4)) -> Path:
    data = {
        "name": "r",
        "model": {"path": str(model_dir), "dtype": "float32"},
        "lora": {"rank": 8, "alpha": 16, "targets": ["all-linear"]},
        "trainer": {"engine": "hf", "micro_batch_size": 4},
        "rollout": {
            "engine": "vllm",
            "n": 4,
            "max_prompt_tokens": 64,
            "max_response_tokens": 24,
            "max_lora_rank": 8,
        },
        "data": {"train": {"path": "builtin:arithmetic"}, "batch_size": 2},
        "reward": {"terms": [{"fn": "length"}]},
        "run": {"steps": 4, "save_every": 2},
        "cluster": {"device": "cpu"},
    }
    run = tmp_path / "run"
    run.mkdir()
    text = resolved_yaml(Recipe.model_validate(data))
    (run / "recipe.yaml").write_text(text)
    for step in steps:
        ckpt.save_checkpoint(
            run,
            step,
            tensors={"trainable": {"w": torch.full((2,), float(step))}},
            state={"step": step},
            recipe_yaml=text,
            keep=5,
        )
    records = [{"kind": "eval", "step": 0}] + [
        {"kind": k, "step": s} for s in range(1, 5) for k in ("train", "checkpoint")
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"kind": "tra')
    return run


def test_unsafe_set_is_refused_with_exit_2(tmp_path: Path, model_dir: Path) -> None:
    run = make_run(tmp_path, model_dir)
    before = (run / "recipe.yaml").read_text()
    res = runner.invoke(app, ["resume", str(run), "--set", "lora.rank=16", "--set", "run.steps=6"])
    assert res.exit_code == 2, res.output
    assert (
        "lora.rank" in res.output
        and "changed from 8 to 16" in res.output
        and "cannot resume" in res.output
        and "Traceback" not in res.output
    )
    assert "run.steps" not in res.output.split("lora.rank", 1)[0]  # only the unsafe key is an error
    assert (run / "recipe.yaml").read_text() == before  # nothing was changed
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 10


def test_safe_set_is_accepted_and_recorded(tmp_path: Path, model_dir: Path) -> None:
    run = make_run(tmp_path, model_dir)
    notes: list[str] = []
    plan = prepare_resume(run, ["run.steps=6", "run.save_every=3"], log=notes.append)
    assert plan.point.step == 4 and plan.valid.recipe.run.steps == 6
    assert [k for k, _, _ in plan.changed] == ["run.steps", "run.save_every"]
    assert any("run.steps 4 -> 6" in n for n in notes)
    assert yaml.safe_load((run / "recipe.yaml").read_text())["run"]["steps"] == 6
    assert list((run / "logs").glob("recipe.before-resume-*.yaml"))
    # the CLI: the checkpoint is at run.steps already -> nothing to do, exit 0
    res = runner.invoke(app, ["resume", str(run), "--set", "run.steps=4"])
    assert res.exit_code == 0 and "nothing to do" in res.output, res.output


def test_newest_broken_checkpoint_is_skipped_with_the_reason(tmp_path: Path, model_dir: Path) -> None:
    run = make_run(tmp_path, model_dir)
    newest = run / "checkpoints" / "step_000004" / "trainable.safetensors"
    newest.write_bytes(newest.read_bytes()[:-3] + b"xyz")
    notes: list[str] = []
    plan = prepare_resume(run, [], log=notes.append)
    assert plan.point.step == 2 and plan.point.path.name == "step_000002"
    assert any("step_000004" in n and "sha256 mismatch" in n for n in notes), notes
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 1, 2, 2] and plan.dropped_records == 5  # records past step 2 and the torn line


def test_find_checkpoint_by_step_or_path(tmp_path: Path, model_dir: Path) -> None:
    run = make_run(tmp_path, model_dir)
    assert find_checkpoint(run).step == 4
    assert find_checkpoint(run, step=2).step == 2
    assert find_checkpoint(run / "checkpoints" / "step_000002").step == 2
    with pytest.raises(Exception, match="no checkpoint of step 3"):
        find_checkpoint(run, step=3)
    with pytest.raises(Exception, match="neither a run directory nor a checkpoint"):
        find_checkpoint(tmp_path / "elsewhere")


def test_truncate_metrics_keeps_up_to_the_step(tmp_path: Path) -> None:
    lines = [json.dumps({"kind": "train", "step": s}) for s in range(5)] + ["", "not json"]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert truncate_metrics(tmp_path, 2) == 3
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    assert truncate_metrics(tmp_path, 2) == 0


def test_rollout_seeds_depend_on_seed_step_and_purpose_only() -> None:
    seeds = {rollout_seed(s, k, p) for s in (1, 2) for k in range(50) for p in ("train", "eval")}
    assert len(seeds) == 200 and all(0 <= x < 2**31 for x in seeds)
    assert rollout_seed(7, 3) == rollout_seed(7, 3)


def test_stop_signals_first_requests_second_ctrl_c_aborts() -> None:
    previous = signal.getsignal(signal.SIGTERM)
    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested == "SIGTERM"
        os.kill(os.getpid(), signal.SIGTERM)  # repeated SIGTERM: still saving
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is previous


def test_a_run_killed_in_its_final_evaluation_is_not_done(tmp_path: Path, model_dir: Path) -> None:
    """Every step saved but no evaluation record of the last step (killed in the final evaluation, which
    comes after the last save; found by the crash-anywhere soak): `resume` must run it, not say "nothing to
    do". Without data.val there is no final evaluation to miss."""
    from rlbridge.cli.train import _final_eval_missing

    run = make_run(tmp_path, model_dir)
    raw = yaml.safe_load((run / "recipe.yaml").read_text())
    assert not _final_eval_missing(run, Recipe.model_validate(raw))  # no data.val
    raw["data"]["val"] = {"path": "builtin:arithmetic"}
    with_val = Recipe.model_validate(raw)
    assert _final_eval_missing(run, with_val)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('\n{"kind": "eval", "step": 4, "eval_accuracy": 0.0}\n')
    assert not _final_eval_missing(run, with_val)
