"""The driver's typed handle on the trainer: what the loop and the Checkpointer ask of it, as methods.

`Trainer` is the protocol (the policy: log-probs, update, weight export; PPO's critic: values; checkpoints).
The loop and resume.Checkpointer call its methods, so the type checker follows every call into
TrainerRole. Two implementations:

    RayTrainer     the trainer in Ray actors: one worker (hf), or every rank of a multi-rank trainer behind
                   trainer/group.TrainerGroup (megatron). The one place that names TrainerRole's methods for
                   Ray, by reference (`TrainerRole.update`, not "update"), picks how a multi-rank answer is
                   combined (rows gathered in data-parallel order, metrics averaged, or rank 0's), and, through
                   cluster/ray_cluster.Worker, turns worker failures into RlbridgeError.
    LocalTrainer   a TrainerRole in this process (tests, single-process tools).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar, cast

import torch

from rlbridge.batch import SeqBatch
from rlbridge.cluster.ray_cluster import Worker
from rlbridge.engines.base import WeightExport
from rlbridge.trainer.group import TrainerGroup
from rlbridge.trainer.role import SavedCheckpoint, TrainerRole
from rlbridge.weights import WeightSync

P = ParamSpec("P")
R = TypeVar("R")


class Trainer(Protocol):
    # ---------------------------------------------------------------- the policy
    def logprobs(self, batch: SeqBatch, reference: bool = False) -> torch.Tensor:
        """[b, R] log-probs of the response tokens (reference=True: the reference policy)."""
        ...

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
        ...

    def export_weights(self, kind: WeightSync, *, as_files: bool = False, cuda_ipc: bool = False) -> Any:
        """The weights for the rollout, as something the rollout's load_weights accepts (over Ray: a reference
        that goes from the trainer to the rollout without passing through the driver). cuda_ipc: CUDA IPC handles
        of merged tensors the trainer keeps on its GPU until `release_export`."""
        ...

    def release_export(self) -> None:
        """Drop what a cuda_ipc export keeps alive (after the rollout loaded it, or when the sync failed)."""
        ...

    def last_export_bytes(self) -> int: ...

    def raise_if_lost(self, export: Any) -> None:
        """Raises the trainer's own error (which worker, on which node) when the worker that was to produce
        `export` is gone; returns when it is not."""
        ...

    # ---------------------------------------------------------------- PPO's critic
    def values(self, batch: SeqBatch) -> torch.Tensor:
        """[b, R] the critic's values before the update."""
        ...

    # ---------------------------------------------------------------- checkpoints
    def checkpoint_support(self) -> str | None:
        """None when the trainer can save and restore checkpoints, else why not."""
        ...

    def save_checkpoint(
        self, run_dir: str, step: int, state: dict[str, Any], recipe_yaml: str, keep: int
    ) -> SavedCheckpoint: ...

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Restores the trainer's part of checkpoint `path`; returns its state.json (run/resume.RunState reads the
        driver's part)."""
        ...

    def kill(self) -> None: ...


