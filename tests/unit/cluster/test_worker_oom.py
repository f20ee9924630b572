"""A worker that Ray's memory monitor kills: the error names the worker, says what happened and what to lower, and
shows its log's last lines (no Ray traceback). Ray's answer is stood in for: `ray.get` raising its
OutOfMemoryError as it does for a call whose process the monitor killed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import ray
from ray.exceptions import OutOfMemoryError

from rlbridge.cluster import ray_cluster as rc
from rlbridge.errors import RlbridgeError

RAY_TEXT = (
    "1 worker(s) were killed due to the node running low on memory. Memory on the node (IP: 192.0.2.2, ID: 39) was "
    "21.45GB used / 23.54GB limit (0.911065)\nOOM kill reason: Memory usage 24056242176B exceeded threshold\n"
    "Object store memory usage: ..."
)


def test_a_worker_killed_for_memory_is_named_with_its_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "rollout-engine1.log"
    log.write_text("vLLM generate: 4 rows\nloading weights v2\n")

    def get(ref: Any, timeout: float | None = None) -> Any:
        raise OutOfMemoryError(RAY_TEXT)

    monkeypatch.setattr(ray, "get", get)
    with pytest.raises(RlbridgeError) as e:
        rc.Worker("rollout engine 1", handle=None, log_file=log).wait("ref")
    msg = str(e.value)
    assert msg.startswith("rollout engine 1 worker was killed by Ray's memory monitor"), msg
    assert "21.45GB used / 23.54GB limit" in msg and "OOM kill reason" not in msg
    assert "loading weights v2" in msg and str(log) in msg
