"""The trainer role: one engine plus what a step asks of it (mini-batches, PPO epochs, the health gates).

It runs inside a Ray actor (cluster/), or in-process in tests; it holds no Ray code itself. The engine
(hf or megatron) only knows forward/backward/step; this role decides old log-probs, splits mini-batches,
builds the loss closure from the recipe, and checks that the first updates really train.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlbridge import faults
from rlbridge.algo import correction
from rlbridge.algo.objective import LossInputs, make_loss_fn, make_value_loss_fn
from rlbridge.batch import SeqBatch
from rlbridge.engines.base import (
    CheckpointableEngine,
    DataParallelEngine,
    ExpertEngine,
    LimitedCheckpointEngine,
    MoeBook,
    PortableCheckpointEngine,
    RecordingEngine,
    TrainEngine,
    WeightExport,
)
from rlbridge.engines.moe import ExpertId, expert_report, sum_counts
from rlbridge.engines.registry import build_critic, build_engine
from rlbridge.errors import RlbridgeError
from rlbridge.plan import num_micro_batches, num_mini_batches
from rlbridge.recipe.schema import PpoCfg, Recipe
from rlbridge.rollout.registry import rollout_engine
from rlbridge.trainer.export import WeightSender
from rlbridge.weights import WeightSync

log = logging.getLogger(__name__)

UPDATE_SECONDS = ("old_logprobs_s", "trainer_update_s")
"""The update's wall-clock outputs (they differ between two runs that are otherwise bit-identical)."""

CUDNN_ATTENTION_ENV = "RLBRIDGE_CUDNN_ATTENTION"
"""`0` turns torch's cuDNN attention off in the trainer process (both engines' SDPA then use the other kernels).
For measurement: cuDNN builds its plans per shape on the host, so the first update at each new batch width stalls
for about a second, while updates at widths seen before are faster with it (docs/defaults.md#pass-widths)."""


