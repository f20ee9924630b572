"""`rlbridge train` and `rlbridge resume`."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from rlbridge.cli import render
from rlbridge.cli.common import ForceOpt, RecipeArg, SetOpt, example, user_errors
from rlbridge.recipe import ValidRecipe, load_recipe, validate_recipe

if TYPE_CHECKING:
    from rlbridge.recipe.schema import Recipe
    from rlbridge.run.resume import ResumePoint


@example(
    "rlbridge train recipes/quickstart.yaml --set run.steps=20\n\n"
    "    rlbridge train --smoke recipes/qwen2.5-7b-grpo-lora.yaml --set model.path=DIR_WITH_CONFIG_JSON"
)
def train(
    recipe: Path = RecipeArg,
    set_: list[str] = SetOpt,
    run_dir: Path | None = typer.Option(
        None, "--run-dir", help="Run directory (default: run.dir or runs/<name>-<time>)."
    ),
    smoke: bool = typer.Option(
        False,
        "--smoke",
        help="Check a megatron recipe's wiring on this machine's CPUs first: its model shrunk to a few random "
        "layers (same architecture and parallel layout; only config.json is read), one CPU worker per GPU, "
        "hf rollouts, 2 steps. Prints every change it makes.",
    ),
    force: bool = ForceOpt,
) -> None:
    """Validate the recipe, then train. Exit 0 done, 1 failure, 2 invalid recipe."""
    with user_errors():
        if smoke:
            valid = smoke_recipe(
                recipe, list(set_), log=lambda msg: render.out.print(f"[yellow]smoke[/] {msg}"), force=force
            )
        else:
            valid = validate_recipe(recipe, set_, force=force)
    run(valid, run_dir)


def smoke_recipe(path: Path, overrides: list[str], *, log: Callable[[str], None], force: bool) -> ValidRecipe:
    """train --smoke: validate the recipe as written (every check, its real model shape included; only the
    CPU-only settings the smoke run turns off may fail), then return the validated smoke recipe with its shrunk
    model built (rlbridge/model/smoke.py)."""
    from rlbridge.errors import RecipeError
    from rlbridge.model import smoke

    try:
        original = validate_recipe(path, overrides, force=force).recipe
    except RecipeError as e:
        rest = [i for i in e.issues if i.key not in smoke.CPU_ONLY_KEYS]
        if rest:
            raise RecipeError(rest) from None
        original = load_recipe(path, overrides)  # the schema held; only checks the smoke run turns off failed
    plan = smoke.plan_smoke(original, smoke.read_config(original))
    for note in plan.notes:
        log(note)
    model_dir = smoke.build_smoke_model(plan.config, seed=original.run.seed, progress=log)
    return validate_recipe(path, [*overrides, *plan.overrides, f"model.path={json.dumps(str(model_dir))}"])


@example("rlbridge resume runs/quickstart-20261130-1200 --set run.steps=60")
def resume(
    run_dir: Path = typer.Argument(..., help="Run directory to continue."),
    set_: list[str] = SetOpt,
    force: bool = ForceOpt,
) -> None:
    """Continue a run from its newest complete checkpoint (newer broken ones are skipped, with the reason).
    --set may change only keys that do not change what the run computes (run.steps, run.save_every, run.keep,
    run.eval_*, run.loggers, run.health, cluster.address, reward.timeout_s/workers/error_budget); any other
    change is refused with exit 2. Exit 0 done, 1 failure, 2 invalid or unsafe recipe, 130/143 stopped by
    Ctrl-C/SIGTERM after saving."""
    with user_errors():
        from rlbridge.run.resume import UnsafeResumeError, prepare_resume

        try:
            prep = prepare_resume(
                run_dir, set_, log=lambda msg: render.out.print(f"[dim]resume[/] {msg}"), force=force
            )
        except UnsafeResumeError as e:
            n = len(e.issues)
            render.issues_table(
                e.issues,
                f"cannot resume {run_dir}: {n} recipe change{'s' if n != 1 else ''} since "
                "the checkpoint would change what the run computes",
            )
            raise typer.Exit(2) from None
    point, steps = prep.point, prep.valid.recipe.run.steps
    render.out.print(f"resuming {run_dir} from {point.path} (step {point.step} of {steps})")
    if point.step >= steps and not _final_eval_missing(run_dir, prep.valid.recipe):
        render.out.print(
            f"nothing to do: the checkpoint is at step {point.step} and run.steps is {steps} "
            f"(continue further with --set run.steps=N)"
        )
        return
    if point.step >= steps:  # killed after the last save, before the final evaluation was written
        render.out.print(f"the final evaluation of step {steps} is missing: running it")
    run(prep.valid, run_dir, resume=point)


def _final_eval_missing(run_dir: Path, recipe: Recipe) -> bool:
    """A run with data.val whose metrics.jsonl has no evaluation of its last step: the final evaluation comes
    after the last checkpoint, so a run killed in it (or before it wrote its record) has all its steps saved but
    not that evaluation (found by the crash-anywhere soak)."""
    import json

    if recipe.data.val is None:
        return False
    path = run_dir / "metrics.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if (
            isinstance(record, dict)
            and record.get("kind") == "eval"
            and record.get("step") == recipe.run.steps
        ):
            return False
    return True


def run(valid: ValidRecipe, run_dir: Path | None, *, resume: ResumePoint | None = None) -> None:
    """plan -> model -> run directory -> the loop, for `train` (a new run directory: `run_dir`, run.dir or
    runs/<name>-<time>) and `resume` (`run_dir` itself, continued from `resume`'s checkpoint)."""
    from rlbridge.plan import make_plan
    from rlbridge.run import directory as rd

    plan = make_plan(valid.recipe, valid.model)
    render.plan_summary(plan)
    with user_errors(), stop_on_signal():
        from rlbridge.errors import RlbridgeError
        from rlbridge.run.gpu_faults import device_size_problem

        size = device_size_problem(valid.recipe, plan)
        if size is not None and size[1]:
            raise RlbridgeError(size[0])
        if size is not None:
            render.err.print(f"[yellow]warning[/] {size[0]}", soft_wrap=True)
        from rlbridge.loop import train as run_training
        from rlbridge.model.cache import ensure_model

        model_dir = ensure_model(valid.recipe.model.path, valid.recipe.model.revision)
        if resume is None:
            out = rd.create(rd.choose_run_dir(valid.recipe, run_dir), valid.recipe, plan.to_dict())
            render.out.print(f"run directory: {out}")
        else:
            assert run_dir is not None, "resume continues the run directory it was given"
            out = run_dir
        with resume_hint(out):
            summary = run_training(valid.recipe, plan, out, model_dir, resume=resume)
    render.print_summary(summary)


@contextmanager
def resume_hint(run_dir: Path) -> Iterator[None]:
    """A run that fails (a worker died, a health gate, ...) after a checkpoint: its error says where and how it
    resumes. The checkpoint is the newest one complete on disk (manifest and sizes; resume checks the hashes)."""
    from rlbridge.errors import RecipeError, RlbridgeError

    try:
        yield
    except RlbridgeError as e:
        if isinstance(e, RecipeError) or "rlbridge resume" in str(e):  # e.g. a failed save says it already
            raise
        from rlbridge.run import checkpoint as ckpt
        from rlbridge.run.resume import resume_command

        last = next((i for i in reversed(ckpt.list_checkpoints(run_dir, hashes=False)) if i.complete), None)
        if last is None:
            raise
        raise RlbridgeError(
            f"{e}\nthe run stops; resume from {last.path} (step {last.step}) with: {resume_command(run_dir)}"
        ) from None


@contextmanager
def stop_on_signal() -> Iterator[None]:
    """A run stopped by SIGTERM / Ctrl-C after saving: its message (with the resume command), and exit 143 /
    130. A second Ctrl-C (no save) reaches the command's KeyboardInterrupt handler: exit 130."""
    from rlbridge.run.signals import Interrupted

    try:
        yield
    except Interrupted as e:
        render.err.print(f"[yellow]{e.message}[/]", soft_wrap=True)
        raise typer.Exit(e.exit_code) from None
