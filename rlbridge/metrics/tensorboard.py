"""TensorBoard event files under RUN_DIR/logs/tensorboard: `tensorboard --logdir RUN_DIR/logs/tensorboard`.

Written with tensorboard's own event writer (no torch, no TensorFlow), one scalar per number of each record,
tagged `<kind>/<key>` (`train/reward_mean`, `eval/eval_accuracy`), flushed every step so a crashed run's
events are on disk.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.event_file_writer import EventFileWriter

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
