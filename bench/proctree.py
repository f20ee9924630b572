"""Measuring helpers shared by the benchmarks: peak memory of a process tree, file arrival times, load.

`TreeMemory` samples (every second) a process and all its descendants (Ray's raylet, GCS and workers, vLLM's engine
process, reward workers...) from a thread and keeps the peak of the *sum* over the tree, twice:
RSS (what `top` shows; counts shared pages, e.g. Ray's object store and the model file mapped by several
processes, once per process) and PSS (shared pages split between the processes that map them: the sum is
the tree's real footprint). Both peaks are reported; compare tools by the same one.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import psutil

GIB = 1024**3


def describe(procs: list[psutil.Process]) -> list[str]:
    """'PID command line' per process (for messages about processes left running); '(gone)' for one that ended."""
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            out.append(f"{p.pid} (gone)")
    return out


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


class TreeMemory:
    """Peak RSS and PSS summed over `pid` and its descendants, sampled every `interval` seconds.
    RLBRIDGE_BENCH_PSS=0 skips PSS (psutil reads /proc/PID/smaps, which holds the process's memory-map lock
    while it walks every mapping: suspected of slowing a large, allocating process, trl_grpo-cpu-2026-12-02.md)."""

    def __init__(self, pid: int, interval: float = 1.0) -> None:
        self.root = psutil.Process(pid)
        self.interval = interval
        self.pss = os.environ.get("RLBRIDGE_BENCH_PSS", "1") != "0"
        self.peak_rss = 0
        self.peak_pss = 0
        self.peak_procs = 0
        self.samples = 0
        self.timeline: list[tuple[float, float, float]] = []
        """(time, CPU seconds used so far by every process ever seen in the tree, 1-minute load average)"""
        self._cpu: dict[tuple[int, float], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> TreeMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> None:
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            return
        infos = []
        for p in procs:
            try:
                with p.oneshot():
                    infos.append((p, p.memory_info().rss, p.cpu_times(), (p.pid, p.create_time())))
            except psutil.Error:
                continue
        rss = sum(x[1] for x in infos)
        for _, _, cpu, key in infos:
            self._cpu[key] = cpu.user + cpu.system  # a process that exits keeps its last reading
        # PSS reads smaps_rollup (~6 ms of CPU per process with a large mapping, RSS ~0.02 ms): at a new
        # RSS peak and every 10th sample only, so that the sampler itself costs < 1% of a core
        if self.pss and (rss > self.peak_rss or self.samples % 10 == 0):
            pss = 0
            for p, r, _, _ in infos:
                try:
                    pss += getattr(p.memory_full_info(), "pss", r)
                except psutil.Error:
                    pss += r
            self.peak_pss = max(self.peak_pss, pss)
        self.peak_rss = max(self.peak_rss, rss)
        self.timeline.append((time.time(), sum(self._cpu.values()), os.getloadavg()[0]))
        self.peak_procs = max(self.peak_procs, len(procs))
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def cpu_between(self, t0: float, t1: float) -> float:
        """CPU seconds the tree used between two wall-clock times (interpolated between samples)."""
        return _interp(self.timeline, t1) - _interp(self.timeline, t0)

    def load_between(self, t0: float, t1: float) -> float | None:
        """Mean 1-minute load average sampled between two wall-clock times."""
        loads = [x[2] for x in self.timeline if t0 <= x[0] <= t1]
        return round(sum(loads) / len(loads), 2) if loads else None

    def result(self) -> dict[str, Any]:
        return {
            "peak_rss_gib": round(self.peak_rss / GIB, 3),
            "peak_pss_gib": round(self.peak_pss / GIB, 3),
            "peak_processes": self.peak_procs,
            "memory_samples": self.samples,
        }


def _interp(timeline: list[tuple[float, float, float]], t: float) -> float:
    if not timeline:
        return 0.0
    if t <= timeline[0][0]:
        return timeline[0][1]
    for (ta, ca, _), (tb, cb, _) in zip(timeline, timeline[1:], strict=False):
        if ta <= t <= tb:
            return ca + (cb - ca) * (t - ta) / max(tb - ta, 1e-9)
    return timeline[-1][1]


class LineArrivals:
    """Wall-clock arrival time of each new line of a file that another process appends to (metrics.jsonl):
    with one line per step, the differences are the wall time per step, everything included. Polled every
    `interval` seconds (the times' resolution: 0.1 s before 2026-12-04, which put the GPU quickstart's ~0.3-0.4 s
    step medians on a 0.1 s grid), reading only the bytes appended since the last poll."""

    def __init__(self, path: Path, interval: float = 0.01) -> None:
        self.path, self.interval = path, interval
        self.lines: list[tuple[float, str]] = []
        self._offset = 0
        self._partial = b""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LineArrivals:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._poll()

    def _poll(self) -> None:
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                new = f.read()
        except OSError:
            return
        now = time.time()
        self._offset += len(new)
        *complete, self._partial = (self._partial + new).split(b"\n")  # the last piece is still being written
        for line in complete:
            self.lines.append((now, line.decode()))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._poll()
            self._stop.wait(self.interval)
