"""run.time_limit_s: a run that stops by itself before a cluster job's time limit, saved and resumable.

After each step the loop asks `TimeLimit.stop_after_step`: when this command's wall time (from its process start,
start-up included) plus the longest of the last few steps (evaluation and periodic saves included) plus the last
save would pass the limit, the run saves this step and stops like a SIGTERM does (signals.Interrupted), with exit
code 75 (EX_TEMPFAIL: "try again", which job wrappers can requeue on) and the `rlbridge resume` command. The
estimate is the longest recent step, not the mean, so that the last step and its save end inside the limit. The
command's first step (compile, warm-up, the first generation of an async run) is the estimate only until a second
step has run: it does not recur, and counting it for three steps stopped short runs a step early. `rlbridge
resume` starts a new limit.

Before this command has saved, the save is estimated (`save_estimate_s`): a resumed run's newest save in its
metrics, else the checkpoint's size from the plan at a conservative write rate; counting 0 s there let a run without
periodic saves start a step whose stop-save (minutes for a large full fine-tune) ran past a cluster's limit, which
kills the job mid-save with nothing to resume from.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from rlbridge.metrics.log import log
from rlbridge.run.signals import TIME_LIMIT

RECENT_STEPS = 3
"""Steps whose longest duration estimates the next one."""

CHECKPOINT_BYTES_PER_PARAM = 12
"""A checkpoint's bytes per trainable parameter: float32 weights and AdamW's two float32 moments."""

ASSUMED_WRITE_BYTES_S = 0.4 * 2**30
"""The write rate a save is estimated at before one was measured: export-hf's rate at the 7B shape, LoRA checkpoints
wrote faster (docs/defaults.md#save-estimate)."""

_IMPORTED = time.monotonic()


def process_age_s() -> float:
    """Seconds since this process started (Linux /proc), else since this module was imported."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: starttime in ticks
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


class TimeLimit:
    """The stop rule of run.time_limit_s (see the module docstring; None: never stops); `clock`: monotonic seconds."""

    def __init__(
        self, limit_s: float | None, clock: Callable[[], float] = time.monotonic, age_s: float | None = None
    ) -> None:
        """`age_s`: seconds the command has already run (default: this process's age)."""
        self.limit_s, self._clock = limit_s, clock
        now = clock()
        self._started = now - (process_age_s() if age_s is None else age_s)
        self._last_end = now
        self._recent: deque[float] = deque(maxlen=RECENT_STEPS)
        self._first_s: float | None = None

    def begin(self) -> None:
        """The first step starts now (start-up, a resume's restore and the evaluation before step 1 are done)."""
        self._last_end = self._clock()

    def stop_after_step(self, step: int, save_s: float) -> bool:
        """Called when `step` has ended (its evaluation included): True when the next step, then a save taking
        `save_s` (the last one's seconds, save_estimate_s before any), would end past the limit; a line says so."""
        if self.limit_s is None:
            return False
        now = self._clock()
        if self._first_s is None:
            self._first_s = now - self._last_end
        else:
            self._recent.append(now - self._last_end)
        self._last_end = now
        elapsed = now - self._started
        expected_end = elapsed + max(self._recent, default=self._first_s) + save_s
        if expected_end <= self.limit_s:
            return False
        log(
            f"{TIME_LIMIT} {self.limit_s:g}: step {step} ended at {elapsed:.0f} s; the next step and a save would end "
            f"near {expected_end:.0f} s: saving step {step} and stopping"
        )
        return True


def save_estimate_s(
    trainable_params: int | None, history: Iterable[Mapping[str, Any]] = (), *, critic: bool = False
) -> float:
    """Seconds a save is expected to take before this command has saved one: the newest save among the run's
    metrics records (`history`: a resumed run's metrics.jsonl), else `trainable_params` x CHECKPOINT_BYTES_PER_PARAM
    at ASSUMED_WRITE_BYTES_S, twice that with PPO's `critic` (a second backbone trained as the policy is, saved
    beside it); 0 where the plan has no parameter count."""
    saves = [float(r["time_save"]) for r in history if r.get("kind") == "checkpoint" and "time_save" in r]
    if saves:
        return saves[-1]
    return (trainable_params or 0) * (2 if critic else 1) * CHECKPOINT_BYTES_PER_PARAM / ASSUMED_WRITE_BYTES_S
