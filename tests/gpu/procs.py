"""`python -m rlbridge ...` as a subprocess whose every process can be found again, to kill it or to prove that
none is left (the GPU suite's CLI runs and its kill -9 test).

A run starts in its own session (its pid is its process group id) with a unique tag in its environment, which
every process of the run inherits (Ray's gcs_server, raylet and workers, vLLM, reward workers) and which
survives re-parenting to init. Ray's agents overwrite their environment with their process title, so the
driver's descendants are also recorded every half second while the run is waited on (pid + start time, so a
reused pid is not mistaken for one of ours). Same idea as tests/reliability/test_worker_death.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from bench.proctree import describe
from tests.gpu.common import ROOT, subprocess_env

TAG = "RLBRIDGE_GPU_TEST_TAG"


@dataclass
class Run:
    proc: subprocess.Popen[bytes]
    tag: str
    log: Path
    started: float
    seen: dict[int, float] = field(default_factory=dict)
    """pid -> create_time of every process seen under the driver."""

    def snapshot(self) -> None:
        try:
            root = psutil.Process(self.proc.pid)
            for p in [root, *root.children(recursive=True)]:
                self.seen.setdefault(p.pid, p.create_time())
        except psutil.NoSuchProcess:
            pass

    def wait(self, timeout: float, until: object = None) -> int | None:
        """Wait for the exit (returns the code) or for `until()` to be true or the timeout (returns None)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.snapshot()
            rc = self.proc.poll()
            if rc is not None:
                return rc
            if callable(until) and until():
                return None
            time.sleep(0.5)
        return self.proc.poll()

    def leftovers(self) -> list[psutil.Process]:
        """Live processes of the run (zombies aside): seen under the driver, or carrying its tag."""
        found: dict[int, psutil.Process] = {}
        for pid, created in self.seen.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                    found[pid] = p
            except psutil.NoSuchProcess:
                pass
        for p in psutil.process_iter():
            try:
                if (
                    p.pid not in found
                    and p.status() != psutil.STATUS_ZOMBIE
                    and p.environ().get(TAG) == self.tag
                ):
                    found[p.pid] = p
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return list(found.values())

    def kill(self) -> None:
        """kill -9 of the process group and of every process of the run; waits for them."""
        self.snapshot()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        procs = self.leftovers()
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        psutil.wait_procs(procs, timeout=30)

    def gone_within(self, seconds: float) -> list[str]:
        """Wait until no process of the run is left; returns the ones still there after `seconds`."""
        deadline = time.monotonic() + seconds
        while True:
            left = self.leftovers()
            if not left or time.monotonic() > deadline:
                return describe(left)
            time.sleep(0.5)

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.is_file() else ""


def start(args: list[str], log: Path, **env: str) -> Run:
    """`python -m rlbridge ARGS` in a session of its own, output appended to `log`."""
    tag = uuid.uuid4().hex
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "rlbridge", *args], cwd=ROOT, env=subprocess_env(**{TAG: tag}, **env),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    return Run(proc, tag, log, time.monotonic())


def run(args: list[str], log: Path, timeout: float, **env: str) -> tuple[int | None, float, list[str]]:
    """Start, wait, and clean up: (exit code or None on a timeout, seconds, processes that outlived the driver
    by more than 30 s and had to be killed)."""
    r = start(args, log, **env)
    rc = r.wait(timeout)
    seconds = time.monotonic() - r.started
    left = r.gone_within(30.0) if rc is not None else []
    r.kill()
    return rc, seconds, left
