"""The CLI contract: commands listed, examples in help, exit codes, JSON output, no tracebacks."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlbridge.cli import app

ROOT = Path(__file__).resolve().parents[3]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
runner = CliRunner()
FIX = ROOT / "tests" / "fixtures" / "configs"
GSM8K = Path(__import__("os").environ.get("RLBRIDGE_GSM8K_DIR", ROOT.parent / "shared" / "data" / "gsm8k"))


def test_help_lists_commands_with_examples() -> None:
    res = runner.invoke(app, ["--help"])
    for cmd in ("train", "resume", "validate-recipe", "export-hf", "plan", "schema"):
        assert cmd in res.output
        sub = runner.invoke(app, [cmd, "--help"])
        assert sub.exit_code == 0 and "Example:" in sub.output and "rlbridge " + cmd in sub.output


def recipe_sets(path: Path) -> list[str]:
    """Shipped recipes point at models/data of a real cluster; tests point them at small fixtures."""
    sets = []
    if "qwen2.5" in path.name:
        sets.append(f"model.path={FIX / 'qwen2.5-7b-instruct'}")
    if "qwen3" in path.name:
        sets.append(f"model.path={FIX / 'qwen3-30b-a3b'}")
    if "gsm8k" in path.read_text():
        sets += [f"data.train.path={GSM8K / 'train.jsonl'}", f"data.val.path={GSM8K / 'test.jsonl'}"]
    return sets


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_every_shipped_recipe_validates(recipe: Path) -> None:
    if "gsm8k" in recipe.read_text() and not GSM8K.is_dir():
        pytest.skip(f"GSM8K not found at {GSM8K} (set RLBRIDGE_GSM8K_DIR)")
    header = list(itertools.takewhile(lambda line: line.startswith("#"), recipe.read_text().splitlines()))
    assert recipe.read_text().startswith("#") and any("# Run:" in line for line in header), (
        "the header needs a '# Run:' line"
    )
    args = ["validate-recipe", str(recipe)]
    for s in recipe_sets(recipe):
        args += ["--set", s]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, [*args, "--json"])
    assert json.loads(res.stdout)["valid"] is True


def test_invalid_recipe_exit_2_with_json_errors(tmp_path: Path) -> None:
    res = runner.invoke(
        app,
        [
            "validate-recipe",
            str(ROOT / "recipes" / "quickstart.yaml"),
            "--set",
            "trainer.micro_batch_size=3",
            "--set",
            "rollout.nn=2",
            "--json",
        ],
    )
    assert res.exit_code == 2
    errors = json.loads(res.stdout)["errors"]
    assert {e["key"] for e in errors} == {"trainer.micro_batch_size", "rollout.nn"}
    res = runner.invoke(
        app,
        ["validate-recipe", str(ROOT / "recipes" / "quickstart.yaml"), "--set", "trainer.micro_batch_size=3"],
    )
    assert res.exit_code == 2 and "trainer.micro_batch_size" in res.output and "Traceback" not in res.output


def test_plan_json_has_layout_batches_memory() -> None:
    recipe = ROOT / "recipes" / "qwen2.5-7b-grpo-lora.yaml"
    args = ["plan", str(recipe), "--json", *sum((["--set", s] for s in recipe_sets(recipe)), [])]
    if not GSM8K.is_dir():
        args += ["--set", "data.train.path=builtin:arithmetic", "--set", "data.val.path=builtin:arithmetic"]
    res = runner.invoke(app, args)  # how long it takes: bench/plan_latency.py
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout)
    assert (plan["dp"], plan["tp"], len(plan["trainer_ranks"])) == (4, 2, 8)
    assert plan["trainer_ranks"][3] == {
        "rank": 3,
        "node": 0,
        "local": 3,
        "dp": 1,
        "tp": 1,
        "pp": 0,
        "cp": 0,
        "ep": 0,
        "etp": 0,
    }
    assert plan["batches"]["rollouts_per_step"] == 256
    mem = plan["memory"]
    assert (
        mem["trainable_params"] < mem["total_params"] / 100
        and mem["trainer_total"] < mem["full_ft_trainer_total"]
    )


def test_schema_is_json() -> None:
    res = runner.invoke(app, ["schema"])
    assert json.loads(res.stdout)["title"] == "Recipe"


def test_console_script_and_fast_import() -> None:
    """The light commands must not import torch/vllm/ray/transformers (heavy imports live in one module each)."""
    code = "import sys, rlbridge.cli, rlbridge.plan, rlbridge.recipe; print(sorted(m for m in ('torch','vllm','ray','transformers','megatron') if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "[]"
    res = subprocess.run([sys.executable, "-m", "rlbridge", "--version"], capture_output=True, text=True)
    assert res.returncode == 0 and "rlbridge" in res.stdout


def test_a_failure_after_a_checkpoint_says_how_to_resume(tmp_path: Path) -> None:
    """A run failing mid-way (a worker died, a health gate) gets the newest complete checkpoint and the resume
    command added to its error; one that never saved, a recipe error, or a message with its own hint, not."""
    import torch

    from rlbridge.cli.train import resume_hint
    from rlbridge.errors import RecipeError, RlbridgeError
    from rlbridge.run import checkpoint as ck

    def failure(exc: Exception) -> str:
        with pytest.raises(type(exc)) as info, resume_hint(tmp_path):
            raise exc
        return str(info.value)

    assert failure(RlbridgeError("rollout worker died: x")) == "rollout worker died: x"  # nothing saved yet
    for step in (1, 2):
        ck.save_checkpoint(
            tmp_path,
            step,
            tensors={"trainable": {"w": torch.zeros(2)}},
            state={},
            recipe_yaml="a: 1\n",
            keep=3,
        )
    (tmp_path / "checkpoints" / "step_000002" / "manifest.json").unlink()  # step 2 incomplete
    assert failure(RlbridgeError("rollout worker died: x")) == (
        f"rollout worker died: x\nthe run stops; resume from {tmp_path / 'checkpoints' / 'step_000001'} (step 1) "
        f"with: rlbridge resume {tmp_path}"
    )
    assert (
        failure(RlbridgeError(f"disk full; resume with: rlbridge resume {tmp_path}")).count("rlbridge resume")
        == 1
    )
    assert "resume" not in failure(RecipeError([]))