class RayTrainer:
    """`Trainer` over Ray. See the module docstring."""

    def __init__(self, workers: Worker | TrainerGroup) -> None:
        self.workers = workers

    def _call(self, method: Callable[Concatenate[TrainerRole, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        """`method` on the trainer (every rank of a group: rank 0's answer)."""
        return cast(R, self.workers.call(method.__name__, *args, **_kw(kwargs)))

    def _rows(
        self, method: Callable[Concatenate[TrainerRole, P], torch.Tensor], *args: P.args, **kwargs: P.kwargs
    ) -> torch.Tensor:
        """`method` returning per-row tensors; a group's ranks each compute their replica's share."""
        if isinstance(self.workers, TrainerGroup):
            return self.workers.call_rows(method.__name__, *args, **kwargs)
        return cast(torch.Tensor, self.workers.call(method.__name__, *args, **_kw(kwargs)))

    def logprobs(self, batch: SeqBatch, reference: bool = False) -> torch.Tensor:
        return self._rows(TrainerRole.logprobs, batch, reference)

    def values(self, batch: SeqBatch) -> torch.Tensor:
        return self._rows(TrainerRole.values, batch)

    def update(
        self,
        batch: SeqBatch,
        adv_bt: torch.Tensor,
        rollout_logp_bt: torch.Tensor,
        ref_logp_bt: torch.Tensor | None,
        old_values_bt: torch.Tensor | None = None,
        returns_bt: torch.Tensor | None = None,
    ) -> dict[str, float]:
        args = (batch, adv_bt, rollout_logp_bt, ref_logp_bt, old_values_bt, returns_bt)
        if isinstance(self.workers, TrainerGroup):  # each replica trained on its share: the replicas' mean
            return self.workers.call_metrics(TrainerRole.update.__name__, *args)
        return self._call(TrainerRole.update, *args)

    def export_weights(self, kind: WeightSync, *, as_files: bool = False, cuda_ipc: bool = False) -> Any:
        return self.workers.submit(
            TrainerRole.export_weights.__name__, kind, as_files=as_files, cuda_ipc=cuda_ipc
        )

    def release_export(self) -> None:
        self._call(TrainerRole.release_export)

    def last_export_bytes(self) -> int:
        return int(self._call(TrainerRole.last_export_bytes))

    def raise_if_lost(self, export: Any) -> None:
        self.workers.wait(export)

    def checkpoint_support(self) -> str | None:
        return self._call(TrainerRole.checkpoint_support)

    def save_checkpoint(
        self, run_dir: str, step: int, state: dict[str, Any], recipe_yaml: str, keep: int
    ) -> SavedCheckpoint:
        return self._call(TrainerRole.save_checkpoint, run_dir, step, state, recipe_yaml, keep)

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        return self._call(TrainerRole.load_checkpoint, path)

    def kill(self) -> None:
        self.workers.kill()


def _kw(kwargs: Any) -> dict[str, Any]:
    """A method's keyword arguments as Worker.call forwards them (none of TrainerRole's is named timeout)."""
    return dict(kwargs)


class LocalTrainer:
    """`Trainer` in this process: the TrainerRole's own methods (the weight export is the object itself)."""

    def __init__(self, role: TrainerRole) -> None:
        self.role = role

    def logprobs(self, batch: SeqBatch, reference: bool = False) -> torch.Tensor:
        return self.role.logprobs(batch, reference)

    def values(self, batch: SeqBatch) -> torch.Tensor:
        return self.role.values(batch)

    def update(
        self,
        batch: SeqBatch,
        adv_bt: torch.Tensor,
        rollout_logp_bt: torch.Tensor,
        ref_logp_bt: torch.Tensor | None,
        old_values_bt: torch.Tensor | None = None,
        returns_bt: torch.Tensor | None = None,
    ) -> dict[str, float]:
        return self.role.update(batch, adv_bt, rollout_logp_bt, ref_logp_bt, old_values_bt, returns_bt)

    def export_weights(
        self, kind: WeightSync, *, as_files: bool = False, cuda_ipc: bool = False
    ) -> WeightExport:
        return self.role.export_weights(kind, as_files=as_files, cuda_ipc=cuda_ipc)

    def release_export(self) -> None:
        self.role.release_export()

    def last_export_bytes(self) -> int:
        return self.role.last_export_bytes()

    def raise_if_lost(self, export: Any) -> None:
        pass  # in this process: nothing to lose

    def checkpoint_support(self) -> str | None:
        return self.role.checkpoint_support()

    def save_checkpoint(
        self, run_dir: str, step: int, state: dict[str, Any], recipe_yaml: str, keep: int
    ) -> SavedCheckpoint:
        return self.role.save_checkpoint(run_dir, step, state, recipe_yaml, keep)

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        return self.role.load_checkpoint(path)

    def kill(self) -> None:
        pass
