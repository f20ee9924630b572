"""TensorBoard event files under RUN_DIR/logs/tensorboard: `tensorboard --logdir RUN_DIR/logs/tensorboard`.

Written with tensorboard's own event writer (no torch, no TensorFlow), one scalar per number of each record,
tagged `<kind>/<key>` (`train/reward_mean`, `eval/eval_accuracy`), flushed every step so a crashed run's
events are on disk.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.event_file_writer import EventFileWriter
from tensorboard.summary.writer.record_writer import RecordWriter

from rlbridge.metrics.sinks import scalars


class TensorBoardSink:
    def __init__(self, log_dir: Path) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        self._writer = EventFileWriter(str(log_dir))

    def write(self, record: dict[str, Any]) -> None:
        values = [Summary.Value(tag=tag, simple_value=v) for tag, v in scalars(record).items()]
        self._writer.add_event(
            Event(wall_time=time.time(), step=int(record.get("step", 0)), summary=Summary(value=values))
        )
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in the event files of `log_dir`: {tag: [(step, value), ...]} (tests, reports)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def truncate(log_dir: Path, step: int) -> int:
    """Drop the events of steps after `step` from the event files of `log_dir` (a resume from checkpoint
    `step` recomputes them): each file is rewritten without them and renamed into place. Returns how many
    events went. TensorBoard would otherwise show the killed attempt's steps beside the recomputed ones."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader

    dropped = 0
    for path in sorted(log_dir.glob("events.out.tfevents.*")):
        kept: list[bytes] = []
        gone = 0
        for raw in RawEventFileLoader(str(path)).Load():
            event = Event.FromString(raw)
            if event.HasField("summary") and event.step > step:
                gone += 1
            else:
                kept.append(raw)
        dropped += gone
        if gone:
            tmp = path.with_name(f".{path.name}.tmp")
            with tmp.open("wb") as f:
                writer = RecordWriter(f)
                for raw in kept:
                    writer.write(raw)
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(path)
    return dropped


def read_events(log_dir: Path) -> list[tuple[str, int, float]]:
    """Every scalar (tag, step, value) as written, over the event files of `log_dir` in name order, without
    TensorBoard's purging of out-of-order steps: what any reader of the files sees (tests)."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader

    out = []
    for path in sorted(log_dir.glob("events.out.tfevents.*")):
        for raw in RawEventFileLoader(str(path)).Load():
            event = Event.FromString(raw)
            out += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
    return out
