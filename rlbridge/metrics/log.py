"""Metrics: one record per step fanned out to the sinks that `run.loggers` selects.

The jsonl file in the run directory is always written and is the source of truth (one JSON object per
step, flushed each step, so a crashed run keeps every finished step; `rlbridge report` reads it). The
other sinks see the same dicts:

    console      one line per step on stderr (rich)
    tensorboard  event files under RUN_DIR/logs/tensorboard   (rlbridge.metrics.tensorboard)
    wandb        Weights & Biases, offline without WANDB_API_KEY, files under RUN_DIR/logs/wandb
                 (rlbridge.metrics.wandb)

A sink is anything with `write(record)` and `close()`. The heavy ones import their library inside their
own module, only when selected. A failing optional sink is dropped with a warning: a logger never stops a
run, and the jsonl file still has every step.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from rlbridge.metrics.sinks import Sink
from rlbridge.recipe.schema import WandbCfg

console = Console(highlight=False, stderr=True)


def log(msg: str) -> None:
    """A line of the driver's on the console (rich markup), prefixed `rlbridge`."""
    console.print(f"[dim]rlbridge[/] {msg}")


def log_plain(text: str) -> None:
    """`log` for text that is not markup: it may quote paths and worker log lines, whose brackets rich would
    read as tags ("[W1201 ... utils.cpp:68]")."""
    log(escape(text))


Watch = Callable[[str], AbstractContextManager[None]]
"""Something that watches one run of a phase: rlbridge.run.stalls.StallWatch."""


