"""Stalls: a phase of a step that runs far longer than it used to gets a warning with its likely cause, and
past a hard limit the run stops with the resume command.

A run that is merely slow and a run that is stuck look the same from the driver: it waits on a worker. So
when a phase (generate, reward, update, sync, eval, checkpoint, ...) has run `run.health.stall_factor` times
the median of its earlier runs (and at least `stall_floor_s`), `StallWatch` measures instead of guessing:

    CPU      the machine's load average against its cores, and the CPU seconds per second each part of the
             run used since the phase began (read from /proc: the driver's process tree, i.e. the Ray actors,
             vLLM's engine, the reward workers; on Linux, local clusters)
    GPU      other programs' processes on the GPUs (`nvidia-smi`, where it exists)

and names the likely cause: CPU contention (load above the cores while the run gets a fraction of them), GPU
contention (someone else's process on the GPUs), a hung reward function / worker / dead peer (the run's
workers use no CPU at all), or more work than before (they compute at full speed). The warning repeats after
each further such stretch. Once the phase has also run `stall_stop_s`, the run stops: the watcher thread
signals the main thread (SIGALRM), whose handler raises `StallError` where Python waits (the reward pool's
poll), and kills the run's Ray actors (`on_stop`), which ends a wait inside Ray's get() (there the driver runs
no Python signal handler: seen with Ray 2.60); any error that follows is reported as the StallError. The
session then stops everything else and the CLI prints the newest complete checkpoint and `rlbridge resume RUN`.
Nothing already saved is touched. A phase's first run (warm-up included) has nothing to compare with and is
not watched.
"""

from __future__ import annotations

import os
import signal
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from rlbridge import faults
from rlbridge.errors import RlbridgeError
from rlbridge.run.gpu_faults import nvidia_smi

IDLE_CORES = 0.05
"""The run's workers together below this many cores over a stretch: nothing computes, they wait."""
HINTS = {
    "reward": "a hung reward function (reward.timeout_s bounds one sample; its output: logs/reward.log)",
    "generate": "a hung rollout worker (logs/rollout.log)",
    "rollout_wait": "a hung rollout worker (logs/rollout.log); rollout.mode async waits here for the weight loads and "
    "generations sent earlier",
    "eval": "a hung rollout worker or reward function (logs/rollout.log, logs/reward.log)",
    "checkpoint": "slow or stuck storage under the run directory, or a hung trainer (logs/trainer*.log)",
}
"""What a phase whose workers sit idle most likely waits on; other phases: a stuck trainer or a dead peer."""


class StallError(RlbridgeError):
    """A phase ran past run.health.stall_stop_s while stalled; the run stops (resumable)."""


# ------------------------------------------------------------------------------------------- measuring
@dataclass(frozen=True)
class CpuSample:
    """CPU seconds used so far per part of the run ("driver", "VllmRollout", "reward workers", "Ray", ...)."""

    time: float
    seconds: dict[str, float]
    pids: frozenset[int]


def _stat(pid: str) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds) of /proc/PID/stat."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / tick


def _label(pid: int, root: int) -> str | None:
    """The part of the run a process is, when it is one by itself (a Ray actor, a reward worker, Ray's own)."""
    if pid == root:
        return "driver"
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    if cmd.startswith("ray::"):
        name = cmd[5:].split()[0].split(".")[0] if len(cmd) > 5 else ""
        return "Ray" if name in ("", "IDLE", "DashboardAgent", "RuntimeEnvAgent") else name
    if "worker_main" in cmd:
        return "reward workers"
    if any(k in cmd for k in ("gcs_server", "raylet", "ray/_private", "ray/dashboard", "ray/autoscaler")):
        return "Ray"
    return None


