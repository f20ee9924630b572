"""Benchmark output: one JSON document on stdout plus a markdown table, and a dated copy under bench/results/."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


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