class Timer:
    """Seconds per phase of one step: `with timer("generate"): ...`; a watch (run/stalls.StallWatch), if given,
    watches each phase."""

    def __init__(self, watch: Watch | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self.watch = watch

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            with self.watch(phase) if self.watch is not None else nullcontext():
                yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class JsonlSink:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps({k: _clean(v) for k, v in record.items()}, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class ConsoleSink:
    def __init__(self, total_steps: int, config: dict[str, Any] | None = None) -> None:
        from rlbridge.metrics.evals import eval_columns

        self.total_steps = total_steps
        self.evals = eval_columns(config)
        """The recipe's eval.metrics, printed in an eval record's line."""

    def write(self, record: dict[str, Any]) -> None:
        if record.get("kind") == "eval":
            console.print(_eval_line(record, self.evals))
            return
        console.print(_line(record, self.total_steps))

    def close(self) -> None:
        pass


def make_sink(
    logger: str,
    run_dir: Path,
    *,
    name: str,
    config: dict[str, Any] | None,
    history: list[dict[str, Any]] | None = None,
    wandb: WandbCfg | None = None,
) -> Sink:
    """The sink of one optional logger (imports its library). history: the records of metrics.jsonl so far (a
    resumed run): TensorBoard purges the steps after them and W&B rewinds to them, with the libraries' own
    resume features (see metrics/tensorboard.py, metrics/wandb.py). wandb: run.wandb (project, entity, name,
    tags)."""
    if logger == "tensorboard":
        from rlbridge.metrics.tensorboard import TensorBoardSink

        tb = run_dir / "logs" / "tensorboard"
        resumed = bool(history) and any(tb.glob("events.out.tfevents.*"))
        last = max(int(r.get("step", 0)) for r in history) if history else 0
        return TensorBoardSink(tb, purge_step=last + 1 if resumed else None)
    if logger == "wandb":
        from rlbridge.metrics.wandb import WandbSink

        return WandbSink(
            run_dir / "logs",
            name=name,
            config=config or {},
            history=history,
            cfg=wandb,
            warn=lambda msg: console.print(f"[yellow]{escape(msg)}[/]"),
        )
    raise ValueError(f"unknown logger {logger!r}")


def _read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl (empty when there is none; a torn line is skipped)."""
    out = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and "step" in record:
                out.append(record)
    return out


class MetricsLog:
    """Fans every record out to metrics.jsonl (always) and the loggers the recipe selects."""

    def __init__(
        self,
        run_dir: Path,
        loggers: Sequence[str],
        total_steps: int,
        *,
        name: str = "",
        config: dict[str, Any] | None = None,
        wandb: WandbCfg | None = None,
    ) -> None:
        """wandb: run.wandb (where the wandb logger files the run)."""
        self.path = run_dir / "metrics.jsonl"
        history = _read_records(self.path)  # a resumed run's records so far (cut back to its checkpoint)
        self.history: list[dict[str, Any]] = history
        """The records metrics.jsonl held at start: a resumed run's steps so far (empty for a new run)."""
        self.sinks: dict[str, Sink] = {"jsonl": JsonlSink(self.path)}
        if "console" in loggers:
            self.sinks["console"] = ConsoleSink(total_steps, config)
        for logger in loggers:
            if logger not in self.sinks:
                self.sinks[logger] = make_sink(
                    logger, run_dir, name=name or run_dir.name, config=config, history=history, wandb=wandb
                )

    def write(self, record: dict[str, Any]) -> None:
        for key, sink in list(self.sinks.items()):
            if key == "jsonl":
                sink.write(record)
                continue
            try:
                sink.write(record)
            except Exception as e:  # a logger never stops a run: the jsonl file has every step
                console.print(
                    f"[yellow]warning[/] the {key} logger failed and is turned off for this run: {e!r}"
                )
                self.sinks.pop(key)

    def close(self) -> None:
        for key, sink in reversed(list(self.sinks.items())):
            try:
                sink.close()
            except Exception as e:
                console.print(f"[yellow]warning[/] closing the {key} logger failed: {e!r}")


def _fmt(record: dict[str, Any], key: str, label: str, spec: str = ".3f") -> str:
    value = record.get(key)
    return f"{label} {value:{spec}}" if isinstance(value, (int, float)) else ""


def _eval_line(r: dict[str, Any], columns: Sequence[Any]) -> str:
    """An eval record's line: the recipe's eval.metrics (metrics.evals.EvalColumn) in their order, then any other
    eval_ number of the record."""
    shown = [c for c in columns if isinstance(r.get(c.key), (int, float))]
    named = {c.key for c in shown}
    parts = [f"{c.label} {c.show(r[c.key])}" for c in shown] + [
        f"{k.removeprefix('eval_')} {v:.3f}"
        for k, v in r.items()
        if k.startswith("eval_") and k not in named and k != "eval_samples" and isinstance(v, (int, float))
    ]
    return (
        f"[bold cyan]eval[/] step {r['step']}: {', '.join(parts)} on {r.get('eval_samples', 0):.0f} prompts"
    )


def _line(r: dict[str, Any], total: int) -> str:
    if r.get("kind") == "checkpoint":
        return (
            f"[bold green]saved[/] step {r['step']}: {r.get('path')} ({r.get('checkpoint_bytes', 0) / 1e6:.1f} MB "
            f"in {r.get('time_save', 0):.2f} s)"
        )
    if r.get("kind") == "eval":
        return _eval_line(r, [])
    phases = " ".join(
        f"{k.removeprefix('time_')} {v:.1f}"
        for k, v in r.items()
        if k.startswith("time_") and k != "time_step"
    )
    parts = [
        f"[bold]step {r['step']}/{total}[/]",
        _fmt(r, "reward_mean", "reward"),
        _fmt(r, "accuracy", "acc", ".2f"),
        _fmt(r, "kl", "kl", ".4f"),
        _fmt(r, "entropy", "ent", ".2f"),
        _fmt(r, "grad_norm", "|g|", ".3f"),
        _fmt(r, "logprob_diff_mean", "lp-diff", ".1e"),
        _fmt(r, "rc_ess", "ess", ".2f"),
        _fmt(r, "time_step", "", ".1f") + "s",
        f"[dim]({phases})[/]",
    ]
    if r.get("reward_error"):
        parts.append(f"[red]reward errors {r['reward_error']}[/]")
    return "  ".join(p for p in parts if p)
