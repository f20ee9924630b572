"""Saving a run and continuing it: the driver's side of checkpoints (the format is rlbridge/run/checkpoint.py).

A checkpoint of step k holds everything step k+1 depends on, so `rlbridge resume` computes what the
uninterrupted run would have:

    trainer   trainable tensors (adapters only under LoRA), AdamW moments, schedule position, the trainer
              process's RNG, the health-gate state            (written by TrainerRole in its own process)
    driver    data position (epoch, index, shuffle seed, data fingerprint), the driver's RNG, the weight
              version, the non-finite streak, the step-0 evaluation       (state.json, from here)
    recipe    the resolved recipe (a resume compares the new recipe against it)

Rollouts draw from the sampler RNG re-seeded from (run.seed, step) before every generation
(`rollout_seed`), so a fresh vLLM engine after a resume samples what the long-lived one would have.

Saves happen after step k's metrics (and its evaluation, if due) are written, so on resume the records of
metrics.jsonl past the checkpoint's step are exactly the ones to drop (`truncate_metrics`).

The step loop (loop.py) saves and restores through the driver's `Checkpointer` (rlbridge/checkpointer.py),
which writes the `RunState` of this module; this module finds the checkpoint to resume from and checks that
the new recipe may continue it.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlbridge.errors import RecipeError, RecipeIssue, RlbridgeError
from rlbridge.run import checkpoint as ckpt
from rlbridge.run import resume_policy as policy
from rlbridge.run.directory import resolved_yaml

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from rlbridge.recipe import ValidRecipe

STATE_FORMAT = 1
"""Version of the driver's part of state.json."""
METRICS = "metrics.jsonl"


@dataclass
class RunState:
    """The driver's part of a checkpoint (state.json beside the trainer's part): what `Checkpointer.save` writes and
    `Checkpointer.restore` reads back."""

    step: int | None
    weight_version: int
    data: dict[str, Any]
    """The prompt sampler's position (data/datasets.PromptSampler.state)."""
    rng: dict[str, Any]
    """The driver's RNG states (run/rng.py)."""
    inflight: list[dict[str, Any]] = field(default_factory=list)
    """rollout.mode async: the rollouts of the steps after this one, generated already (pipeline.RolloutSource)."""
    nonfinite_streak: int = 0
    eval_before: dict[str, float] = field(default_factory=dict)
    """The step-0 evaluation (the run's summary compares against it)."""
    kl_control: dict[str, Any] | None = None
    """PPO's adaptive KL controller (algorithm.adaptive_kl_target)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "step": self.step,
            "weight_version": self.weight_version,
            "data": self.data,
            "inflight": self.inflight,
            "rng": self.rng,
            "nonfinite_streak": self.nonfinite_streak,
            "eval_before": self.eval_before,
            "rollout_seed": "sha256(run.seed, step)",
            "kl_control": self.kl_control,
        }

    @classmethod
    def from_json(cls, state: dict[str, Any], where: Path) -> RunState:
        if state.get("format") != STATE_FORMAT:
            raise RlbridgeError(f"{where}: unknown run state format {state.get('format')!r}")
        return cls(
            step=state.get("step"),
            weight_version=int(state["weight_version"]),
            data=state["data"],
            rng=state["rng"],
            inflight=list(state.get("inflight") or []),
            nonfinite_streak=int(state.get("nonfinite_streak", 0)),
            eval_before=dict(state.get("eval_before") or {}),
            kl_control=state.get("kl_control") or None,
        )


def rollout_seed(seed: int, step: int, purpose: str = "train") -> int:
    """The sampler seed of one generation: a function of (run.seed, step, purpose) only (31 bits: numpy and
    every engine accept it)."""
    digest = hashlib.sha256(f"rlbridge-rollout/{seed}/{step}/{purpose}".encode()).digest()
    return int.from_bytes(digest[:4], "little") >> 1


def resume_command(run_dir: Path) -> str:
    return f"rlbridge resume {run_dir}"


# --------------------------------------------------------------------------------------- resuming
class UnsafeResumeError(RecipeError):
    """The recipe changed since the checkpoint in keys that change what the run computes (exit 2)."""


@dataclass(frozen=True)
class ResumePoint:
    path: Path
    step: int
    recipe_yaml: str
    """The resolved recipe the checkpoint was trained with."""
    manifest: dict[str, Any]


@dataclass(frozen=True)
class ResumePlan:
    valid: ValidRecipe
    point: ResumePoint
    changed: list[tuple[str, Any, Any]]
    """Keys that differ from the checkpoint's recipe (all of them resume-safe)."""
    dropped_records: int


def find_checkpoint(
    source: Path, *, step: int | None = None, log: Callable[[str], None] = print
) -> ResumePoint:
    """The checkpoint of `source`: a checkpoint directory itself, or a run directory's newest complete one
    (each newer broken one reported through `log` with its reason), or its step `step`."""
    source = Path(source)
    if (source / ckpt.MANIFEST).is_file() or (
        source.name.startswith("step_") and source.parent.name == ckpt.CHECKPOINTS
    ):
        if step is not None and not source.name.endswith(f"{step:06d}"):
            raise RlbridgeError(
                f"{source} is a checkpoint directory; --step {step} applies to a run directory"
            )
        info = ckpt.CheckpointInfo(0, source, ckpt.verify_checkpoint(source))
    elif step is not None:
        path = source / ckpt.CHECKPOINTS / ckpt.step_dir_name(step)
        info = ckpt.CheckpointInfo(step, path, ckpt.verify_checkpoint(path))
        if not path.exists():
            have = [i.step for i in ckpt.list_checkpoints(source, hashes=False)]
            raise RlbridgeError(
                f"no checkpoint of step {step} in {source / ckpt.CHECKPOINTS} (steps there: {have or 'none'})"
            )
    else:
        found = ckpt.latest_complete(source, log=log)
        if found is None:
            if not (source / ckpt.CHECKPOINTS).is_dir() and not (source / "recipe.yaml").is_file():
                raise RlbridgeError(f"{source} is neither a run directory nor a checkpoint")
            raise RlbridgeError(
                f"no complete checkpoint in {source / ckpt.CHECKPOINTS}: nothing to resume or export "
                "(a run writes one every run.save_every steps, at the end, and on SIGTERM / Ctrl-C)"
            )
        info = found
    if info.problem:
        raise RlbridgeError(f"checkpoint {info.path} is not complete: {info.problem}")
    manifest = json.loads((info.path / ckpt.MANIFEST).read_text(encoding="utf-8"))
    return ResumePoint(
        info.path, int(manifest["step"]), (info.path / ckpt.RECIPE).read_text(encoding="utf-8"), manifest
    )


