"""A .json file holding one JSON array of millions of rows, opened as a run opens data.train (`open_prompts`, loader
auto): seconds and the peak RSS growth of this process (sampled every 20 ms) over the first open, which converts the
file (issue 46: datasets' json builder reads an array whole; rlbridge converts it to JSON Lines one element at a
time). Rows are bench/data_rows.py's; the file and datasets' cache go under DIR.

    python bench/data_json_array.py 2000000 /tmp/rows     # prints one JSON line
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def write_array(path: Path, rows: int, chunk: int = 100_000) -> None:
    from bench.data_rows import row

    with path.open("w") as f:
        f.write("[\n")
        for start in range(0, rows, chunk):
            f.write(",\n".join(json.dumps(row(i)) for i in range(start, min(start + chunk, rows))))
            f.write(",\n" if start + chunk < rows else "\n")
        f.write("]\n")


def rss_mib() -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS"))
    return int(line.split()[1]) // 1024


def main(rows: int, directory: Path) -> dict[str, object]:
    import datasets

    from rlbridge.data.datasets import open_prompts
    from rlbridge.recipe.schema import DataCfg

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"rows-{rows}.json"
    if not path.exists():
        write_array(path, rows)
    datasets.config.HF_DATASETS_CACHE = directory / "hf"
    datasets.config.HF_HUB_OFFLINE = True
    peak, before = [0], rss_mib()

    def watch() -> None:
        while True:
            peak[0] = max(peak[0], rss_mib())
            time.sleep(0.02)

    threading.Thread(target=watch, daemon=True).start()
    data = DataCfg.model_validate({"train": {"path": str(path)}, "batch_size": 8})
    start = time.time()
    source = open_prompts(data.train, data, split="train", seed=0)
    seconds = time.time() - start
    time.sleep(0.1)
    return {
        "rows": rows,
        "file_mib": round(path.stat().st_size / 2**20, 1),
        "rss_before_mib": before,
        "peak_growth_mib": max(peak[0], rss_mib()) - before,
        "seconds": round(seconds, 1),
        "num_rows_read": len(source),
    }


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), Path(sys.argv[2]))))
