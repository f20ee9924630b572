"""The driver's checkpoints during a run: when to save, what the driver adds, and restoring one.

The step loop (loop.py) drives a `Checkpointer`: `begin_step` snapshots the data position and RNG; a stop
request (SIGTERM, Ctrl-C: rlbridge/run/signals.py) seen before the update of step k abandons that step and saves
step k-1 from the snapshot, one seen during or after the update lets the step finish and saves step k; so does
the stop run.time_limit_s requests after a step (rlbridge/run/time_limit.py).
What a checkpoint holds and how a resume finds and checks it: rlbridge/run/resume.py; the format on disk:
rlbridge/run/checkpoint.py.
"""

from __future__ import annotations

import os
import time
from functools import cached_property
from typing import TYPE_CHECKING, Any, NoReturn

from rlbridge.errors import RlbridgeError
from rlbridge.run.directory import resolved_yaml
from rlbridge.run.resume import RunState, resume_command
from rlbridge.run.rng import rng_state, set_rng_state
from rlbridge.run.signals import Interrupted, StopSignals
from rlbridge.run.time_limit import save_estimate_s

if TYPE_CHECKING:
    from collections.abc import Callable

    from rlbridge.pipeline import RolloutSource
    from rlbridge.run.resume import ResumePoint
    from rlbridge.session import Session


