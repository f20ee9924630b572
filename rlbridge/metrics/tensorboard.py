"""TensorBoard event files under RUN_DIR/logs/tensorboard: `tensorboard --logdir RUN_DIR/logs/tensorboard`.

Written with tensorboard's own event writer (no torch, no TensorFlow), one scalar per number of each record,
tagged `<kind>/<key>` (`train/reward_mean`, `eval/eval_accuracy`), flushed every step so a crashed run's
events are on disk.

A resumed run opens a new event file that starts with TensorBoard's own purge marker (what torch's
`SummaryWriter(purge_step=N)` writes: a SessionLog START event at step N): TensorBoard then discards the
earlier files' events at steps >= N, the ones the resume recomputes, so each step shows once. The files
are never rewritten.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tensorboard.compat.proto.event_pb2 import Event, SessionLog
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from rlbridge.metrics.sinks import scalars


class TensorBoardSink:
    def __init__(self, log_dir: Path, *, purge_step: int | None = None) -> None:
        """purge_step: the first step a resumed run logs again (the checkpoint's step + 1); None for a new run."""
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        self._writer = EventFileWriter(str(log_dir))
        if purge_step is not None:
            self._writer.add_event(
                Event(wall_time=time.time(), step=purge_step, session_log=SessionLog(status=SessionLog.START))
            )
            self._writer.flush()

    def write(self, record: dict[str, Any]) -> None:
        values = [Summary.Value(tag=tag, simple_value=v) for tag, v in scalars(record).items()]
        self._writer.add_event(
            Event(wall_time=time.time(), step=int(record.get("step", 0)), summary=Summary(value=values))
        )
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in the event files of `log_dir` as TensorBoard shows it, purge markers applied:
    {tag: [(step, value), ...]} (tests, reports)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def read_events(log_dir: Path) -> list[tuple[str, int, float]]:
    """Every scalar (tag, step, value) as written, over the event files of `log_dir` in name order, without
    TensorBoard's purging: a resumed run's recomputed steps appear twice here (tests)."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader

    out = []
    for path in sorted(log_dir.glob("events.out.tfevents.*")):
        for raw in RawEventFileLoader(str(path)).Load():
            event = Event.FromString(raw)
            out += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
    return out
