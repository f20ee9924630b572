"""A training file of millions of rows through rlbridge's data path: memory and time to open it, take the first
batch, and resume near the end (issue 46 item 2: "a 10 M-row file does not load into memory; the resume position
stays exact").

    python bench/data_rows.py                       # 10,000,000 rows, jsonl and parquet, in a temp dir under /tmp
    python bench/data_rows.py --rows 2000000 --dir /tmp/rows --keep

Writes gsm8k-like rows (`{"question": ..., "answer": ...}`, ~150 bytes; each question ends with its row number, so
a row read back can be checked to be the one asked for) as .jsonl and .parquet, then measures each case in a
fresh child process: the calls `Session._start` makes for data.train (`open_prompts`, the encoding step of
`Session._encode`, `PromptSampler` with the same arguments), the first batch as `collect.py` takes it
(`next_indices`, then `ids[i]` and `prompts[i]`), and a resume at a position near the end of the epoch as
`checkpointer.py` does it (`load_state` on a fresh sampler, then the next batch). Datasets' cache lives under the
directory, so the first open of each file (its conversion into Arrow) and a second, cached open are both timed.

Per phase: seconds, and the peak RSS of the child and its children (psutil, sampled every 20 ms), together with
its anonymous part (RSS minus file-backed shared pages: what memory-mapping does not explain) and the growth over
the child's RSS before the phase. The second open of each file goes through `loader: auto` (which picks datasets
for a file this large). `loader: memory` (.jsonl/.parquet read whole into Python objects, every prompt tokenized at
start: what auto does with a file up to 64 MiB) is measured on a file of --whole-rows rows only, where it fits; its
growth per row gives the figure at --rows.

The tokenizer is the tests' tiny word-level one (tests/fixtures/tiny_tokenizer.py): no model download; the
chat template is applied to every row tokenized, as a real tokenizer's would be.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BYTES_PER_ROW = 150
BATCH = 64
PREVIEW_ROWS = 8


WORDS = tuple("Natalia sold clips to of her friends in April and then she as many May How did sell".split())
"""The words of `row`'s text, added to the tiny word-level tokenizer's vocabulary."""


def row(i: int) -> dict[str, str]:
    """A gsm8k-like row (~150-175 bytes of JSON) whose question ends with its row number."""
    a, b = 10 + i % 89, 3 + i % 7
    return {
        "question": f"Natalia sold clips to {a} of her friends in April, and then she sold {b} times as many "
        f"in May. How many clips did she sell? #{i}",
        "answer": f"{a} * {b} = {a * b}. #### {a + a * b}",
    }


def write_files(directory: Path, rows: int, chunk: int = 500_000) -> dict[str, Path]:
    """rows.jsonl and rows.parquet of `rows` rows, written in chunks (memory ~ chunk)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl, parquet = directory / f"rows-{rows}.jsonl", directory / f"rows-{rows}.parquet"
    if not jsonl.exists() or not parquet.exists():
        writer = None
        with open(jsonl, "w") as f:
            for start in range(0, rows, chunk):
                batch = [row(i) for i in range(start, min(start + chunk, rows))]
                f.write("".join(json.dumps(r) + "\n" for r in batch))
                table = pa.Table.from_pylist(batch)
                writer = writer or pq.ParquetWriter(parquet, table.schema)
                writer.write_table(table)
        assert writer is not None
        writer.close()
    return {"jsonl": jsonl, "parquet": parquet}


# ---------------------------------------------------------------------------------------------- child process
class Peak:
    """Peak RSS (and its anonymous part) of this process and its children, sampled every 20 ms in a thread."""

    def __init__(self) -> None:
        import psutil

        self.me = psutil.Process()
        self.rss = self.anon = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def now(self) -> tuple[int, int]:
        rss = anon = 0
        for p in [self.me, *self.me.children(recursive=True)]:
            try:
                m = p.memory_info()
            except Exception:  # a child that ended between the listing and the read
                continue
            rss += m.rss
            anon += m.rss - m.shared
        return rss, anon

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(0.02)

    def sample(self) -> None:
        rss, anon = self.now()
        self.rss, self.anon = max(self.rss, rss), max(self.anon, anon)

    def __enter__(self) -> Peak:
        self.before = self.now()
        self.rss, self.anon = self.before
        self.t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0
        self._stop.set()
        self._thread.join()
        self.sample()

    def record(self) -> dict[str, float]:
        mib = 1024**2
        return {
            "s": round(self.seconds, 3),
            "peak_rss_mib": round(self.rss / mib, 1),
            "peak_anon_mib": round(self.anon / mib, 1),
            "grew_mib": round((self.rss - self.before[0]) / mib, 1),
            "anon_grew_mib": round((self.anon - self.before[1]) / mib, 1),
        }