class Checkpointer:
    """When to save, what the driver adds to a checkpoint, and restoring one. See the module docstring."""

    def __init__(
        self,
        s: Session,
        stop: StopSignals,
        log: Callable[[str], None],
        *,
        source: RolloutSource | None = None,
    ) -> None:
        self.s, self.stop, self.log = s, stop, log
        self.source = source
        """rollout.mode async: the generations in flight, which a checkpoint holds (pipeline.py)."""
        self.last_step: int | None = None
        self.last_path: str | None = None
        self.last_save_s: float | None = None
        """The seconds of this command's last save (None before one: expected_save_s estimates it)."""
        self.nonfinite = 0
        """Steps in a row skipped for non-finite values (run.health.max_nonfinite_steps counts them)."""
        self.eval_before: dict[str, float] = {}
        self._snapshot: tuple[dict[str, Any], dict[str, Any]] | None = None
        problem = s.started_trainer().checkpoint_support()
        if problem:  # validation refuses such recipes (recipe/checks/checkpoints.py); never run unsaved
            raise RlbridgeError(f"this run could not write checkpoints: {problem}")

    def expected_save_s(self) -> float:
        """Seconds the next save is expected to take (run.time_limit_s's stop rule): the last save's, and before this
        command's first one the estimate of run/time_limit.save_estimate_s."""
        return self._first_save_estimate_s if self.last_save_s is None else self.last_save_s

    @cached_property
    def _first_save_estimate_s(self) -> float:
        memory = self.s.plan.memory if self.s.plan is not None else None  # no plan: in-process test workers
        return save_estimate_s(
            memory.trainable_params if memory else None,
            self.s.metrics.history,
            critic=self.s.recipe.algorithm.has_critic,
        )

    # ------------------------------------------------------------------ restore
    def restore(self, point: ResumePoint) -> int:
        """Trainer (weights, optimizer, RNG), data position, driver RNG and weight version from `point`, then
        the rollout weights, before anything is generated. Returns the checkpoint's step."""
        s = self.s
        state = RunState.from_json(s.started_trainer().load_checkpoint(str(point.path.resolve())), point.path)
        s.sampler.load_state(state.data)
        inflight = state.inflight
        if inflight or s.recipe.rollout.ahead:
            if (
                self.source is None
                or not self.source.overlapped
                or len(inflight) != min(s.recipe.rollout.ahead, s.recipe.run.steps - point.step)
            ):
                raise RlbridgeError(
                    f"{point.path}: the checkpoint holds {len(inflight)} steps' rollouts in flight, and this run "
                    f"generates {s.recipe.rollout.ahead} steps ahead (rollout.mode, rollout.max_staleness)"
                )
            self.source.restore(inflight)
        set_rng_state(state.rng)
        self.nonfinite = state.nonfinite_streak
        self.eval_before = state.eval_before
        if s.kl_control is not None:
            if not state.kl_control:
                raise RlbridgeError(
                    f"{point.path}: no adaptive KL state, which algorithm.adaptive_kl_target needs"
                )
            s.kl_control.load_state(state.kl_control)
        version = state.weight_version
        start = time.perf_counter()
        s.sync_weights(version=version)  # the same weights keep their version number
        self.last_step, self.last_path = point.step, str(point.path)
        self.log(
            f"restored step {point.step} from {point.path}: trainer weights + optimizer, data position "
            f"(epoch {s.sampler.epoch}, index {s.sampler.index}), RNG; rollout weights v{version} synced "
            f"in {time.perf_counter() - start:.1f} s"
        )
        return point.step

    # ------------------------------------------------------------------ the loop's calls
    def begin_step(self, step: int) -> None:
        """Stop before step `step` if asked to; else remember where its data and RNG start."""
        if self.stop.requested:
            self.interrupt(step - 1)
        self._snapshot = (self.s.sampler.state(), rng_state())

    def abandon(self, step: int) -> NoReturn:
        """A stop was requested before step `step` updated anything: save step - 1 from the snapshot (async:
        the data position the pipeline recorded, with the rollouts of steps step .. step-1+k)."""
        assert self._snapshot is not None
        data, rng = self._snapshot
        self.interrupt(step - 1, data=None if self._overlapped else data, rng=rng)

    @property
    def _overlapped(self) -> bool:
        return self.source is not None and self.source.overlapped

    def due(self, step: int) -> bool:
        every = self.s.recipe.run.save_every
        return bool(every) and step % every == 0

    def save(
        self, step: int, *, data: dict[str, Any] | None = None, rng: dict[str, Any] | None = None
    ) -> None:
        """Checkpoint `step` (once). The trainer writes it in its process."""
        if self.last_step == step:
            return
        s, r = self.s, self.s.recipe
        inflight: list[dict[str, Any]] = []
        if self._overlapped and self.source is not None:
            ahead_data, inflight = self.source.state(step)
            data = data if data is not None else ahead_data
        state = RunState(
            step=step,
            weight_version=s.version,
            data=data if data is not None else s.sampler.state(),
            inflight=inflight,
            rng=rng if rng is not None else rng_state(),
            nonfinite_streak=self.nonfinite,
            eval_before=self.eval_before,
            kl_control=s.kl_control.state() if s.kl_control is not None else None,
        )
        try:
            with s.stall("checkpoint"):
                info = s.started_trainer().save_checkpoint(
                    str(s.run_dir.resolve()), step, state.to_json(), resolved_yaml(r), r.run.keep
                )
        except RlbridgeError as e:  # e.g. disk full: the run stops here, resumable from the last good save
            hint = (
                f"the run stops; resume from {self.last_path} (step {self.last_step}) with: "
                f"{resume_command(s.run_dir)}"
                if self.last_path
                else "the run stops; no checkpoint was written yet, nothing to resume from"
            )
            raise RlbridgeError(f"saving checkpoint step {step} failed: {e}\n{hint}") from e
        for note in info.notes:
            self.log(note)
        self.last_step, self.last_path, self.last_save_s = step, info.path, info.seconds
        s.metrics.write(
            {
                "kind": "checkpoint",
                "step": step,
                "time_save": info.seconds,
                "checkpoint_bytes": info.bytes,
                "path": os.path.relpath(info.path, s.run_dir),
            }
        )

    def interrupt(self, step: int, **state: Any) -> NoReturn:
        """Save `step` (when it is not saved yet) and raise Interrupted with the resume hint."""
        sig = self.stop.requested or "SIGTERM"
        if step >= 0:
            self.save(step, **state)
        run = self.s.run_dir
        if self.last_path is None:
            msg = f"stopped by {sig} before any checkpoint was written; nothing to resume from"
        else:
            msg = (
                f"stopped by {sig} after step {step}; checkpoint {self.last_path}\n"
                f"resume with: {resume_command(run)}"
            )
        raise Interrupted(sig, step, self.last_path, msg)
