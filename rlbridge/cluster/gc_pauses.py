"""Python's garbage collector in the trainer and rollout workers: the start-up heap frozen, long pauses logged.

A full collection (generation 2) walks every container object the process tracks. A worker's start-up builds
most of what it will ever hold (the model and its modules, vLLM's engine, every imported module), and all of it
lives for the whole run; after the constructor it is frozen (`gc.freeze`: collections leave it out), as vLLM
does with its own engine's start-up heap. Collections are then cheap, and any that still takes PAUSE_S or
longer is logged with its generation and duration, so that a slow step in a worker's log names it.

Before the freeze a worker's full collections could take a large fraction of a short step; after it none of
PAUSE_S or more was seen (docs/defaults.md#gc-freeze). While the constructor runs, full collections are off
(`paused`): its heap grows by imports and engines that all stay alive, so each full collection its growth triggers
walks more and frees almost nothing; the vLLM rollout also freezes what it imported (`freeze_if_starting`) before
vLLM's start-up makes its own explicit collections.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

PAUSE_S = 0.05
"""Collections at least this long are logged."""

_began: list[float] = [0.0]


def _timed(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _began[0] = time.perf_counter()
        return
    took = time.perf_counter() - _began[0]
    if took >= PAUSE_S:
        log.info(
            "python gc: a generation %d collection took %.3f s (%d objects freed, %d frozen before)",
            info.get("generation", -1),
            took,
            info.get("collected", 0),
            gc.get_freeze_count(),
        )


def watch() -> None:
    """Log collections of PAUSE_S or longer (once per process, however often called)."""
    if _timed not in gc.callbacks:
        gc.callbacks.append(_timed)


NO_FULL_COLLECTIONS = 1 << 30
"""gc threshold 2 while a worker starts: young collections only (full ones would need this many young ones)."""


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Full (generation 2) collections off while a worker's constructor runs (imports, the model, vLLM's engine),
    back to the thresholds before after it, also when it raises. Nearly everything start-up allocates stays alive,
    so the full collections its growth triggers walk a growing heap and free almost nothing; young collections
    go on, so short-lived cycles (a loader's temporaries) are still freed while it runs. Explicit
    `gc.collect()` calls (vLLM's memory profiling makes them) still collect everything."""
    before = gc.get_threshold()
    gc.set_threshold(before[0], before[1], NO_FULL_COLLECTIONS)
    try:
        yield
    finally:
        gc.set_threshold(*before)


def freeze_if_starting() -> None:
    """Inside `paused` (a worker's start-up), freeze what is alive now: it lives for the run (e.g. the modules a
    constructor just imported), so later explicit full collections (vLLM's start-up makes several) skip it."""
    if gc.get_threshold()[2] == NO_FULL_COLLECTIONS:
        gc.freeze()


def freeze_startup_heap() -> int:
    """Collect what start-up left as garbage, then freeze everything still alive; returns the objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
