"""What a metric sink is, and the scalars every optional sink logs. Imported by log.py (which picks the
sinks) and by the sinks themselves, so neither imports the other."""

from __future__ import annotations

from typing import Any, Protocol


class Sink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a record, tagged `<kind>/<key>` (`train/reward_mean`, `eval/eval_accuracy`): what
    the tensorboard and wandb sinks log. Strings, lists and None are left out; bools become 0/1."""
    kind = record.get("kind", "train")
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in ("step", "kind") or value is None or not isinstance(value, (int, float)):
            continue
        out[f"{kind}/{key}"] = float(value)
    return out
