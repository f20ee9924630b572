"""Where each step's rollouts come from: generated when the step starts (rollout.mode sync), or ahead of the
trainer (async, docs/async.md), on a schedule fixed by step numbers alone:

    sync   step j draws its prompts, generates with weights v(j-1), trains.
    async  generation j is submitted right after step j-1-k has synced its weights (k = rollout.max_staleness),
           so it runs on the rollout worker while the trainer updates steps j-k .. j-1, and step j trains on
           samples of version v(j-1-k): exactly k versions behind (fewer in the first k steps).

The rollout worker runs its calls in the order they were sent (one Ray actor), so "the weights it has" is
known when a generation is sent: the version of the last load sent before it. Timing decides nothing, which
keeps runs reproducible and resumes exact. A checkpoint after step e holds the rollouts of steps e+1 .. e+k
(sent, not yet trained on; they are waited for) and the data position before step e+k+1's prompts; the
resumed run sends generation e+k+1 with the checkpoint's weights v(e), as the uninterrupted run did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlbridge.batch import Rollouts
from rlbridge.errors import RlbridgeError
from rlbridge.run.resume import rollout_seed

if TYPE_CHECKING:
    from rlbridge.session import Session


@dataclass
class Ahead:
    """One step's generation, sent before its step began."""

    step: int
    rows: list[int]
    """The prompts' indices in the training data."""
    data_before: dict[str, Any] | None
    """The sampler's state before these prompts were drawn (None for one restored from a checkpoint)."""
    ref: Any = None
    """The generation in flight (None once its rollouts are here)."""
    rollouts: Rollouts | None = None


class RolloutSource:
    """The loop's source of rollouts for its steps: `fill` after each step, `take` at the next."""

    def __init__(self, s: Session) -> None:
        self.s = s
        self.ahead = s.recipe.rollout.ahead
        self.pending: dict[int, Ahead] = {}

    @property
    def overlapped(self) -> bool:
        return self.ahead > 0

    # ------------------------------------------------------------------ the loop's calls
    def fill(self, done: int) -> None:
        """After step `done` (0 before the first step): send the generations of steps done+1 .. done+1+k that
        are not sent yet (async only; the last step is run.steps)."""
        last = min(done + 1 + self.ahead, self.s.recipe.run.steps)
        for step in range(done + 1, last + 1):
            if self.overlapped and step not in self.pending:
                self._send(step)

    def take(self, step: int) -> tuple[list[int], Rollouts]:
        """Step `step`'s prompt rows and rollouts: generated now (sync), or waited for (async)."""
        s = self.s
        if not self.overlapped:
            rows = s.sampler.next_indices(s.recipe.data.batch_size)
            return rows, s.generate(
                [s.train_data.ids[i] for i in rows], seed=rollout_seed(s.recipe.run.seed, step)
            )
        item = self.pending.get(step)
        if item is None:
            raise RlbridgeError(f"step {step}: its rollouts were never sent (async pipeline bug)")
        return item.rows, self._resolve(item)

    def wait_sent(self) -> None:
        """Wait for every generation sent so far (async): the next weight load queues behind them on the rollout
        worker anyway, and waiting here keeps the generation's time out of the `sync` phase."""
        for item in self.pending.values():
            self._resolve(item)

    def done(self, step: int) -> None:
        """Step `step` trained on its rollouts: they are no longer in flight."""
        self.pending.pop(step, None)

    # ------------------------------------------------------------------ checkpoints
    def state(self, step: int) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """For a checkpoint of step `step`: the data position before step step+k+1's prompts (None: the
        sampler's own, nothing beyond was drawn), and the rollouts of steps step+1 .. step+k, waited for."""
        if not self.overlapped:
            return None, []
        nxt = self.pending.get(step + self.ahead + 1)
        data = nxt.data_before if nxt is not None else None
        items = []
        for j in range(step + 1, step + self.ahead + 1):
            item = self.pending.get(j)
            if item is None:
                continue  # beyond run.steps
            ro = self._resolve(item)
            items.append({"step": j, "rows": item.rows, "rollouts": ro.to_json()})
        return data, items

    def restore(self, items: list[dict[str, Any]]) -> None:
        """The in-flight rollouts a checkpoint saved (async): steps e+1 .. e+k train on them."""
        for it in items:
            ro = Rollouts.from_json(it["rollouts"])
            self.pending[int(it["step"])] = Ahead(int(it["step"]), list(it["rows"]), None, None, ro)

    # ------------------------------------------------------------------ internals
    def _send(self, step: int) -> None:
        s = self.s
        before = s.sampler.state()
        rows = s.sampler.next_indices(s.recipe.data.batch_size)
        ref = s.send_generate([s.train_data.ids[i] for i in rows], seed=rollout_seed(s.recipe.run.seed, step))
        self.pending[step] = Ahead(step, rows, before, ref)

    def _resolve(self, item: Ahead) -> Rollouts:
        if item.rollouts is None:
            item.rollouts = self.s.wait_generate(item.ref)
            item.ref = None
        return item.rollouts