def measure(path: str, loader: str, resume_at: float) -> dict[str, Any]:
    """One case, as the session opens data.train, in this (fresh) process."""
    from rlbridge.data.datasets import LazyEncoded, PromptSampler, encode_prompts, open_prompts, preview
    from rlbridge.recipe.schema import DataCfg
    from tests.fixtures.tiny_tokenizer import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(extra_words=WORDS)
    data = DataCfg.model_validate({"train": {"path": path, "loader": loader}, "batch_size": BATCH})
    out: dict[str, Any] = {}
    with Peak() as p:  # what validate-recipe reads
        rows, _ = preview(data.train, data, split="train", num_rows=PREVIEW_ROWS)
    out["preview"] = p.record()
    with Peak() as p:  # Session._start: open_prompts, then Session._encode
        source = open_prompts(data.train, data, split="train", seed=0)
        if isinstance(source, list):
            ids, kept, _ = encode_prompts(tokenizer, source, data, 512)
            prompts_seq: Any = kept
            ids_seq: Any = ids
            lazy = None
        else:
            lazy = LazyEncoded(source, tokenizer, data, 512)
            prompts_seq, ids_seq = lazy.prompts, lazy.ids

        def sampler() -> PromptSampler:
            return PromptSampler(
                prompts_seq,
                seed=0,
                shuffle=True,
                usable=None if lazy is None else lazy.usable_rows,
                fingerprint_of=None if lazy is None else lazy.source.fingerprint,
            )

        walk = sampler()
    out["open"] = p.record()
    out["read_as"] = "whole" if lazy is None else "datasets (memory-mapped)"
    out["rows"] = len(prompts_seq)
    with Peak() as p:  # collect.py: next_indices, then ids and prompts of those rows
        first = walk.next_indices(BATCH)
        first_ids = [ids_seq[i] for i in first]
        first_prompts = [prompts_seq[i] for i in first]
    out["first_batch"] = p.record()
    k = int(resume_at * len(prompts_seq))
    state = {**walk.state(), "epoch": 0, "index": k}  # a checkpoint's data position at row k of the order
    with Peak() as p:  # checkpointer.py: load_state on the resumed run's sampler, then the next batch
        resumed = sampler()
        resumed.load_state(json.loads(json.dumps(state)))
        batch = resumed.next_indices(BATCH)
        batch_prompts = [prompts_seq[i] for i in batch]
        _ = [ids_seq[i] for i in batch]
    out["resume"] = p.record()
    tail = [int(i) for i in walk.order(0)[k : k + BATCH]]  # the uninterrupted walk's rows k .. k+BATCH,
    want = tail + [int(i) for i in walk.order(1)[: BATCH - len(tail)]]  # into the next epoch's order
    out["resume_index"] = k
    out["resume_exact"] = batch == want and all(
        pr.text.endswith(f"#{i}") for i, pr in zip(batch, batch_prompts, strict=True)
    )
    out["first_batch_rows_right"] = (
        all(pr.text.endswith(f"#{i}") for i, pr in zip(first, first_prompts, strict=True))
        and len(first_ids) == BATCH
    )
    return out


