"""How a step's batch splits: prompts and rollouts per step, mini-batches (optimizer steps), and each
data-parallel rank's sequences and micro-batches (gradient-accumulation steps). The trainer and the loop count
their passes with these functions rather than re-deriving them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlbridge.recipe.schema import Recipe


@dataclass(frozen=True)
class Batches:
    prompts_per_step: int
    rollouts_per_step: int
    mini_batches_per_step: int
    optimizer_steps_per_step: int
    sequences_per_dp_rank: int
    """Sequences each data-parallel rank trains on per mini-batch."""
    micro_batches_per_mini_batch: int
    """Gradient-accumulation steps per optimizer step on each data-parallel rank by micro_batch_size rows; under a
    token budget the count depends on the lengths and this is only its bound for full-length rows."""
    max_sequence_tokens: int
    tokens_per_micro_batch: int | None = None
    """trainer.max_tokens_per_micro_batch: passes are packed by tokens, not by micro_batch_size rows."""


def num_mini_batches(r: Recipe, num_rows: int) -> int:
    """Mini-batches (optimizer steps per PPO epoch) of a step's `num_rows` sequences: as many of
    mini_batch_size x rollout.n as fit, to the nearest whole number, at least one and at most one per row (a
    DAPO step can come up short of batch_size x n). A full step: batch_size / mini_batch_size."""
    return max(1, min(num_rows, round(num_rows / (r.mini_batch_size * r.rollout.n))))


def num_micro_batches(r: Recipe, num_rows: int) -> int:
    """Micro-batches (gradient-accumulation steps) of one rank's `num_rows` sequences of a mini-batch; the last
    one may be short."""
    return math.ceil(num_rows / r.trainer.micro_batch_size)


def total_optimizer_steps(r: Recipe) -> int:
    """Optimizer steps of a whole run (the LR schedule's length): steps x mini-batches per step x PPO epochs."""
    return r.run.steps * batches(r, 1).optimizer_steps_per_step


def batches(r: Recipe, dp: int) -> Batches:
    mini = r.mini_batch_size
    per_rank = mini * r.rollout.n // dp
    num_minis = num_mini_batches(r, r.rollouts_per_step)
    return Batches(
        prompts_per_step=r.data.batch_size,
        rollouts_per_step=r.rollouts_per_step,
        mini_batches_per_step=num_minis,
        optimizer_steps_per_step=num_minis * r.trainer.ppo_epochs,
        sequences_per_dp_rank=per_rank,
        micro_batches_per_mini_batch=max(num_micro_batches(r, per_rank), 1),
        max_sequence_tokens=r.rollout.max_prompt_tokens + r.rollout.max_response_tokens,
        tokens_per_micro_batch=r.trainer.max_tokens_per_micro_batch,
    )
