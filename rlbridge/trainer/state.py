"""The trainer's part of a checkpoint: what a TrainerRole saves and restores. The engine's trainable tensors
(adapters only under LoRA) and optimizer and scheduler state, PPO's critic likewise, the RNG states of every rank,
the update count and the first-update gate's state; the driver's part (data position, driver RNG, weight version)
comes in as `state`. A multi-rank engine with a layout-free state (checkpoint_state) gathers full tensors to global
rank 0, which alone writes; the on-disk format and its atomic save are run/checkpoint.py, when the driver saves
is checkpointer.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlbridge.engines.base import CheckpointableEngine, LimitedCheckpointEngine, PortableCheckpointEngine
from rlbridge.errors import RlbridgeError

if TYPE_CHECKING:
    from rlbridge.trainer.role import TrainerRole


@dataclass(frozen=True)
class SavedCheckpoint:
    """What `TrainerRole.save_checkpoint` wrote (a rank that does not write: path "", 0 bytes)."""

    path: str
    bytes: int
    seconds: float
    notes: list[str]
    """What retention deleted, one line each."""


def checkpoint_support(role: TrainerRole) -> str | None:
    """None when this trainer can save and restore checkpoints, else why not."""
    if isinstance(role.engine, PortableCheckpointEngine):
        return role.engine.checkpoint_problem() if isinstance(role.engine, LimitedCheckpointEngine) else None
    if not isinstance(role.engine, CheckpointableEngine):
        return (
            f"trainer.engine={role.recipe.trainer.engine} cannot checkpoint yet (its engine has no "
            "optimizer_state, load_optimizer_state)"
        )
    if _world_size() > 1:
        return "checkpoints of a multi-rank trainer need a layout-free engine state (checkpoint_state)"
    return None


def _checkpointable(role: TrainerRole) -> CheckpointableEngine:
    problem = checkpoint_support(role)
    if problem:
        raise RlbridgeError(problem)
    assert isinstance(role.engine, CheckpointableEngine)
    return role.engine


def _engine_state(role: TrainerRole) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
    """The tensor groups and the trainer's part of state.json (collective for a multi-rank engine)."""
    from rlbridge.run import rng

    mine: dict[str, Any] = {
        "engine": role.recipe.trainer.engine,
        "updates": role.updates,
        "gate_done": role.gate.done,
        "signal_updates": role.gate.signal_updates,
    }
    if isinstance(role.engine, PortableCheckpointEngine):  # full tensors on global rank 0, any layout
        problem = checkpoint_support(role)
        if problem:
            raise RlbridgeError(problem)
        groups, mine["optimizer"] = role.engine.checkpoint_state()
        mine["layout_free"] = True
        if role.critic is not None:
            assert isinstance(role.critic, PortableCheckpointEngine)
            critic, mine["critic_optimizer"] = role.critic.checkpoint_state()
            if critic:
                groups.update(critic=critic["trainable"], critic_optimizer=critic["optimizer"])
        mine["rng_ranks"] = _gather_rng(rng.rng_state())
        mine["rng"] = mine["rng_ranks"][0] if mine["rng_ranks"] else rng.rng_state()
        return groups, mine
    engine = _checkpointable(role)
    optim_tensors, mine["optimizer"] = engine.optimizer_state()
    mine["rng"] = rng.rng_state()
    groups = {"trainable": role.engine.trainable_state(), "optimizer": optim_tensors}
    if role.critic is not None:  # PPO: the critic's adapter (or weights) + value head, and its AdamW
        critic_optim, mine["critic_optimizer"] = role.critic.optimizer_state()
        groups.update(critic=role.critic.trainable_state(), critic_optimizer=critic_optim)
    return groups, mine


