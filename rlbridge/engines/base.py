"""The trainer protocol every engine implements (hf, megatron), driven by loop.py.

The loop never sees a model: it hands the engine a SeqBatch and a loss closure, and gets numbers back.
Log-prob tensors are [b, R], aligned with SeqBatch.response_mask (see rlbridge/batch.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from rlbridge.batch import LossFn, SeqBatch, ValueLossFn
from rlbridge.errors import RlbridgeError
from rlbridge.weights import WeightExport, WeightSync


class TrainEngine(Protocol):
    def logprobs(self, batch: SeqBatch, *, reference: bool = False) -> torch.Tensor:
        """[b, R] float32 log-probs of the response tokens, no gradients. reference=True: the reference
        policy (adapters disabled under LoRA)."""
        ...

    def train_step(self, batch: SeqBatch, loss_fn: LossFn, *, num_micro_batches: int) -> dict[str, float]:
        """One optimizer step over `batch` in micro-batches (gradient accumulation), clipping and LR
        schedule included. Returns metrics: loss terms averaged, grad_norm, lr, and `skipped` (1.0 when a
        non-finite loss/gradient made it skip the update; `nonfinite` then names the tensors)."""
        ...

    def export_weights(self, kind: WeightSync) -> WeightExport:
        """'merged' or 'adapter' weights for the rollout engine or export."""
        ...

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Trainable tensors only (adapters under LoRA), for checkpoints and health gates."""
        ...

    def frozen_fingerprint(self) -> dict[str, float]:
        """A cheap fingerprint (e.g. sum of |w|) of every frozen tensor, to prove the base stays frozen."""
        ...


@runtime_checkable
class CheckpointableEngine(TrainEngine, Protocol):
    """A TrainEngine whose trainable tensors and optimizer state go into checkpoints and come back."""

    def load_trainable_state(self, tensors: dict[str, torch.Tensor]) -> None: ...

    def optimizer_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Optimizer (and schedule) state as named tensors plus JSON metadata."""
        ...

    def load_optimizer_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None: ...


@runtime_checkable
class PortableCheckpointEngine(Protocol):
    """An engine (or critic) of a multi-rank trainer whose checkpoint state is layout-free: full tensors under
    canonical names, so a checkpoint loads at another parallel layout (engines/megatron/state.py)."""

    def checkpoint_state(self) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
        """Collective over every rank: ({"trainable": ..., "optimizer": ...}, JSON metadata); the tensors on
        global rank 0 only ({} elsewhere), the metadata on every rank."""
        ...

    def load_checkpoint_state(self, groups: dict[str, dict[str, torch.Tensor]], meta: dict[str, Any]) -> None:
        """Every rank: restore its shards from the full tensors `checkpoint_state` returned."""
        ...


@runtime_checkable
class ExpertEngine(Protocol):
    """An engine of a mixture-of-experts model that reports per-expert training (engines/moe.py); the first-step
    gate then checks each expert, not only each tensor. `moe` is None for a dense model."""

    @property
    def moe(self) -> MoeBook | None: ...


class MoeBook(Protocol):
    def routed_tokens(self) -> dict[tuple[int, int], int]:
        """Collective: tokens routed to each (layer, expert) in the training forwards since the last call."""
        ...

    def expert_views(self, state: dict[str, torch.Tensor]) -> dict[tuple[int, int], list[torch.Tensor]]:
        """The parts of the trainable tensors in `state` (trainable_state's names) that belong to each expert."""
        ...


@runtime_checkable
class RankedEngine(TrainEngine, Protocol):
    """A TrainEngine of one rank of a multi-rank trainer (megatron), which says where in the layout it sits."""

    def coordinates(self) -> dict[str, int]:
        """{rank, dp, tp, pp, cp} of this rank."""
        ...


@runtime_checkable
class DataParallelEngine(Protocol):
    """An engine of one data-parallel replica among several: TrainerRole hands it its share of the rows."""

    @property
    def data_parallel(self) -> tuple[int, int]:
        """(rank, size) of this rank's data-parallel replica."""
        ...


@runtime_checkable
class LimitedCheckpointEngine(Protocol):
    """An engine that can checkpoint some layouts only."""

    def checkpoint_problem(self) -> str | None:
        """Why this layout cannot checkpoint yet, or None."""
        ...


@runtime_checkable
class RecordingEngine(Protocol):
    """A TrainEngine that records its training passes as CUDA graphs (trainer.cuda_graphs: engines/hf/graphs.py)."""

    def prerecord(self, prompt_lengths: list[int], passes: list[tuple[int, int]]) -> int:
        """Record the pass shapes these prompt lengths make likely for `passes` (rows, micro-batches) before the
        first step; returns how many were recorded."""
        ...


class Critic(Protocol):
    """PPO's value model next to the policy engine (engines/hf/critic.py, engines/megatron/critic.py)."""

    def values(self, batch: SeqBatch) -> torch.Tensor:
        """[b, R] values V(s_t) of the response tokens, no gradients."""
        ...

    def train_step(
        self, batch: SeqBatch, loss_fn: ValueLossFn, *, num_micro_batches: int
    ) -> dict[str, Any]: ...

    def trainable_state(self) -> dict[str, torch.Tensor]: ...

    def load_trainable_state(self, tensors: dict[str, torch.Tensor]) -> None: ...

    def optimizer_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]: ...

    def load_optimizer_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None: ...


def take_gradients(
    params: Iterable[tuple[str, torch.Tensor]], optimizer: torch.optim.Optimizer
) -> dict[str, torch.Tensor]:
    """Copies of the accumulated .grad of the named parameters (zeros where none), which are then cleared: what
    an engine's or a critic's `gradients` returns instead of stepping."""
    grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in params}
    optimizer.zero_grad(set_to_none=True)
    return grads


def load_named(
    params: Iterable[tuple[str, torch.Tensor]], tensors: Mapping[str, torch.Tensor], what: str
) -> None:
    """Copy `tensors` into the named parameters in place (checkpoint restore of an engine's or a critic's
    trainable state); the names must match exactly, else an error naming `what` and the first mismatches."""
    params = list(params)
    names = {n for n, _ in params}
    missing, extra = sorted(names - tensors.keys()), sorted(tensors.keys() - names)
    if missing or extra:
        raise RlbridgeError(f"{what} state does not match: missing {missing[:3]}, unexpected {extra[:3]}")
    with torch.no_grad():
        for n, p in params:
            p.copy_(tensors[n])