# ---------------------------------------------------------------------------------------------- driver
def run_case(path: Path, loader: str, cache: Path, resume_at: float, timeout_s: float) -> dict[str, Any]:
    env = {
        **os.environ,
        "HF_DATASETS_CACHE": str(cache),
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(Path.cwd()),
    }
    cmd = [
        sys.executable,
        __file__,
        "--measure",
        str(path),
        "--loader",
        loader,
        "--resume-at",
        str(resume_at),
    ]
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    if done.returncode != 0:
        return {"error": done.stderr.strip()[-1500:]}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["child_s"] = round(time.perf_counter() - t0, 1)
    return result


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--whole-rows", type=int, default=1_000_000, help="rows for loader memory (read whole)")
    ap.add_argument(
        "--dir", type=Path, default=None, help="default: a temp dir under /tmp, removed at the end"
    )
    ap.add_argument("--keep", action="store_true", help="keep the files written")
    ap.add_argument("--resume-at", type=float, default=0.999, help="resume position, a fraction of the epoch")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--measure", help=argparse.SUPPRESS)
    ap.add_argument("--loader", default="datasets", help=argparse.SUPPRESS)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.loader, args.resume_at)))
        return
    from bench.common import report

    directory = args.dir or Path(tempfile.mkdtemp(prefix="data_rows-", dir="/tmp"))
    directory.mkdir(parents=True, exist_ok=True)
    need = args.rows * BYTES_PER_ROW * 4.5 + args.whole_rows * BYTES_PER_ROW * 2
    free = shutil.disk_usage(directory).free
    print(
        f"disk: about {need / 1e9:.1f} GB needed in {directory} (jsonl, parquet, and datasets' Arrow copy of "
        f"each); {free / 1e9:.1f} GB free",
        file=sys.stderr,
    )
    if free < need:
        sys.exit(f"not enough disk in {directory}: pass --dir elsewhere or fewer --rows")
    try:
        t0 = time.perf_counter()
        files = write_files(directory, args.rows)
        write_s = time.perf_counter() - t0
        small = write_files(directory, args.whole_rows)
        cases = []
        for fmt, path in files.items():
            cache = directory / f"cache-{fmt}"
            cases += [(fmt, path, "datasets", "first open (converts to Arrow)", cache, args.rows)]
            cases += [(fmt, path, "auto", "second open", cache, args.rows)]
        for fmt, path in small.items():
            cases += [(fmt, path, "memory", "read whole", directory / "cache-small", args.whole_rows)]
        rows_out, results = [], []
        for fmt, path, loader, what, cache, n in cases:
            print(f"{fmt} loader={loader} {what}: {n} rows ...", file=sys.stderr, flush=True)
            r = run_case(path, loader, cache, args.resume_at, args.timeout)
            r.update(
                format=fmt, loader=loader, case=what, file_rows=n, file_mb=round(path.stat().st_size / 1e6)
            )
            results.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)
            if "error" in r:
                rows_out.append(
                    {"format": fmt, "loader": loader, "case": what, "rows": n, "error": r["error"][:80]}
                )
                continue
            phases = [r[k] for k in ("preview", "open", "first_batch", "resume")]
            rows_out.append(
                {
                    "format": fmt,
                    "loader": loader,
                    "case": what,
                    "rows": n,
                    "read as": r["read_as"],
                    "file MB": r["file_mb"],
                    "preview s": r["preview"]["s"],
                    "preview anon +MiB": r["preview"]["anon_grew_mib"],
                    "open s": r["open"]["s"],
                    "open anon +MiB": r["open"]["anon_grew_mib"],
                    "open anon B/row": round(r["open"]["anon_grew_mib"] * 1024**2 / n),
                    "1st batch s": r["first_batch"]["s"],
                    "resume s": r["resume"]["s"],
                    "peak RSS MiB": max(ph["peak_rss_mib"] for ph in phases),
                    "peak anon MiB": max(ph["peak_anon_mib"] for ph in phases),
                    "resume exact": r["resume_exact"] and r["first_batch_rows_right"],
                }
            )
        caches = {f"cache-{fmt}": round(du(directory / f"cache-{fmt}") / 1e6) for fmt in files}
        report(
            "data_rows-cpu",
            {
                "rows": args.rows,
                "whole_rows": args.whole_rows,
                "batch": BATCH,
                "resume_at": args.resume_at,
                "write_s": round(write_s, 1),
                "arrow_cache_mb": caches,
                "cases": results,
            },
            rows_out,
            save=not args.no_save,
        )
    finally:
        if args.dir is None and not args.keep:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
