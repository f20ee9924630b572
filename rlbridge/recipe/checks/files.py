"""Files and code the recipe points at: datasets, reward functions, logger packages."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from rlbridge.errors import RecipeIssue
from rlbridge.recipe.checks.common import Issues
from rlbridge.recipe.schema import DatasetCfg, Recipe


# ------------------------------------------------------------------------------- files and code
def check_files(r: Recipe, out: Issues) -> None:
    """The datasets: the template, each file's existence and format, then its first rows (data/datasets.py's
    `check_rows`, where the sources are read)."""
    from rlbridge.data.datasets import check_rows, escape_template, template_problem  # light imports only

    problem = template_problem(r.data.template)
    if problem is not None:
        out.append(
            RecipeIssue(
                "data.template",
                problem,
                value=r.data.template,
                fix=f"double the braces of literal text: template: {escape_template(r.data.template)!r}",
            )
        )
    readable: list[tuple[Literal["train", "val"], DatasetCfg]] = []
    splits: tuple[tuple[Literal["train", "val"], DatasetCfg | None], ...] = (
        ("train", r.data.train),
        ("val", r.data.val),
    )
    for split, ds in splits:
        key = f"data.{split}.path"
        if ds is None or ds.path.startswith("builtin:"):
            if ds is not None and ds.path != "builtin:arithmetic":
                out.append(
                    RecipeIssue(
                        key,
                        f"unknown builtin dataset {ds.path!r}",
                        fix="use builtin:arithmetic or a .jsonl/.parquet file",
                    )
                )
            elif ds is not None:
                readable.append((split, ds))
            continue
        path = Path(ds.path).expanduser()
        if path.suffix not in (".jsonl", ".parquet"):
            out.append(
                RecipeIssue(
                    key,
                    f"unsupported dataset format {path.suffix or '(none)'!r}",
                    value=ds.path,
                    fix="use a .jsonl or .parquet file",
                )
            )
        elif not path.is_file():
            out.append(
                RecipeIssue(
                    key,
                    "file not found",
                    value=ds.path,
                    fix="check the path (relative paths are from the current directory)",
                )
            )
        else:
            readable.append((split, ds))
    seen = set()
    for split, ds in readable:
        for issue in check_rows(ds, r.data, split=split, seed=r.run.seed):
            if (issue.key, issue.message) not in seen and not (
                issue.key == "data.template" and any(i.key == "data.template" for i in out)
            ):
                seen.add((issue.key, issue.message))
                out.append(issue)


def check_reward(r: Recipe, out: Issues) -> None:
    from rlbridge.data.rewards import check_reward_fn  # light module: no heavy imports

    for i, term in enumerate(r.reward.resolved_terms()):
        key = "reward.fn" if r.reward.terms is None else f"reward.terms.{i}.fn"
        problem = check_reward_fn(term.fn)
        if problem:
            out.append(
                RecipeIssue(
                    key,
                    problem,
                    value=term.fn,
                    fix="use a builtin (arithmetic, gsm8k, format) or package.module:function(prompt, completion, sample) -> float",
                )
            )


def check_loggers(r: Recipe, out: Issues) -> None:
    import importlib.util

    for i, logger in enumerate(r.run.loggers):
        if logger in ("wandb", "tensorboard") and importlib.util.find_spec(logger) is None:
            out.append(
                RecipeIssue(
                    f"run.loggers.{i}",
                    f"the {logger} logger needs the {logger} package, which is not installed",
                    value=logger,
                    fix="pip install 'rlbridge-cli[report]', or remove it from run.loggers",
                )
            )
