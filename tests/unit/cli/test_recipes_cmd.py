"""`rlbridge recipes list | show | copy`, and the recipes ship inside the package (wheel included)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from importlib.resources import files
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlbridge.cli import app
from rlbridge.recipe import shipped as sh

ROOT = Path(__file__).resolve().parents[3]
REPO_RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
runner = CliRunner()


def test_packaged_recipes_are_the_repository_recipes() -> None:
    assert Path(str(files("rlbridge") / "recipes")).resolve() == (ROOT / "recipes").resolve()
    assert [s.name for s in sh.shipped()] == REPO_RECIPES


def test_list_names_every_recipe_with_a_description() -> None:
    res = runner.invoke(app, ["recipes", "list", "--json"])
    assert res.exit_code == 0
    listed = json.loads(res.stdout)
    assert [r["name"] for r in listed] == REPO_RECIPES
    assert all(r["description"] and r["run"].startswith("rlbridge ") for r in listed), listed
    res = runner.invoke(app, ["recipes", "list"])
    assert res.exit_code == 0 and "quickstart" in res.output


def test_show_prints_the_file() -> None:
    res = runner.invoke(app, ["recipes", "show", "quickstart"])
    assert res.exit_code == 0 and res.stdout == (ROOT / "recipes" / "quickstart.yaml").read_text()


def test_unknown_name_exit_2_with_suggestion() -> None:
    for cmd in (["show", "quickstrat"], ["copy", "quickstrat", "x.yaml"]):
        res = runner.invoke(app, ["recipes", *cmd])
        assert res.exit_code == 2 and "did you mean 'quickstart'" in res.output


def test_copy_then_validate(tmp_path: Path) -> None:
    dest = tmp_path / "mine.yaml"
    res = runner.invoke(app, ["recipes", "copy", "quickstart", str(dest)])
    assert res.exit_code == 0, res.output
    text = dest.read_text()
    assert f"rlbridge train {dest}" in text.splitlines()[1]  # the header's command names the copy
    assert text.splitlines()[2:] == (ROOT / "recipes" / "quickstart.yaml").read_text().splitlines()[2:]
    res = runner.invoke(app, ["validate-recipe", str(dest), "--no-model-checks"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["recipes", "copy", "quickstart", str(dest)])
    assert res.exit_code == 1 and "--force" in res.output
    assert runner.invoke(app, ["recipes", "copy", "quickstart", str(dest), "--force"]).exit_code == 0
    res = runner.invoke(
        app, ["recipes", "copy", "ppo-smollm2-cpu", str(tmp_path)]
    )  # a directory: keeps the name
    assert res.exit_code == 0 and (tmp_path / "ppo-smollm2-cpu.yaml").is_file()


def test_subcommands_have_examples() -> None:
    for cmd in ("list", "show", "copy"):
        res = runner.invoke(app, ["recipes", cmd, "--help"])
        assert res.exit_code == 0 and "Example:" in res.output and f"rlbridge recipes {cmd}" in res.output


def test_a_built_wheel_ships_the_recipes(tmp_path: Path) -> None:
    """Non-editable install: build the wheel from a copy of the sources, then list the recipes from it."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "recipes", src / "recipes")
    shutil.copytree(
        ROOT / "rlbridge", src / "rlbridge", symlinks=True, ignore=shutil.ignore_patterns("__pycache__")
    )
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            str(src),
            "-w",
            str(tmp_path / "dist"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if res.returncode != 0 and "No module named pip" in res.stderr:
        pytest.skip("pip is not available in this interpreter")
    assert res.returncode == 0, res.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("rlbridge_cli-*.whl")  # the distribution is rlbridge-cli
    names = zipfile.ZipFile(wheel).namelist()
    assert sorted(Path(n).stem for n in names if n.startswith("rlbridge/recipes/")) == REPO_RECIPES
    code = "from rlbridge.recipe.shipped import shipped; print(' '.join(s.name for s in shipped()))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(wheel)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == REPO_RECIPES