def save(
    role: TrainerRole, run_dir: str, step: int, state: dict[str, Any], recipe_yaml: str, keep: int
) -> SavedCheckpoint:
    """Write checkpoint `step` from this process (the tensors never travel through the driver): the
    trainable tensors (adapters only under LoRA), optimizer and scheduler state, the RNG states and the
    gate state, next to the driver's `state` (data position, driver RNG, weight version). Atomic (see
    rlbridge/run/checkpoint.py). A multi-rank trainer gathers full, layout-free tensors to global rank 0,
    which alone writes."""
    from rlbridge.run import checkpoint as ckpt

    start = time.perf_counter()
    groups, mine = _engine_state(role)
    if not role.is_holder:
        return SavedCheckpoint("", 0, time.perf_counter() - start, [])
    notes: list[str] = []
    path = ckpt.save_checkpoint(
        Path(run_dir),
        step,
        tensors=groups,
        state={**state, "trainer": mine},
        recipe_yaml=recipe_yaml,
        keep=keep,
        log_fn=notes.append,
    )
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    return SavedCheckpoint(str(path), size, time.perf_counter() - start, notes)


def load(role: TrainerRole, path: str) -> dict[str, Any]:
    """Restore the trainable tensors, optimizer + scheduler, RNG and gate state of checkpoint `path`
    (verified first; every rank of a multi-rank trainer reads it); returns its state.json content for
    the driver to restore the rest. A checkpoint of another recipe (another model, LoRA rank, algorithm,
    ...: any key resume_policy does not let change) is refused naming the keys, before any tensor loads."""
    from rlbridge.run import checkpoint as ckpt
    from rlbridge.run import rng
    from rlbridge.run.directory import resolved_yaml
    from rlbridge.run.resume_policy import check_resume_compatible

    problem = checkpoint_support(role)
    if problem:
        raise RlbridgeError(problem)
    loaded = ckpt.load_checkpoint(Path(path))
    mine = loaded.state.get("trainer") or {}
    if mine.get("engine") != role.recipe.trainer.engine:
        raise RlbridgeError(
            f"checkpoint {path} was written by the {mine.get('engine')} engine, this run uses "
            f"trainer.engine={role.recipe.trainer.engine}"
        )
    layout_free = mine.get("layout_free") is True
    refused = check_resume_compatible(loaded.recipe_yaml, resolved_yaml(role.recipe), layout_free=layout_free)
    if refused:
        raise RlbridgeError(f"checkpoint {path} is not of this run's recipe: " + "; ".join(refused))
    if "trainable" not in loaded.tensors:
        raise RlbridgeError(f"checkpoint {path} holds no trainable.safetensors")
    if role.critic is not None and ("critic" not in loaded.tensors or "critic_optimizer" not in mine):
        raise RlbridgeError(
            f"checkpoint {path} holds no critic (critic.safetensors), which algorithm.name=ppo needs"
        )
    policy = {"trainable": loaded.tensors["trainable"], "optimizer": loaded.tensors.get("optimizer", {})}
    if isinstance(role.engine, PortableCheckpointEngine):
        role.engine.load_checkpoint_state(policy, mine["optimizer"])
        if role.critic is not None:
            assert isinstance(role.critic, PortableCheckpointEngine)
            role.critic.load_checkpoint_state(
                {
                    "trainable": loaded.tensors["critic"],
                    "optimizer": loaded.tensors.get("critic_optimizer", {}),
                },
                mine["critic_optimizer"],
            )
        ranks = mine.get("rng_ranks") or [mine["rng"]]
        rank = torch.distributed.get_rank() if _world_size() > 1 else 0
        rng.set_rng_state(ranks[rank] if len(ranks) == _world_size() else ranks[0])
    else:
        engine = _checkpointable(role)
        engine.load_trainable_state(policy["trainable"])
        engine.load_optimizer_state(policy["optimizer"], mine["optimizer"])
        if role.critic is not None:
            role.critic.load_trainable_state(loaded.tensors["critic"])
            role.critic.load_optimizer_state(
                loaded.tensors.get("critic_optimizer", {}), mine["critic_optimizer"]
            )
        rng.set_rng_state(mine["rng"])
    role.updates = int(mine.get("updates", 0))
    role.gate.restore(
        done=bool(mine.get("gate_done", role.gate.done)), signal_updates=int(mine.get("signal_updates", 0))
    )
    return loaded.state


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _gather_rng(mine: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's RNG state, in global rank order, on global rank 0 ([] elsewhere; [mine] alone)."""
    if _world_size() == 1:
        return [mine]
    dist = torch.distributed
    out: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
    dist.gather_object(mine, out if dist.get_rank() == 0 else None, dst=0)
    return out