def prepare_resume(
    run_dir: Path, overrides: Sequence[str] = (), *, log: Callable[[str], None] = print, force: bool = False
) -> ResumePlan:
    """Everything `rlbridge resume` decides before starting anything: the checkpoint, the recipe (the run
    directory's recipe.yaml + overrides, validated), its compatibility with the checkpoint's recipe
    (RecipeError naming every key that may not change), and metrics.jsonl cut back to the checkpoint's
    step. The run directory's recipe.yaml is updated when resume-safe keys changed (the old one is kept
    under logs/)."""
    from rlbridge.recipe import validate_recipe

    run_dir = Path(run_dir)
    recipe_file = run_dir / "recipe.yaml"
    if not recipe_file.is_file():
        raise RlbridgeError(
            f"{run_dir} is not a run directory (no recipe.yaml); `rlbridge train` creates one"
        )
    point = find_checkpoint(run_dir, log=log)
    for leftover in sorted((run_dir / ckpt.CHECKPOINTS).glob(".tmp-step_*")):
        log(f"ignoring {leftover.name}: a save that never finished (the next save removes it)")
    valid = validate_recipe(recipe_file, list(overrides), force=force)
    new_yaml = resolved_yaml(valid.recipe)
    diff = policy.recipe_diff(point.recipe_yaml, new_yaml)
    layout_free = _layout_free(point)
    refused = policy.check_resume_compatible(point.recipe_yaml, new_yaml, layout_free=layout_free)
    if refused:
        set_keys = {o.split("=", 1)[0].strip() for o in overrides}
        unsafe = [(k, o, n) for k, o, n in diff if not policy.is_resume_safe(k, layout_free=layout_free)]
        raise UnsafeResumeError(
            [
                RecipeIssue(key=k, message=m, where="--set" if k in set_keys else str(recipe_file))
                for (k, _, _), m in zip(unsafe, refused, strict=True)
            ]
        )
    for key, old, new in diff:
        log(f"changed on resume: {key} {json.dumps(old, default=str)} -> {json.dumps(new, default=str)}")
    if any(k == "run.steps" for k, _, _ in diff) and valid.recipe.trainer.optim.schedule != "constant":
        log(
            f"note: trainer.optim.schedule={valid.recipe.trainer.optim.schedule} decays over run.steps: the rest "
            "of the schedule is stretched to the new run.steps"
        )
    _warn_versions(point, log)
    if diff:
        _replace_recipe(run_dir, new_yaml)
    dropped = truncate_metrics(run_dir, point.step)
    if dropped:
        log(f"{METRICS}: dropped {dropped} record(s) written after step {point.step} (they are recomputed)")
    return ResumePlan(valid, point, diff, dropped)


def _layout_free(point: ResumePoint) -> bool:
    """Whether the checkpoint's trainer state is layout-free (loads at another parallel layout)."""
    try:
        state = json.loads((point.path / ckpt.STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    trainer = state.get("trainer") if isinstance(state, dict) else None
    return isinstance(trainer, dict) and trainer.get("layout_free") is True


def _warn_versions(point: ResumePoint, log: Callable[[str], None]) -> None:
    saved = point.manifest.get("versions") or {}
    now = ckpt.library_versions()
    changed = [
        f"{k} {saved[k]} -> {now.get(k, '(absent)')}"
        for k in sorted(saved)
        if saved[k] != now.get(k)
        and k not in ("rlbridge", "rlbridge-cli")  # this project (earlier name, now)
    ]
    if changed:
        log(
            f"note: library versions changed since the checkpoint ({', '.join(changed)}): the resumed run may not "
            "repeat the uninterrupted one bit for bit"
        )


def _replace_recipe(run_dir: Path, new_yaml: str) -> None:
    logs = run_dir / "logs"
    logs.mkdir(exist_ok=True)
    old = run_dir / "recipe.yaml"
    (logs / f"recipe.before-resume-{time.strftime('%Y%m%d-%H%M%S')}.yaml").write_text(
        old.read_text(encoding="utf-8"), encoding="utf-8"
    )
    tmp = run_dir / ".recipe.yaml.tmp"
    tmp.write_text(new_yaml, encoding="utf-8")
    tmp.replace(old)


def truncate_metrics(run_dir: Path, step: int) -> int:
    """Keep the records of metrics.jsonl up to `step` (a torn last line goes too); returns how many went."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        return 0
    kept: list[str] = []
    dropped = 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
            keep = isinstance(record, dict) and int(record.get("step", 0)) <= step
        except (ValueError, TypeError):
            keep = False
        if keep:
            kept.append(line)
        elif line.strip():
            dropped += 1
    if dropped:
        tmp = path.with_name(f".{METRICS}.tmp")
        tmp.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
        tmp.replace(path)
    return dropped
