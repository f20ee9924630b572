"""bench/proctree.LineArrivals: each complete line of a file another writer appends to, once, with its arrival time to
the polling interval (10 ms), a line written in two pieces counted when its newline arrives."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from bench.proctree import LineArrivals


def test_lines_arrive_once_with_their_times(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    written: list[float] = []

    def writer() -> None:
        with path.open("a") as f:
            for i in range(5):
                time.sleep(0.04)
                f.write('{"step": ')  # half a line: not yet a line
                f.flush()
                time.sleep(0.03)
                f.write(f"{i}}}\n")
                f.flush()
                written.append(time.time())

    with LineArrivals(path) as arrivals:  # the file does not exist yet when polling starts
        thread = threading.Thread(target=writer)
        thread.start()
        thread.join()
    assert [line for _, line in arrivals.lines] == [f'{{"step": {i}}}' for i in range(5)]
    lags = [t - w for (t, _), w in zip(arrivals.lines, written, strict=True)]
    assert all(-0.05 < lag < 0.08 for lag in lags), (
        lags
    )  # 10 ms polling (it was 0.1 s); loose for a loaded machine
