"""The driver's typed handle on the trainer: what the loop and the Checkpointer ask of it, as methods.

`Trainer` is the interface (the policy: log-probs, update, weight export; PPO's critic: values; checkpoints).
The loop and checkpointer.Checkpointer call its methods, so the type checker follows every call into
TrainerRole. Two implementations:

    RayTrainer     the trainer in Ray actors: one worker (hf), or every rank of a multi-rank trainer behind
                   trainer/group.TrainerGroup (megatron). It hands TrainerRole's methods to Ray by reference
                   (`TrainerRole.update`, not "update"), picks how a multi-rank answer is combined (rows gathered
                   in data-parallel order, metrics averaged, or rank 0's), and, through
                   cluster/ray_cluster.Worker, turns worker failures into RlbridgeError.
    LocalTrainer   a TrainerRole in this process (tests, single-process tools).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

import torch

from rlbridge.batch import SeqBatch
from rlbridge.cluster.ray_cluster import Worker
from rlbridge.trainer.group import TrainerGroup
from rlbridge.trainer.role import TrainerRole
from rlbridge.trainer.state import SavedCheckpoint
from rlbridge.weights import WeightSync

P = ParamSpec("P")
R = TypeVar("R")


class Trainer(ABC):
    """The trainer as the driver sees it. A client says how a call reaches TrainerRole (`_call`, and how a
    multi-rank answer combines: `_rows`, `_metrics`, `_submit`); the calls themselves are the same for all."""

    @abstractmethod
    def _call(self, method: Callable[Concatenate[TrainerRole, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        """`method` (TrainerRole's, by reference) on the trainer (every rank of a group: rank 0's answer)."""

    def _rows(
        self, method: Callable[Concatenate[TrainerRole, P], torch.Tensor], *args: P.args, **kwargs: P.kwargs
    ) -> torch.Tensor:
        """`method` returning per-row tensors (a group's ranks each compute their replica's share)."""
        return self._call(method, *args, **kwargs)

    def _metrics(
        self,
        method: Callable[Concatenate[TrainerRole, P], dict[str, float]],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> dict[str, float]:
        """`method` returning metrics (a group's replicas each trained on their share: their mean)."""
        return self._call(method, *args, **kwargs)

    def _submit(
        self, method: Callable[Concatenate[TrainerRole, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> Any:
        """`method`'s answer as something another worker can take (over Ray: a reference, not fetched)."""
        return self._call(method, *args, **kwargs)

    @abstractmethod
    def kill(self) -> None: ...

    # ---------------------------------------------------------------- the policy
    def logprobs(self, batch: SeqBatch, reference: bool = False) -> torch.Tensor:
        """[b, R] log-probs of the response tokens (reference=True: the reference policy)."""
        return self._rows(TrainerRole.logprobs, batch, reference)

    def update(
        self,
        batch: SeqBatch,
        adv_bt: torch.Tensor,
        rollout_logp_bt: torch.Tensor,
        ref_logp_bt: torch.Tensor | None,
        old_values_bt: torch.Tensor | None = None,
        returns_bt: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """The step's policy (and, for PPO, critic) updates; their metrics."""
        args = (batch, adv_bt, rollout_logp_bt, ref_logp_bt, old_values_bt, returns_bt)
        return self._metrics(TrainerRole.update, *args)

    def export_weights(self, kind: WeightSync, *, as_files: bool = False, cuda_ipc: bool = False) -> Any:
        """The weights for the rollout, as something the rollout's load_weights accepts (over Ray: a reference
        that goes from the trainer to the rollout without passing through the driver). cuda_ipc: CUDA IPC handles
        of merged tensors the trainer keeps on its GPU until `release_export`."""
        return self._submit(TrainerRole.export_weights, kind, as_files=as_files, cuda_ipc=cuda_ipc)

    def release_export(self) -> None:
        """Drop what a cuda_ipc export keeps alive (after the rollout loaded it, or when the sync failed)."""
        self._call(TrainerRole.release_export)

    def last_export_bytes(self) -> int:
        return int(self._call(TrainerRole.last_export_bytes))

    @abstractmethod
    def raise_if_lost(self, export: Any) -> None:
        """Raises the trainer's own error (which worker, on which node) when the worker that was to produce
        `export` is gone; returns when it is not."""

    # ---------------------------------------------------------------- PPO's critic
    def values(self, batch: SeqBatch) -> torch.Tensor:
        """[b, R] the critic's values before the update."""
        return self._rows(TrainerRole.values, batch)

    # ---------------------------------------------------------------- checkpoints
    def checkpoint_support(self) -> str | None:
        """None when the trainer can save and restore checkpoints, else why not."""
        return self._call(TrainerRole.checkpoint_support)

    def save_checkpoint(
        self, run_dir: str, step: int, state: dict[str, Any], recipe_yaml: str, keep: int
    ) -> SavedCheckpoint:
        return self._call(TrainerRole.save_checkpoint, run_dir, step, state, recipe_yaml, keep)

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Restores the trainer's part of checkpoint `path`; returns its state.json (run/resume.RunState reads the
        driver's part)."""
        return self._call(TrainerRole.load_checkpoint, path)


class RayTrainer(Trainer):
    """The trainer over Ray. See the module docstring."""

    def __init__(self, workers: Worker | TrainerGroup) -> None:
        self.workers = workers

    def _call(self, method: Callable[Concatenate[TrainerRole, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        return cast(R, self.workers.call(method.__name__, *args, **_kw(kwargs)))

    def _rows(
        self, method: Callable[Concatenate[TrainerRole, P], torch.Tensor], *args: P.args, **kwargs: P.kwargs
    ) -> torch.Tensor:
        if isinstance(self.workers, TrainerGroup):
            return self.workers.call_rows(method.__name__, *args, **kwargs)
        return self._call(method, *args, **kwargs)

    def _metrics(
        self,
        method: Callable[Concatenate[TrainerRole, P], dict[str, float]],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> dict[str, float]:
        if isinstance(self.workers, TrainerGroup):  # each replica trained on its share: the replicas' mean
            return self.workers.call_metrics(method.__name__, *args, **kwargs)
        return self._call(method, *args, **kwargs)

    def _submit(
        self, method: Callable[Concatenate[TrainerRole, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> Any:
        return self.workers.submit(method.__name__, *args, **kwargs)

    def raise_if_lost(self, export: Any) -> None:
        self.workers.wait(export)

    def kill(self) -> None:
        self.workers.kill()


def _kw(kwargs: Any) -> dict[str, Any]:
    """A method's keyword arguments as Worker.call forwards them (none of TrainerRole's is named timeout)."""
    return dict(kwargs)


class LocalTrainer(Trainer):
    """The trainer in this process: the TrainerRole's own methods (the weight export is the object itself)."""

    def __init__(self, role: TrainerRole) -> None:
        self.role = role

    def _call(self, method: Callable[Concatenate[TrainerRole, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        return method(self.role, *args, **kwargs)

    def raise_if_lost(self, export: Any) -> None:
        pass  # in this process: nothing to lose

    def kill(self) -> None:
        pass
