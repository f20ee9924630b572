"""Layouts whose checkpoints cannot be written: refused at validation, never switched off during the run.

Every run writes checkpoints: every `run.save_every` steps, at the end (also with `save_every: 0`) and on
SIGTERM / Ctrl-C, and `rlbridge export-hf` reads its model from one. A run that could not save would lose
everything to a preemption and leave nothing to export, so a layout the trainer cannot save is a recipe error
here, with the key and the fix; what an engine can save is its spec's to say (engines/spec.py). The megatron
engine (engines/megatron/state.py) calls `unsaved_layouts` again when it starts, so a recipe that skipped
validation fails there with the same words.
"""

from __future__ import annotations

from rlbridge.engines.registry import trainer_engine
from rlbridge.errors import RecipeIssue
from rlbridge.recipe.checks.common import Issues
from rlbridge.recipe.schema import Recipe


def unsaved_layouts(r: Recipe) -> list[RecipeIssue]:
    """Why this recipe's trainer cannot write a checkpoint, as issues on the keys to change; [] if it can."""
    out: Issues = []
    spec = trainer_engine(r)
    if r.trainer.distributed_optimizer and not spec.distributed_optimizer_checkpoints:
        out.append(
            RecipeIssue(
                "trainer.distributed_optimizer",
                f"trainer.engine {spec.name} cannot checkpoint a distributed optimizer (megatron's keeps its fp32 "
                "main parameters and Adam moments in flat buffers sharded over the data-parallel ranks, and the "
                "engine does not build with it yet: its check that the optimizer holds exactly the trainable "
                "tensors does not know the optimizer's shard copies); every run writes checkpoints (every "
                f"run.save_every={r.run.save_every} steps, at the end, on SIGTERM) and this one could not: a "
                "preemption would lose it all",
                value="true",
                fix="set trainer.distributed_optimizer: false (under LoRA the optimizer state is the adapters' "
                "and small)",
            )
        )
    return out


def check_checkpoints(r: Recipe, out: Issues) -> None:
    out.extend(unsaved_layouts(r))
