"""The trainer role: one engine plus what a step asks of it (mini-batches, PPO epochs, the health gates).

It runs inside a Ray actor (cluster/), or in-process in tests; it holds no Ray code itself. The engine
(hf or megatron) only knows forward/backward/step; this role decides old log-probs, splits mini-batches,
builds the loss closure from the recipe, and has the first updates checked (gate.py: that they really train).
What it saves in a checkpoint and restores from one is state.py.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import record_function

from rlbridge import faults
from rlbridge.algo import correction
from rlbridge.algo.objective import LossInputs, make_loss_fn, make_value_loss_fn
from rlbridge.batch import SeqBatch
from rlbridge.engines.base import (
    DataParallelEngine,
    RecordingEngine,
    TrainEngine,
    WeightExport,
)
from rlbridge.engines.registry import build_critic, build_engine
from rlbridge.errors import RlbridgeError
from rlbridge.plan import num_micro_batches, num_mini_batches
from rlbridge.recipe.schema import PpoCfg, Recipe
from rlbridge.rollout.registry import rollout_engine
from rlbridge.trainer import state as trainer_state
from rlbridge.trainer.export import WeightSender
from rlbridge.trainer.gate import FirstStepGate
from rlbridge.trainer.profile import UpdateProfiler, profiled
from rlbridge.trainer.state import SavedCheckpoint
from rlbridge.weights import WeightSync

log = logging.getLogger(__name__)

UPDATE_SECONDS = ("old_logprobs_s", "trainer_update_s", "train_steps_s", "release_s")
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
        self.sender = WeightSender(self.model_dir, getattr(torch, recipe.model.dtype))
        """Hands the weight exports to the rollout (export.py) and keeps what they need between syncs."""
        self.gate = FirstStepGate(engine, enabled=recipe.run.health.first_step)
        """run.health.first_step: the first updates with a learning signal really train (trainer/gate.py)."""
        self.profiler = UpdateProfiler()
        """RLBRIDGE_PROFILE_UPDATE: the update it names is profiled (trainer/profile.py); off by default."""
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
        shards = {len(self._shard(rows)) for rows in self._mini_batches(r.rollouts_per_step)}
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
        self.sender.last_bytes = weights.nbytes()
        if not self.is_holder:
            return WeightExport(kind, {}, weights.adapter_config)
        return self.sender.send(weights, started=start, as_files=as_files, cuda_ipc=cuda_ipc)

    def release_export(self) -> None:
        """Drop the tensors of the last CUDA IPC export (a no-op without one): WeightSender.release."""
        self.sender.release()

    def last_export_bytes(self) -> int:
        return self.sender.last_bytes

    # ---------------------------------------------------------------- the update
    @profiled
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
            with record_function("rlbridge.old_logprobs"):
                old[mine] = self.engine.logprobs(batch if self.dp_size == 1 else batch.select(mine))
            old_seconds = time.perf_counter() - start
        seen = _SeenLogprobs(batch.size, batch.response_width)  # the first pass's live log-probs, per row
        self.gate.begin()
        metrics: list[dict[str, float]] = []
        steps_began = time.perf_counter()
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
        # the engines' train steps (passes, backward, optimizer), their metrics read back: the rest of
        # trainer_update_s is the loss inputs, the correction metrics, the gate and the memory hand-over
        out["train_steps_s"] = time.perf_counter() - steps_began
        # the trainer's log-probs of the rollout's weights: the old ones, else those of the first pass (exact on
        # policy; in bypass mode later mini-batches include the policy's own movement). A rank that saw none of
        # them (a pipeline stage without the loss) keeps the loss closure's per-micro-batch means.
        trainer_lp = old if old is not None and not rc.bypass else seen.logp if seen.covers(mine) else None
        valid = batch.response_mask[mine] > 0
        if trainer_lp is not None and bool(valid.any()):
            with record_function("rlbridge.correction_metrics"):
                diff = (trainer_lp - rollout_logp_bt)[mine].abs()[valid]
                out["logprob_diff_mean"], out["logprob_diff_max"] = float(diff.mean()), float(diff.max())
                out.update(
                    correction.metrics(rc, trainer_lp[mine], rollout_logp_bt[mine], batch.response_mask[mine])
                )
        with record_function("rlbridge.gate"):
            self.gate.check(out, has_signal=bool(adv_bt.abs().sum() > 0))
        out.update(device_memory_peaks())
        resident = (
            rollout_engine(r).reserves_memory and r.rollout.sleep == "never"
        )  # no wake to make room for
        if r.cluster.colocate and r.rollout.mode == "sync" and not resident and torch.cuda.is_initialized():
            # vLLM wakes next on this device: hand it the activations' cached blocks (torch keeps them otherwise,
            # and a wake that needs them fails out of memory; each update then allocates them again, ~ms).
            # The session hands the trainer rollout.sleep as the plan decided auto (plan.resolved_sleep)
            released = time.perf_counter()
            with record_function("rlbridge.release"):
                torch.cuda.empty_cache()
            out["release_s"] = time.perf_counter() - released
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
        with record_function("rlbridge.train_step"):
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
        """None when this trainer can save and restore checkpoints, else why not (trainer/state.py)."""
        return trainer_state.checkpoint_support(self)

    def save_checkpoint(
        self, run_dir: str, step: int, state: dict[str, Any], recipe_yaml: str, keep: int
    ) -> SavedCheckpoint:
        """Write checkpoint `step` from this process (the tensors never travel through the driver), next to the
        driver's `state`: trainer/state.save."""
        return trainer_state.save(self, run_dir, step, state, recipe_yaml, keep)

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Restore this trainer from checkpoint `path` (verified first, refused if of another recipe); returns its
        state.json content for the driver to restore the rest: trainer/state.load."""
        return trainer_state.load(self, path)


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
