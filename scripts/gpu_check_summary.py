"""Markdown summary of a GPU check: every test's outcome and time (junit xml) and every measured figure
(`GPU_FIGURE {...}` lines / gpu_figures.jsonl), for bench/results/gpu_check-DATE.md.

    python scripts/gpu_check_summary.py OUT_DIR [OUT_DIR ...] [--part 1] > bench/results/gpu_check-2026-12-02.md

Each OUT_DIR is what one `bash scripts/gpu_check.sh PART` call left under $OUT (gpu_check.xml, gpu_check.log,
gpu_figures.jsonl, versions.txt). Files may also be given directly. Figures are read from gpu_figures.jsonl
when present, else from the log's GPU_FIGURE lines; repeats are dropped. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

PREFIX = "GPU_FIGURE "


def read_junit(path: Path) -> list[dict[str, Any]]:
    rows = []
    root = ET.parse(path).getroot()
    for case in root.iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[tag]
                message = (
                    (node.get("message") or node.text or "").strip().splitlines()[0][:160]
                    if (node.get("message") or node.text)
                    else ""
                )
                break
        name = case.get("name", "?")
        module = (case.get("classname") or "").rsplit(".", 1)[-1]
        rows.append(
            {
                "test": f"{module}::{name}",
                "outcome": outcome,
                "seconds": float(case.get("time") or 0.0),
                "message": message,
            }
        )
    return rows


def read_figures(paths: list[Path]) -> list[dict[str, Any]]:
    seen: set[str] = set()
    out: list[dict[str, Any]] = []
    for path in paths:
        for line in path.read_text(errors="replace").splitlines():
            text = (
                line[line.index(PREFIX) + len(PREFIX) :]
                if PREFIX in line
                else (line if path.suffix == ".jsonl" else "")
            )
            text = text.strip()
            if not text or text in seen:
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError:
                continue
            seen.add(text)
            out.append(record)
    return out


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else f"{value:.3g}"
    if isinstance(value, list):
        return "[" + ", ".join(fmt(v) for v in value) + "]"
    return str(value).replace("|", "\\|")


def collect(args: list[str]) -> tuple[list[Path], list[Path], list[Path]]:
    xmls, figures, versions = [], [], []
    for arg in args:
        p = Path(arg)
        if p.is_dir():
            xmls += sorted(p.glob("*.xml"))
            jsonl = sorted(p.glob("gpu_figures*.jsonl"))
            figures += jsonl or sorted(p.glob("gpu_check*.log"))
            versions += sorted(p.glob("versions*.txt"))
        elif p.suffix == ".xml":
            xmls.append(p)
        elif p.suffix in (".jsonl", ".log"):
            figures.append(p)
        elif p.suffix == ".txt":
            versions.append(p)
    return xmls, figures, versions


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", help="$OUT directories of gpu_check.sh calls, or their files")
    ap.add_argument("--part", default=None, help="label for the heading")
    args = ap.parse_args()
    xmls, figure_files, versions = collect(args.paths)
    lines = [f"# GPU check{f' (part {args.part})' if args.part else ''}", ""]
    for v in versions:
        lines += ["```", v.read_text(errors="replace").strip(), "```", ""]
    tests = [row for x in xmls for row in read_junit(x)]
    if tests:
        counts: dict[str, int] = {}
        for t in tests:
            counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
        lines += [
            "## Tests",
            "",
            ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
            + f"; {sum(t['seconds'] for t in tests):.0f} s in all",
            "",
            "| test | outcome | s | message |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| `{t['test']}` | {t['outcome']} | {t['seconds']:.1f} | {fmt(t['message'])} |" for t in tests
        ]
        lines.append("")
    else:
        lines += ["No junit xml found (pytest cut off before it wrote its report?).", ""]
    figures = read_figures(figure_files)
    if figures:
        lines += ["## Figures", "", "| figure | device | values |", "|---|---|---|"]
        for f in figures:
            values = ", ".join(f"{k}={fmt(v)}" for k, v in f.items() if k not in ("figure", "device"))
            lines.append(f"| {f.get('figure')} | {f.get('device')} | {values} |")
        lines.append("")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
