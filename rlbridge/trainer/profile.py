"""A torch profile of one trainer update, for finding where its seconds go (off unless the environment asks).

    RLBRIDGE_PROFILE_UPDATE=DIR        profile the 3rd update of each trainer process (shapes seen, caches warm)
    RLBRIDGE_PROFILE_UPDATE=DIR#N      ... the Nth update

Ray forwards RLBRIDGE_* variables to the workers. The profiled update writes, into DIR (created):

- `update-N-<pid>.txt`: the update's wall seconds, the device's busy seconds (the sum of its kernels' times: far
  below the wall time means the host is the bound), the labelled spans of the update (`rlbridge.*`: the train
  step, each pass's forward and backward, the optimizer, the loss inputs and correction metrics, the memory
  hand-over) and the operator tables by device time and by host time;
- `update-N-<pid>.json.gz`: the trace, for chrome://tracing or ui.perfetto.dev.

The profiler costs host time of its own (the spans read slower than unprofiled), so it is for finding where
time goes, not for the step times a benchmark reports. docs/monitoring.md#profiling-an-update.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from rlbridge.errors import RlbridgeError

PROFILE_ENV = "RLBRIDGE_PROFILE_UPDATE"
DEFAULT_UPDATE = 3
SPAN_PREFIX = "rlbridge."
TABLE_ROWS = 30
DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
"""The chrome trace's categories of device work (torch.profiler's kineto export)."""


def parse(value: str) -> tuple[Path, int] | None:
    """`DIR` or `DIR#N` -> (DIR, N); an empty value -> None."""
    value = value.strip()
    if not value:
        return None
    where, _, nth = value.partition("#")
    if not where or (nth and (not nth.isdigit() or int(nth) < 1)):
        raise RlbridgeError(
            f"{PROFILE_ENV}={value!r}: expected DIR or DIR#N (N >= 1, the update to profile; default "
            f"{DEFAULT_UPDATE})"
        )
    return Path(where), int(nth) if nth else DEFAULT_UPDATE


class UpdateProfiler:
    """Counts this process's updates and profiles the one RLBRIDGE_PROFILE_UPDATE names (`around`)."""

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        self.target = parse((os.environ if environ is None else environ).get(PROFILE_ENV, ""))
        self.count = 0
        self.written: Path | None = None

    @contextlib.contextmanager
    def around(self) -> Iterator[None]:
        """Wraps one update: profiles it when it is the one asked for, else does nothing."""
        self.count += 1
        if self.target is None or self.count != self.target[1]:
            yield
            return
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            began = time.perf_counter()
            yield
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - began
        self.written = _write(prof, self.target[0], self.count, wall, cuda)


class _Profiled(Protocol):
    profiler: UpdateProfiler


S = TypeVar("S", bound=_Profiled)
P = ParamSpec("P")
R = TypeVar("R")


def profiled(method: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
    """Runs each call of `method` inside its object's `profiler.around()` (an UpdateProfiler)."""

    @functools.wraps(method)
    def call(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with self.profiler.around():
            return method(self, *args, **kwargs)

    return call


def _write(prof: profile, where: Path, nth: int, wall: float, cuda: bool) -> Path:
    """The gzipped trace and the text summary (module docstring); returns the text file's path."""
    where.mkdir(parents=True, exist_ok=True)
    stem = where / f"update-{nth}-{os.getpid()}"
    raw = stem.with_suffix(".json")
    prof.export_chrome_trace(str(raw))  # torch writes the trace to a file only
    data = raw.read_bytes()
    raw.unlink()
    Path(f"{raw}.gz").write_bytes(gzip.compress(data))
    trace = json.loads(data)
    averages = prof.key_averages()
    spans = sorted(
        (e for e in averages if e.key.startswith(SPAN_PREFIX) and e.device_type == DeviceType.CPU),
        key=lambda e: -e.cpu_time_total,
    )
    busy = device_busy_s(trace)
    lines = [
        f"update {nth} (pid {os.getpid()}): {wall:.3f} s wall"
        + (f", device busy {busy:.3f} s ({100 * busy / wall:.0f} %)" if cuda else ""),
        "",
        "spans (host wall seconds, total over their calls):",
    ]
    lines += [f"  {e.key:<32} {e.cpu_time_total / 1e6:8.3f} s  x{e.count}" for e in spans]
    if cuda:
        lines += [
            "",
            "by device time:",
            averages.table(sort_by="self_device_time_total", row_limit=TABLE_ROWS),
        ]
    lines += ["", "by host time:", averages.table(sort_by="self_cpu_time_total", row_limit=TABLE_ROWS)]
    text = stem.with_suffix(".txt")
    text.write_text("\n".join(lines) + "\n")
    return text


def device_busy_s(trace: dict[str, Any]) -> float:
    """Seconds the device spent in kernels, copies and memsets: the sum of those events' durations in a chrome
    trace (one stream's kernels do not overlap; the annotations of the spans, which span them, are left out)."""
    events = trace.get("traceEvents", [])
    return sum(float(e.get("dur", 0)) for e in events if e.get("cat") in DEVICE_WORK) / 1e6
