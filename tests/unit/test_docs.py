"""The docs cannot rot: the recipe reference is regenerated and compared, runnable command blocks are run,
and every `rlbridge ...` line in a bash block names a real command.

Convention (docs/index.md): a ```bash block right after a `<!-- runnable -->` line is executed, one line
at a time, in an empty directory holding the checkout's recipes/ and tests/fixtures/ (symlinks); each line
must exit 0, or the code its trailing `# exit N` comment names.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from rlbridge.cli import app
from rlbridge.recipe.docs import render_reference

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
BLOCK = re.compile(r"(<!-- runnable -->\s*\n)?```bash\n(.*?)```", re.S)


def blocks(page: Path) -> list[tuple[bool, list[str]]]:
    """(runnable, command lines) of every bash block; comment-only and blank lines dropped."""
    out = []
    for m in BLOCK.finditer(page.read_text()):
        lines = [x.strip() for x in m.group(2).splitlines()]
        out.append((m.group(1) is not None, [x for x in lines if x and not x.startswith("#")]))
    return out


RUNNABLE = [(p, i, lines) for p in PAGES for i, (run, lines) in enumerate(blocks(p)) if run]


def test_recipe_reference_is_up_to_date() -> None:
    committed = (ROOT / "docs" / "recipe-reference.md").read_text()
    assert committed == render_reference(), (
        "docs/recipe-reference.md is out of date: make docs (python -m rlbridge.recipe.docs > docs/recipe-reference.md)"
    )


def test_there_are_runnable_blocks() -> None:
    pages = {p.name for p, _, _ in RUNNABLE}
    assert {"getting-started.md", "cli.md", "lora.md", "README.md"} <= pages, pages


def expected_code(line: str) -> tuple[str, int]:
    m = re.search(r"\s#\s*exit (\d+)\s*$", line)
    return (line[: m.start()], int(m.group(1))) if m else (line, 0)


@pytest.mark.parametrize(
    ("page", "index", "lines"), RUNNABLE, ids=[f"{p.relative_to(ROOT)}#{i}" for p, i, _ in RUNNABLE]
)
def test_runnable_block(page: Path, index: int, lines: list[str], tmp_path: Path) -> None:
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "fixtures").symlink_to(ROOT / "tests" / "fixtures")
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(ROOT),
        "COLUMNS": "120",
        "NO_COLOR": "1",
    }
    for line in lines:
        command, code = expected_code(line)
        res = subprocess.run(
            ["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )
        assert res.returncode == code, (
            f"{page.name}: `{command}` exited {res.returncode}, expected {code}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
        )
        assert "Traceback" not in res.stderr, res.stderr[-3000:]


def command_names() -> set[str]:
    group = typer.main.get_command(app)
    names = set()
    for name, cmd in group.commands.items():  # type: ignore[attr-defined]
        names.add(name)
        for sub in getattr(cmd, "commands", {}):
            names.add(f"{name} {sub}")
    return names


def test_every_documented_command_exists() -> None:
    known = command_names()
    for page in PAGES:
        for _, lines in blocks(page):
            for line in lines:
                if not line.startswith("rlbridge "):
                    continue
                words = [w for w in shlex.split(line, comments=True)[1:] if not w.startswith("-")]
                if not words:
                    continue
                name = words[0] if words[0] in known else " ".join(words[:2])
                assert name in known, (
                    f"{page.relative_to(ROOT)}: `{line}` names no rlbridge command ({sorted(known)})"
                )


def test_docs_build_strict(tmp_path: Path) -> None:
    """mkdocs.yml builds the docs without a warning: every page in the nav, every link and anchor found (links into
    bench/results/ and recipes/ included, through scripts/mkdocs_hooks.py)."""
    res = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    warnings = [x for x in res.stderr.splitlines() if x.startswith(("WARNING", "ERROR"))]
    assert res.returncode == 0 and not warnings, "mkdocs build --strict:\n" + "\n".join(
        warnings or [res.stderr[-3000:]]
    )


def test_index_lists_every_page() -> None:
    index = (ROOT / "docs" / "index.md").read_text()
    pages = [
        p.relative_to(ROOT / "docs").as_posix() for p in PAGES if p.parent != ROOT and p.name != "index.md"
    ]
    missing = [p for p in pages if f"]({p})" not in index]
    assert not missing, f"docs/index.md lists no line for {missing}"


def test_readme_shows_the_quickstart_recipe_and_its_plan_as_they_are() -> None:
    """The README shows recipes/quickstart.yaml whole and pastes what `rlbridge plan` prints for it."""
    readme = (ROOT / "README.md").read_text()
    assert (ROOT / "recipes" / "quickstart.yaml").read_text() in readme, (
        "README.md: paste recipes/quickstart.yaml whole"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120", "NO_COLOR": "1"}
    res = subprocess.run(
        [sys.executable, "-m", "rlbridge", "plan", "recipes/quickstart.yaml"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"```\n{res.stdout}```" in readme, (
        "README.md: paste the output of `COLUMNS=120 rlbridge plan recipes/quickstart.yaml` anew:\n"
        + res.stdout
    )


def test_readme_links_resolve() -> None:
    """The README is not part of the mkdocs site: its relative links are checked here."""
    text = (ROOT / "README.md").read_text()
    links = [u for u in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"^[a-z]+:|#", u)]
    missing = [u for u in links if not (ROOT / u.split("#")[0]).exists()]
    assert links and not missing, f"README.md links to missing files: {missing}"


def test_readme_stays_a_product_page() -> None:
    """At most 150 lines and no dated log: measurements go to docs/results.md, one line each."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150, (
        "README.md: over 150 lines; move detail to docs/ (docs/results.md for results)"
    )
    dated = [line for line in text.splitlines() if re.match(r"^\s*[-*] .*20\d\d-\d\d-\d\d", line)]
    assert not dated, f"README.md: dated log lines belong in docs/results.md: {dated[:3]}"


def test_recipes_page_lists_every_shipped_recipe() -> None:
    """The README points to docs/recipes.md, which says what each shipped recipe is."""
    page = (ROOT / "docs" / "recipes.md").read_text()
    missing = [p.name for p in sorted((ROOT / "recipes").glob("*.yaml")) if f"`{p.name}`" not in page]
    assert not missing, f"docs/recipes.md lacks {missing}"
