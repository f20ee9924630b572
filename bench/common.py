"""Benchmark output: one JSON document on stdout plus a markdown table, and a dated copy under bench/results/;
and `rlbridge train` as a child process for the benchmarks that time whole runs."""

from __future__ import annotations

import collections
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parents[1]


PROGRESS = (
    "step ",
    "done ",
    "eval step",
    "rlbridge rollout: vLLM engine up",
    "rlbridge trainer: model loaded",
)
"""Lines of a child `rlbridge train` echoed as they come: a benchmark cut by a deadline still shows how far it got."""


LOG_TAIL_BYTES = 200_000


def keep_log(src: Path, dst: Path) -> None:
    """The last LOG_TAIL_BYTES of a log, copied flat (a device call brings back only shallow files)."""
    if src.exists():
        data = src.read_bytes()
        dst.write_bytes(data[-LOG_TAIL_BYTES:])


def rlbridge_train(recipe: str, run_dir: Path, sets: list[str]) -> float:
    """`rlbridge train RECIPE --run-dir RUN_DIR --set ...` in a child process; its wall seconds. Progress lines
    (PROGRESS) go to stderr as they come; a failed run ends the benchmark with the run's last output."""
    args = [sys.executable, "-m", "rlbridge", "train", recipe, "--run-dir", str(run_dir)]
    for s in sets:
        args += ["--set", s]
    start = time.perf_counter()
    tail: collections.deque[str] = collections.deque(maxlen=200)
    env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    with subprocess.Popen(
        args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    ) as child:
        assert child.stdout is not None
        for line in child.stdout:
            tail.append(line)
            if line.startswith(PROGRESS):
                print(f"  [{run_dir.name}] {line.rstrip()}", file=sys.stderr, flush=True)
    if child.returncode != 0:
        raise SystemExit(f"rlbridge train failed ({child.returncode}):\n{''.join(tail)[-4000:]}")
    return time.perf_counter() - start


def one_rank_group(cuda: bool, timeout_s: float | None = None) -> None:
    """A one-process torch.distributed group on a free local port (NCCL on GPU 0, gloo on the CPU), as the
    megatron engine needs even on one rank."""
    import socket
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    if cuda:
        torch.cuda.set_device(0)
    extra = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, **extra
    )


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def report(
    name: str, result: dict[str, Any], rows: list[dict[str, Any]], *, save: bool = True
) -> dict[str, Any]:
    """Prints the result document (JSON) and the table, saves a dated copy with `save`; returns the document."""
    doc = {
        "benchmark": name,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine(),
        **result,
        "rows": rows,
    }
    print(json.dumps(doc, indent=2))
    table = markdown(rows)
    print("\n" + table)
    if save:
        RESULTS.mkdir(exist_ok=True)
        stamp = time.strftime("%Y-%m-%d")
        (RESULTS / f"{name}-{stamp}.json").write_text(json.dumps(doc, indent=2) + "\n")
        (RESULTS / f"{name}-{stamp}.md").write_text(
            f"# {name} ({doc['machine']['date']})\n\n`{doc['command']}`\n\n{table}\n"
        )
    return doc


def markdown(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    cols = list(rows[0])
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)