def apply_cudnn_attention_env(environ: dict[str, str] | None = None) -> bool:
    """Applies RLBRIDGE_CUDNN_ATTENTION (`0` off, `1` or unset: torch's default); returns whether cuDNN attention
    stays enabled."""
    value = (os.environ if environ is None else environ).get(CUDNN_ATTENTION_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise RlbridgeError(f"{CUDNN_ATTENTION_ENV}={value!r}: expected 0 (off) or 1 (torch's default)")
    if value == "0":
        torch.backends.cuda.enable_cudnn_sdp(False)
    return bool(torch.backends.cuda.cudnn_sdp_enabled())


@dataclass(frozen=True)
class SavedCheckpoint:
    """What `TrainerRole.save_checkpoint` wrote (a rank that does not write: path "", 0 bytes)."""

    path: str
    bytes: int
    seconds: float
    notes: list[str]
    """What retention deleted, one line each."""


class HealthError(RlbridgeError):
    """A health gate failed; the message says which and how to turn it off."""


class TrainerRole:
    """The role of one trainer process. With a multi-rank engine (megatron) every rank runs one, fed the
    same arguments by trainer/group.TrainerGroup; each data-parallel rank then works on its share
    of the rows (`_shard`), so the loss closure and the health gates below are the one code path."""

    def __init__(
        self,
        recipe: Recipe,
        model_dir: str,
        *,
        num_threads: int | None = None,
        engine_factory: Callable[[], TrainEngine] | None = None,
        prompt_lengths: list[int] | None = None,
    ) -> None:
        """prompt_lengths: the training prompts' token counts; under trainer.cuda_graphs the passes they make
        likely are recorded before the first step (`prerecord`), while the rollout engine starts beside."""
        if num_threads:
            torch.set_num_threads(num_threads)
        torch.manual_seed(recipe.run.seed)
        if not apply_cudnn_attention_env():
            log.info("cuDNN attention off (%s=0)", CUDNN_ATTENTION_ENV)
        self.recipe = recipe
        self.model_dir = Path(model_dir)
        self.engine = engine_factory() if engine_factory is not None else build_engine(recipe, self.model_dir)
        self.critic = build_critic(recipe, self.model_dir)
        """PPO's value model (None for the other algorithms); updated in `update` on the policy's micro-batches."""
        engine = self.engine
        self.dp_rank, self.dp_size = (
            engine.data_parallel if isinstance(engine, DataParallelEngine) else (0, 1)
        )
        self.is_holder = True
        """Whether this process returns the weight export (global rank 0 of a multi-rank trainer)."""
        self.updates = 0
        self._signal_updates = 0
        self.sender = WeightSender(self.model_dir, getattr(torch, recipe.model.dtype))
        """Hands the weight exports to the rollout (export.py) and keeps what they need between syncs."""
        self._start: dict[str, torch.Tensor] | None = None
        self._frozen: dict[str, float] | None = None
        self._gate_done = not recipe.run.health.first_step
        self._routed: dict[ExpertId, int] = {}
        """Tokens routed per expert in the training forwards since the gate started (MoE models)."""
        if prompt_lengths:
            self.prerecord(prompt_lengths)
        device_memory_peaks()  # the first step's peak then starts from the built model, not from its load

    def prerecord(self, prompt_lengths: list[int]) -> int:
        """trainer.cuda_graphs: the engine records the pass shapes of a full step's mini-batches (this rank's
        shards of them) that the prompt lengths make likely (HFTrainEngine.prerecord); 0 without the option."""
        r = self.recipe
        if not r.trainer.cuda_graphs or not isinstance(self.engine, RecordingEngine):
            return 0
        start = time.perf_counter()
        shards = {len(self._shard(rows)) for rows in self._mini_batches(r.data.batch_size * r.rollout.n)}
        passes = [(rows, num_micro_batches(r, rows)) for rows in sorted(shards, reverse=True) if rows]
        recorded = int(self.engine.prerecord(prompt_lengths, passes))
        log.info(
            "trainer.cuda_graphs: %d pass shapes recorded before the first step in %.1f s",
            recorded,
            time.perf_counter() - start,
        )
        return recorded

    # ---------------------------------------------------------------- passthroughs
    def _mini_batches(self, num_rows: int) -> list[torch.Tensor]:
        """The rows of each mini-batch of a step of `num_rows` rollouts: contiguous near-equal slices (a DAPO step
        can come up short of batch_size x n)."""
        return list(torch.arange(num_rows).tensor_split(num_mini_batches(self.recipe, num_rows)))

    def _shard(self, rows: torch.Tensor) -> torch.Tensor:
        """This data-parallel rank's contiguous share of `rows` (all of them without data parallelism)."""
        return rows.tensor_split(self.dp_size)[self.dp_rank] if self.dp_size > 1 else rows

    def logprobs(self, batch: SeqBatch, reference: bool = False) -> torch.Tensor:
        """[b, R] log-probs; with data parallelism, of this rank's share of the rows only (TrainerGroup
        concatenates the shares in data-parallel order)."""
        if self.dp_size == 1:
            return self.engine.logprobs(batch, reference=reference)
        rows = self._shard(torch.arange(batch.size))
        if not len(rows):
            return torch.zeros(0, batch.response_width)
        return self.engine.logprobs(batch.select(rows), reference=reference)

    def values(self, batch: SeqBatch) -> torch.Tensor:
        """[b, R] critic values V(s_t) of the response tokens (PPO), before the update: GAE's and the value
        clip's old values."""
        if self.critic is None:
            raise RlbridgeError(f"algorithm.name={self.recipe.algorithm.name} has no critic")
        if self.dp_size == 1:
            return self.critic.values(batch)
        rows = self._shard(torch.arange(batch.size))  # as logprobs: this replica's share, in dp order
        if not len(rows):
            return torch.zeros(0, batch.response_width)
        return self.critic.values(batch.select(rows))

    def export_weights(
        self, kind: WeightSync, *, as_files: bool = False, cuda_ipc: bool = False
    ) -> WeightExport:
        """The weights for the rollout: the engine's export, handed over as the sender decides (export.py:
        through Ray, as files on this node, or by CUDA IPC handles kept until `release_export`)."""
        start = time.perf_counter()
        weights = self.engine.export_weights(kind)  # collective with a multi-rank engine: every rank calls it
        self.sender.last_bytes = sum(t.numel() * t.element_size() for t in weights.tensors.values())
        if not self.is_holder:
            return WeightExport(kind, {}, weights.adapter_config)
        return self.sender.send(weights, started=start, as_files=as_files, cuda_ipc=cuda_ipc)

    def release_export(self) -> None:
        """Drop the tensors of the last CUDA IPC export (a no-op without one): WeightSender.release."""
        self.sender.release()

    def last_export_bytes(self) -> int:
        return self.sender.last_bytes

    # ---------------------------------------------------------------- the update
    def update(
        self,
        batch: SeqBatch,
        adv_bt: torch.Tensor,
        rollout_logp_bt: torch.Tensor,
        ref_logp_bt: torch.Tensor | None,
        old_values_bt: torch.Tensor | None = None,
        returns_bt: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """Policy (and, for PPO, critic) updates on the step's batch: ppo_epochs passes over its mini-batches.
        PPO passes the critic's pre-update values and the GAE returns (its targets)."""
        faults.pause("update")  # tests signal the driver here (rlbridge/faults.py); a no-op otherwise
        began = time.perf_counter()
        critic = None
        if self.critic is not None:
            if old_values_bt is None or returns_bt is None:
                raise RlbridgeError("the PPO update needs the critic's old values and the returns")
            critic = (old_values_bt, returns_bt)
        r = self.recipe
        minis = self._mini_batches(batch.size)
        on_policy = len(minis) == 1 and r.trainer.ppo_epochs == 1
        mine = torch.cat([self._shard(rows) for rows in minis])  # the rows this rank trains on
        rc = r.algorithm.rollout_correction
        old, old_seconds = None, 0.0
        if rc.bypass:  # the rollout's log-probs are the old ones: no trainer forward before the update
            old = rollout_logp_bt.to(torch.float32)
        elif not on_policy:
            start = time.perf_counter()
            old = torch.zeros(batch.size, batch.response_width)
            old[mine] = self.engine.logprobs(batch if self.dp_size == 1 else batch.select(mine))
            old_seconds = time.perf_counter() - start
        seen = _SeenLogprobs(batch.size, batch.response_width)  # the first pass's live log-probs, per row
        if self._start is None and not self._gate_done:
            self._start = {k: v.detach().clone() for k, v in self.engine.trainable_state().items()}
            self._frozen = self.engine.frozen_fingerprint()
            moe = self._moe()
            if moe is not None:  # collective on a multi-rank engine: every rank starts the gate together
                moe.routed_tokens()
                self._routed = {}
        metrics: list[dict[str, float]] = []
        for epoch in range(r.trainer.ppo_epochs):
            for rows in minis:
                metrics.append(
                    self._update_mini(
                        batch,
                        rows,
                        adv_bt,
                        old,
                        ref_logp_bt,
                        rollout_logp_bt,
                        critic,
                        record=seen.record(rows) if epoch == 0 else None,
                    )
                )
        out = _mean_metrics(metrics)
        out["old_logprobs_s"] = old_seconds  # inside time_update: the forward that bypass saves
        # the trainer's log-probs of the rollout's weights: the old ones, else those of the first pass (exact on
        # policy; in bypass mode later mini-batches include the policy's own movement). A rank that saw none of
        # them (a pipeline stage without the loss) keeps the loss closure's per-micro-batch means.
        trainer_lp = old if old is not None and not rc.bypass else seen.logp if seen.covers(mine) else None
        valid = batch.response_mask[mine] > 0
        if trainer_lp is not None and bool(valid.any()):
            diff = (trainer_lp - rollout_logp_bt)[mine].abs()[valid]
            out["logprob_diff_mean"], out["logprob_diff_max"] = float(diff.mean()), float(diff.max())
            out.update(
                correction.metrics(rc, trainer_lp[mine], rollout_logp_bt[mine], batch.response_mask[mine])
            )
        self._health(out, has_signal=bool(adv_bt.abs().sum() > 0))
        out.update(device_memory_peaks())
        resident = (
            rollout_engine(r).reserves_memory and r.rollout.sleep == "never"
        )  # no wake to make room for
        if r.cluster.colocate and r.rollout.mode == "sync" and not resident and torch.cuda.is_initialized():
            # vLLM wakes next on this device: hand it the activations' cached blocks (torch keeps them otherwise,
            # and a wake that needs them fails out of memory; each update then allocates them again, ~ms).
            # The session hands the trainer rollout.sleep as the plan decided auto (plan.resolved_sleep)
            torch.cuda.empty_cache()
        # the trainer's own seconds: time_update less this is the hand-over (Ray, vLLM's sleep, a queued export)
        out["trainer_update_s"] = time.perf_counter() - began
        return out

    def _update_mini(
        self,
        batch: SeqBatch,
        rows: torch.Tensor,
        adv_bt: torch.Tensor,
        old: torch.Tensor | None,
        ref: torch.Tensor | None,
        rollout_lp: torch.Tensor,
        critic: tuple[torch.Tensor, torch.Tensor] | None = None,
        *,
        record: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    ) -> dict[str, Any]:
        """One optimizer step on the mini-batch `rows` (contiguous). The loss inputs cover the whole
        mini-batch, so each data-parallel rank's closure returns its exact share of the mini-batch loss."""
        r = self.recipe
        inputs = LossInputs(
            adv_bt=adv_bt[rows], mask_bt=batch.response_mask[rows], old_logp_bt=None if old is None else old[rows],
            ref_logp_bt=None if ref is None else ref[rows], rollout_logp_bt=rollout_lp[rows],
        )  # fmt: skip
        mine = self._shard(rows)
        num_micro = num_micro_batches(r, len(mine))
        # engines backpropagate loss_fn(...) / num_micro_batches (engines/base.py) and data parallelism
        # averages the ranks' gradients: micro_scale undoes both
        loss_fn = make_loss_fn(
            r.algorithm,
            inputs,
            norm_constant=float(r.rollout.max_response_tokens),
            micro_scale=float(num_micro * self.dp_size),
            record=record,
        )
        if self.dp_size > 1:  # the engine numbers the rows of its shard; the closure, those of the mini-batch
            in_mini, mini_fn = mine - rows[0], loss_fn
            loss_fn = lambda logp, ent, local: mini_fn(logp, ent, in_mini[local.cpu()])  # noqa: E731
        m = self.engine.train_step(batch.select(mine), loss_fn, num_micro_batches=num_micro)
        if self.critic is not None and critic is not None:  # the same rows, in the same micro-batches
            old_values, returns = critic
            assert isinstance(r.algorithm, PpoCfg)  # the one algorithm with a critic
            value_fn = make_value_loss_fn(
                r.algorithm.critic,
                old_values[rows],
                returns[rows],
                batch.response_mask[rows],
                micro_scale=float(num_micro * self.dp_size),
            )
            if self.dp_size > 1:  # as loss_fn: shard rows -> mini-batch rows
                value_mini = value_fn
                value_fn = lambda values, local: value_mini(values, in_mini[local.cpu()])  # noqa: E731
            m.update(self.critic.train_step(batch.select(mine), value_fn, num_micro_batches=num_micro))
        self.updates += 1
        return m

    # ---------------------------------------------------------------- checkpoints
    def checkpoint_support(self) -> str | None:
        """None when this trainer can save and restore checkpoints, else why not."""
        if isinstance(self.engine, PortableCheckpointEngine):
            return (
                self.engine.checkpoint_problem() if isinstance(self.engine, LimitedCheckpointEngine) else None
            )
        if not isinstance(self.engine, CheckpointableEngine):
            return (
                f"trainer.engine={self.recipe.trainer.engine} cannot checkpoint yet (its engine has no "
                "optimizer_state, load_optimizer_state)"
            )
        if _world_size() > 1:
            return "checkpoints of a multi-rank trainer need a layout-free engine state (checkpoint_state)"
        return None

    def _checkpointable(self) -> CheckpointableEngine:
        problem = self.checkpoint_support()
        if problem:
            raise RlbridgeError(problem)
        assert isinstance(self.engine, CheckpointableEngine)
        return self.engine

    def _engine_state(self) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
        """The tensor groups and the trainer's part of state.json (collective for a multi-rank engine)."""
        from rlbridge.run import rng

        mine: dict[str, Any] = {
            "engine": self.recipe.trainer.engine,
            "updates": self.updates,
            "gate_done": self._gate_done,
            "signal_updates": self._signal_updates,
        }
        if isinstance(self.engine, PortableCheckpointEngine):  # full tensors on global rank 0, any layout
            problem = self.checkpoint_support()
            if problem:
                raise RlbridgeError(problem)
            groups, mine["optimizer"] = self.engine.checkpoint_state()
            mine["layout_free"] = True
            if self.critic is not None:
                assert isinstance(self.critic, PortableCheckpointEngine)
                critic, mine["critic_optimizer"] = self.critic.checkpoint_state()
                if critic:
                    groups.update(critic=critic["trainable"], critic_optimizer=critic["optimizer"])
            mine["rng_ranks"] = _gather_rng(rng.rng_state())
            mine["rng"] = mine["rng_ranks"][0] if mine["rng_ranks"] else rng.rng_state()
            return groups, mine
        engine = self._checkpointable()
        optim_tensors, mine["optimizer"] = engine.optimizer_state()
        mine["rng"] = rng.rng_state()
        groups = {"trainable": self.engine.trainable_state(), "optimizer": optim_tensors}
        if self.critic is not None:  # PPO: the critic's adapter (or weights) + value head, and its AdamW
            critic_optim, mine["critic_optimizer"] = self.critic.optimizer_state()
            groups.update(critic=self.critic.trainable_state(), critic_optimizer=critic_optim)
        return groups, mine

    def save_checkpoint(
        self, run_dir: str, step: int, state: dict[str, Any], recipe_yaml: str, keep: int
    ) -> SavedCheckpoint:
        """Write checkpoint `step` from this process (the tensors never travel through the driver): the
        trainable tensors (adapters only under LoRA), optimizer and scheduler state, the RNG states and the
        gate state, next to the driver's `state` (data position, driver RNG, weight version). Atomic (see
        rlbridge/run/checkpoint.py). A multi-rank trainer gathers full, layout-free tensors to global rank 0,
        which alone writes."""
        from rlbridge.run import checkpoint as ckpt

        start = time.perf_counter()
        groups, mine = self._engine_state()
        if not self.is_holder:
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

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Restore the trainable tensors, optimizer + scheduler, RNG and gate state of checkpoint `path`
        (verified first; every rank of a multi-rank trainer reads it); returns its state.json content for
        the driver to restore the rest. A checkpoint of another recipe (another model, LoRA rank, algorithm,
        ...: any key resume_policy does not let change) is refused naming the keys, before any tensor loads."""
        from rlbridge.run import checkpoint as ckpt
        from rlbridge.run import rng
        from rlbridge.run.directory import resolved_yaml
        from rlbridge.run.resume_policy import check_resume_compatible

        problem = self.checkpoint_support()
        if problem:
            raise RlbridgeError(problem)
        loaded = ckpt.load_checkpoint(Path(path))
        mine = loaded.state.get("trainer") or {}
        if mine.get("engine") != self.recipe.trainer.engine:
            raise RlbridgeError(
                f"checkpoint {path} was written by the {mine.get('engine')} engine, this run uses "
                f"trainer.engine={self.recipe.trainer.engine}"
            )
        layout_free = mine.get("layout_free") is True
        refused = check_resume_compatible(
            loaded.recipe_yaml, resolved_yaml(self.recipe), layout_free=layout_free
        )
        if refused:
            raise RlbridgeError(f"checkpoint {path} is not of this run's recipe: " + "; ".join(refused))
        if "trainable" not in loaded.tensors:
            raise RlbridgeError(f"checkpoint {path} holds no trainable.safetensors")
        if self.critic is not None and ("critic" not in loaded.tensors or "critic_optimizer" not in mine):
            raise RlbridgeError(
                f"checkpoint {path} holds no critic (critic.safetensors), which algorithm.name=ppo needs"
            )
        policy = {"trainable": loaded.tensors["trainable"], "optimizer": loaded.tensors.get("optimizer", {})}
        if isinstance(self.engine, PortableCheckpointEngine):
            self.engine.load_checkpoint_state(policy, mine["optimizer"])
            if self.critic is not None:
                assert isinstance(self.critic, PortableCheckpointEngine)
                self.critic.load_checkpoint_state(
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
            engine = self._checkpointable()
            engine.load_trainable_state(policy["trainable"])
            engine.load_optimizer_state(policy["optimizer"], mine["optimizer"])
            if self.critic is not None:
                self.critic.load_trainable_state(loaded.tensors["critic"])
                self.critic.load_optimizer_state(
                    loaded.tensors.get("critic_optimizer", {}), mine["critic_optimizer"]
                )
            rng.set_rng_state(mine["rng"])
        self.updates = int(mine.get("updates", 0))
        self._gate_done = bool(mine.get("gate_done", self._gate_done))
        self._signal_updates = int(mine.get("signal_updates", 0))
        self._start = self._frozen = None
        return loaded.state

    # ---------------------------------------------------------------- health gates
    def _health(self, m: dict[str, Any], *, has_signal: bool) -> None:
        if self._gate_done or self._start is None or not has_signal or m.get("skipped"):
            return
        self._signal_updates += 1
        gn = m.get("grad_norm", float("nan"))
        if not math.isfinite(gn) or gn <= 0:
            raise HealthError(
                f"first update: grad_norm is {gn} (expected finite and > 0): nothing is training. "
                "Check LoRA targets and recompute settings; turn the gate off with run.health.first_step: false"
            )
        now = self.engine.trainable_state()
        frozen = self.engine.frozen_fingerprint()
        moved_frozen = [k for k, v in frozen.items() if self._frozen is not None and v != self._frozen.get(k)]
        if moved_frozen:
            raise HealthError(
                f"frozen tensors changed during the update: {', '.join(moved_frozen[:5])}"
                f"{' ...' if len(moved_frozen) > 5 else ''} (run.health.first_step: false turns this check off)"
            )
        unchanged = [k for k, v in now.items() if torch.equal(v, self._start[k])]
        unchanged = self._check_experts(now, unchanged)
        # LoRA's B starts at zero, so A gets no gradient on the first update with a signal: allow two.
        if unchanged and self._signal_updates >= 2:
            raise HealthError(
                f"{len(unchanged)} of {len(now)} trainable tensors did not change after {self._signal_updates} "
                "updates with a learning signal: "
                f"{', '.join(unchanged[:5])}{' ...' if len(unchanged) > 5 else ''} "
                "(run.health.first_step: false turns this check off)"
            )
        if not unchanged:
            self._gate_done = True
            self._start = None

    def _moe(self) -> MoeBook | None:
        return self.engine.moe if isinstance(self.engine, ExpertEngine) else None

    def _check_experts(self, now: dict[str, torch.Tensor], unchanged: list[str]) -> list[str]:
        """On an MoE model: every expert the router sent tokens to must have trained (each of its adapter tensors,
        or parts of packed ones, changed); a dead one stops the run by name. Tensors of experts that received no
        tokens cannot change and are left out of `unchanged` (returned)."""
        moe = self._moe()
        if moe is None or self._start is None:
            return unchanged
        self._routed = sum_counts([self._routed, moe.routed_tokens()])
        report = expert_report(moe.expert_views(self._start), moe.expert_views(now), self._routed)
        if report.dead and self._signal_updates >= 2:
            raise HealthError(
                f"{len(report.dead)} experts received tokens but their adapters did not change after "
                f"{self._signal_updates} updates with a learning signal: {report.describe(report.dead)} "
                "(expert LoRA detached from autograd?). run.health.first_step: false turns this check off"
            )
        idle = set(report.unrouted)

        def only_idle(name: str) -> bool:
            keys = set(moe.expert_views({name: now[name]}))
            return bool(keys) and keys <= idle

        return [k for k in unchanged if not only_idle(k)]


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


class _SeenLogprobs:
    """The live log-probs the loss closure saw on the first pass over each row (detached, on the CPU)."""

    def __init__(self, size: int, width: int) -> None:
        self.logp = torch.zeros(size, width)
        self.filled = torch.zeros(size, dtype=torch.bool)

    def record(self, mini_rows: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], None]:
        """A recorder for one mini-batch: the closure numbers its rows within the mini-batch."""

        def put(rows: torch.Tensor, logp: torch.Tensor) -> None:
            idx = mini_rows[rows.cpu()]
            self.logp[idx, : logp.shape[1]] = logp.float().cpu()
            self.filled[idx] = True

        return put

    def covers(self, rows: torch.Tensor) -> bool:
        return bool(self.filled[rows].all())


def _mean_metrics(items: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in {k for m in items for k in m}:
        vals = [m[key] for m in items if key in m]
        if all(isinstance(v, (int, float)) for v in vals):
            out[key] = max(vals) if key.endswith("_max") else sum(vals) / len(vals)
        else:
            out[key] = vals[-1]
    return out


def device_memory_peaks() -> dict[str, float]:
    """This process's peak CUDA memory since the previous call (the first: since start-up, the model's load
    included), allocated and reserved by torch's caching allocator, in GiB; then the counters restart, so each
    step's figure covers its reference / critic passes and its update. Empty off CUDA. Named *_max: a trainer
    group reports the largest replica's (trainer/group.py)."""
    if not torch.cuda.is_initialized():
        return {}
    peaks = {
        "trainer_gpu_gib_max": torch.cuda.max_memory_allocated() / 2**30,
        "trainer_gpu_reserved_gib_max": torch.cuda.max_memory_reserved() / 2**30,
    }
    torch.cuda.reset_peak_memory_stats()
    return peaks