def sample_cpu(root: int | None = None) -> CpuSample | None:
    """CPU seconds of `root` (default: this process) and every process under it, grouped by part; each process
    counts towards its nearest labelled ancestor (vLLM's engine core towards the rollout actor). None where
    /proc is missing."""
    root = os.getpid() if root is None else root
    if not Path("/proc/self/stat").exists():
        return None
    stats: dict[int, tuple[int, float]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (st := _stat(entry.name)) is not None:
            stats[int(entry.name)] = st
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    out: dict[str, float] = {}
    pids: set[int] = set()
    todo = [(root, "driver")]
    while todo:
        pid, part = todo.pop()
        if pid not in stats:
            continue
        part = _label(pid, root) or part
        pids.add(pid)
        out[part] = out.get(part, 0.0) + stats[pid][1]
        todo += [(c, part) for c in children.get(pid, [])]
    return CpuSample(time.monotonic(), out, frozenset(pids))


def cpu_rates(before: CpuSample, after: CpuSample) -> dict[str, float]:
    """Cores each part used between two samples (CPU seconds per second; processes gone in between drop out)."""
    wall = max(after.time - before.time, 1e-9)
    return {k: max(0.0, v - before.seconds.get(k, 0.0)) / wall for k, v in after.seconds.items()}


def gpu_others(run_pids: frozenset[int], *, query: Callable[[], str | None] | None = None) -> list[str]:
    """Compute processes on the GPUs that are not the run's: ["pid 123 python 20480 MiB", ...] (empty without
    nvidia-smi). `query` returns nvidia-smi's CSV (tests pass their own)."""
    text = (query or _nvidia_smi)()
    out = []
    for line in (text or "").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit() and int(parts[0]) not in run_pids:
            out.append(f"pid {parts[0]} {Path(parts[1]).name} {parts[2]} MiB")
    return out


def _nvidia_smi() -> str | None:
    return nvidia_smi("--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader,nounits")


def likely_cause(
    phase: str,
    rates: dict[str, float] | None,
    *,
    load: float | None,
    cores: int,
    gpu: list[str],
) -> str:
    """One sentence: what was measured and what it most likely means (see the module docstring)."""
    facts = []
    if load is not None:
        facts.append(f"load average {load:.1f} on {cores} cores")
    work = None
    if rates is not None:
        work = sum(v for k, v in rates.items() if k not in ("driver", "Ray"))
        shown = ", ".join(
            f"{k} {v:.2f}"
            for k, v in sorted(rates.items(), key=lambda kv: -kv[1])
            if v >= 0.005 or k not in ("driver", "Ray")  # the workers always, idle ones too
        )
        facts.append(f"the run's processes used {shown or 'no CPU'} cores since the phase began")
    if gpu:
        facts.append(f"other processes on the GPUs: {'; '.join(gpu[:4])}")
    measured = f" ({'; '.join(facts)})" if facts else ""
    if gpu:
        cause = "GPU contention: another program's processes run on the GPUs"
    elif work is not None and work < IDLE_CORES:
        cause = f"the run's workers compute nothing, they wait: {HINTS.get(phase, 'a stuck trainer or a dead peer (a rank or node that stopped answering; cluster.collective_timeout_s bounds a multi-rank call)')}"
    elif load is not None and load > cores:
        cause = "CPU contention: other programs compete with the run for the cores"
    elif work is not None:
        cause = "the workers compute at full speed: the phase has more work than before (longer responses?)"
    else:
        cause = "unknown (no /proc here to measure the run's processes)"
    return f"likely cause: {cause}{measured}"


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# ------------------------------------------------------------------------------------------- watching
class StallWatch:
    """Per phase: the history of its durations, a watcher thread while it runs (see the module docstring).

    `with watch("reward"): ...` times and watches one run of a phase. `with watch.armed(): ...` (the step loop,
    main thread) lets a stall past `stop_s` stop the run there; outside it, and off the main thread, stalls
    only warn."""

    def __init__(
        self,
        warn: Callable[[str], None],
        *,
        hint: str = "",
        factor: float = 5.0,
        floor_s: float = 60.0,
        stop_s: float | None = None,
        resume: str = "",
        measure: Callable[[str, CpuSample | None], str] | None = None,
    ) -> None:
        """resume: the text after the stop's message (the resume command comes from the CLI). measure: (phase,
        the CPU sample at its start) -> the likely-cause sentence (tests pass their own)."""
        self.warn, self.hint, self.factor, self.floor_s, self.stop_s = warn, hint, factor, floor_s, stop_s
        self.measure = measure or self._measure
        self.history: dict[str, deque[float]] = {}
        self.stalled: str | None = None
        """The stop's message once a phase passed stop_s (the SIGALRM handler raises it)."""
        self.on_stop: Callable[[], None] | None = None
        """Called by the watcher thread when it stops the run (the session kills its Ray actors: a driver
        waiting inside Ray's get() does not run Python signal handlers, so the wait must end from the other
        side)."""
        self._armed = False
        self._stopping = False

    def limit(self, phase: str) -> tuple[float, float] | None:
        """(usual seconds, seconds after which the phase counts as slow), or None before its first run."""
        past = self.history.get(phase)
        if not past:
            return None
        usual = statistics.median(past)
        return usual, max(self.factor * usual, self.floor_s)

    @contextmanager
    def armed(self) -> Iterator[StallWatch]:
        """Install the SIGALRM handler that raises StallError in the main thread once a phase passed stop_s."""
        if threading.current_thread() is not threading.main_thread() or self.stop_s is None:
            yield self
            return
        previous = signal.signal(signal.SIGALRM, self._on_alarm)
        self._armed = True
        try:
            yield self
        except Exception as e:
            # After a stop every failure is the stall's: the workers killed by on_stop ("trainer worker died"),
            # or the StallError itself, which Ray's get() may wrap ("SystemError: ... returned a result with an
            # exception set", Ray 2.60). The user gets the stall's message.
            if isinstance(e, StallError) or not self._stopping or self.stalled is None:
                raise
            raise StallError(self.stalled) from None
        finally:
            self._armed = False
            # a watcher thread's alarm may still be on its way: under SIG_DFL it would kill the process
            signal.signal(signal.SIGALRM, signal.SIG_IGN if previous == signal.SIG_DFL else previous)

    def _on_alarm(self, signum: int, frame: FrameType | None) -> None:
        if self.stalled is not None:
            raise StallError(self.stalled)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        limit, done = self.limit(phase), threading.Event()
        start = time.perf_counter()
        if limit is not None:
            threading.Thread(
                target=self._watch,
                args=(phase, *limit, start, done),
                daemon=True,
                name=f"rlbridge-stall-{phase}",
            ).start()
        faults.trace("start", phase)
        try:
            yield
        finally:
            done.set()
            self.history.setdefault(phase, deque(maxlen=50)).append(time.perf_counter() - start)
            faults.trace("end", phase)

    def _watch(
        self,
        phase: str,
        usual: float,
        limit: float,
        start: float,
        done: threading.Event,
    ) -> None:
        begin = sample_cpu()  # here, not in the main thread: a /proc scan per phase would slow every step
        waited = limit
        stop_at = None if self.stop_s is None else max(self.stop_s, limit)
        while True:
            nxt = waited if stop_at is None else min(waited, stop_at)
            if done.wait(max(0.0, start + nxt - time.perf_counter())):
                return
            ran = time.perf_counter() - start
            what = (
                f"{phase} is stalled: running for {ran:.0f} s, {ran / max(usual, 1e-9):.0f}x its median of "
                f"{usual:.2g} s in earlier steps (run.health.stall_factor {self.factor:g}); "
                f"{self.measure(phase, begin)}"
            )
            if stop_at is not None and ran >= stop_at:
                self.stalled = (
                    f"{what}. Stopped after run.health.stall_stop_s {self.stop_s:g} s (the last complete "
                    "checkpoint is untouched)"
                )
                if self._armed and not done.is_set():
                    self._stopping = True
                    signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGALRM)
                    if self.on_stop is not None:
                        try:
                            self.on_stop()
                        except Exception as e:  # the main thread's handler still stops the run
                            self.warn(f"stopping the workers after the stall failed: {e!r}")
                    return
                stop_at = None  # not armed: warn only
            self.warn(f"{what}{self.hint}")
            if ran >= waited:
                waited += limit

    def _measure(self, phase: str, begin: CpuSample | None) -> str:
        now = sample_cpu()
        rates = cpu_rates(begin, now) if begin is not None and now is not None else None
        return likely_cause(
            phase,
            rates,
            load=_load(),
            cores=_cores(),
            gpu=gpu_others(now.pids if now is not None else frozenset()),
        )


def from_recipe(health: Any, warn: Callable[[str], None], *, hint: str = "") -> StallWatch:
    """The StallWatch of run.health (stall_factor, stall_floor_s, stall_stop_s)."""
    return StallWatch(
        warn, hint=hint, factor=health.stall_factor, floor_s=health.stall_floor_s, stop_s=health.stall_stop_s
    )
