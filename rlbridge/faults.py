"""Fault injection for tests: stop for a while at a named point, so a test can kill or signal the run there.

Off unless the environment asks for it (Ray forwards RLBRIDGE_* variables to the workers):

    RLBRIDGE_FAULT_PAUSE=update#2:30       pause 30 s the 2nd time this process reaches the point "update"
    RLBRIDGE_FAULT_PAUSE=checkpoint-files:30   ... the 1st time (several specs: separate them with commas)
    RLBRIDGE_FAULT_PAUSE=checkpoint-gather@3#2:60   ... only in the process whose RANK variable is 3 (a
                                           multi-rank trainer's global rank; counts stay per process)
    RLBRIDGE_FAULT_MARKER=/tmp/x           a line "<point> <count> <pid>" is appended there on each pause

Points: `update` (TrainerRole.update, before any work), `checkpoint-files` (checkpoint.save_checkpoint:
tensor files written, manifest not yet), `checkpoint-gather` (megatron `state.gather_state`, every rank:
tensor-parallel shards gathered, full tensors not yet sent to the writing rank), `generate` (VllmRollout.generate, before the engine is called),
`reward` (a reward worker process, before it scores a sample; counted per worker process). The tests use
them to send SIGTERM during an update, to kill -9 a process in the middle of a save, and to SIGKILL one
worker (the rollout actor, the trainer actor, a reward worker) mid-step (tests/reliability/
test_worker_death.py), and to kill one rank of a 4-rank megatron save (tests/megatron/
test_megatron_save_faults.py); nothing else reads these variables.

    RLBRIDGE_PHASE_TRACE=/tmp/t            the driver appends "<unix time> start|end <phase>" there as each
                                           phase of a step (generate, reward, update, sync, eval,
                                           checkpoint, ...) starts and ends (rlbridge/run/stalls.py)

The crash-anywhere soak (tests/reliability/crash_anywhere.py) reads the trace to time its kills to the phases
of the attempt it kills, and to name the phase each kill landed in.
"""

from __future__ import annotations

import os
import time

PAUSE_ENV = "RLBRIDGE_FAULT_PAUSE"
MARKER_ENV = "RLBRIDGE_FAULT_MARKER"
TRACE_ENV = "RLBRIDGE_PHASE_TRACE"
_counts: dict[str, int] = {}


def pause(point: str) -> None:
    """Sleep here if RLBRIDGE_FAULT_PAUSE names this point and this occurrence (see the module docstring)."""
    spec = os.environ.get(PAUSE_ENV)
    if not spec:
        return
    _counts[point] = count = _counts.get(point, 0) + 1
    for item in spec.split(","):
        where, _, seconds = item.strip().rpartition(":")
        name, _, nth = where.partition("#")
        name, _, rank = name.partition("@")
        if name != point or count != (int(nth) if nth else 1):
            continue
        if rank and os.environ.get("RANK", "0") != rank:
            continue
        marker = os.environ.get(MARKER_ENV)
        if marker:
            with open(marker, "a", encoding="utf-8") as f:
                f.write(f"{point} {count} {os.getpid()}\n")
        time.sleep(float(seconds))


def trace(event: str, phase: str) -> None:
    """Append "<time> <event> <phase>" to RLBRIDGE_PHASE_TRACE when it is set (a line per write: a kill
    leaves whole lines)."""
    path = os.environ.get(TRACE_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{time.time():.3f} {event} {phase}\n")
