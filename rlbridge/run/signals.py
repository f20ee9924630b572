"""Graceful stop: SIGTERM (cluster preemption) or Ctrl-C finishes the current phase, saves, and exits.

`StopSignals` (a context manager, main thread only) turns the first SIGINT or SIGTERM into a request that
the loop checks between phases; the loop then saves a checkpoint and raises `Interrupted`, which the CLI
turns into the resume hint and exit code 130 (SIGINT) or 143 (SIGTERM), the shell's 128 + signal number.
A second Ctrl-C raises KeyboardInterrupt at once: the run stops without saving (a save in progress is
abandoned; the checkpoint format keeps the previous one intact) and exits 130. Repeated SIGTERMs are only
reported: schedulers resend it, and the save must be given its chance.

The driver must receive the signal: the trainer and rollout workers are Ray actors in their own process
groups, and they keep running until the driver has saved and stops them. The loop installs the handlers
once Ray is up (`ray.init` installs a SIGTERM handler of its own in the driver that exits at once); a signal
during start-up therefore stops the run the default way, with nothing to save yet. A terminal's Ctrl-C
reaches the driver's whole process group, Ray's GCS and raylet included; they ignore it (tested).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

from rlbridge.metrics.log import console

TIME_LIMIT = "run.time_limit_s"
"""The stop a recipe's time limit requests (run/time_limit.py); its exit code is EX_TEMPFAIL, "try again"."""

EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143, TIME_LIMIT: 75}


class Interrupted(KeyboardInterrupt):
    """The run stopped on a signal after saving (or with nothing new to save). A KeyboardInterrupt, so
    nothing on the way out mistakes it for a failure."""

    def __init__(self, signame: str, step: int, checkpoint: str | None, message: str) -> None:
        super().__init__(message)
        self.signame, self.step, self.checkpoint, self.message = signame, step, checkpoint, message

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.signame, 1)


class StopSignals:
    """Installs the SIGINT/SIGTERM handlers for its `with` block (and restores the previous ones)."""

    def __init__(self) -> None:
        self.requested: str | None = None
        """Name of the first signal received (SIGINT or SIGTERM) or of another stop (TIME_LIMIT), None while none
        was."""
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def request(self, reason: str) -> None:
        """A stop that is not a signal (TIME_LIMIT): handled as the first signal is, unless one came first."""
        if self.requested is None:
            self.requested = reason

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested is None:
            self.requested = name
            again = "; Ctrl-C again to abort without saving" if name == "SIGINT" else ""
            console.print(
                f"[yellow]rlbridge[/] {name}: finishing the current phase, then saving a checkpoint{again}"
            )
            return
        if name == "SIGINT":
            console.print("[red]rlbridge[/] second Ctrl-C: stopping without saving")
            raise KeyboardInterrupt
        console.print(f"[yellow]rlbridge[/] {name} again: still finishing the phase and saving")
