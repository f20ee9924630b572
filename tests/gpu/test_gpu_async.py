"""rollout.mode async on one GPU (issue 18): the quickstart's `rlbridge train` with the hf trainer and adapter
sync, synchronous and asynchronous (max_staleness 1, truncated importance weights), one after the other on the
same GPU, 6 steps each. In async mode vLLM stays resident next to the trainer (no sleep) and generates the next
step's batch while the trainer updates.

Gates: both exit 0 with no process left; the async run's staleness per step is [0, 1, 1, 1, 1, 1] and its
rollout_version [0, 0, 1, 2, 3, 4]; its trainer-vs-rollout gap (logprob_diff_mean, which in async mode also
holds one update's drift) is finite and below 0.2. Figures: the steady-state seconds per step of both (steps
2..6) and their ratio; the phases. Not gated on speed (that is bench/async_runs.py's job, with seeds).

rollout.sleep auto in sync mode (vLLM resident through the update, no sleep or wake): a third run.

GPU time (estimate): three CLI runs, ~75-120 s each (vLLM start-up dominates). CPU dry run: quickstart at tiny sizes.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

import pytest

from tests.gpu import procs
from tests.gpu.common import P, figure, time_left
from tests.gpu.test_gpu_cli_runs import cli_args, keep_logs, train_records

pytestmark = [pytest.mark.timeout(1800)]
STEPS = 6
ASYNC = ["rollout.mode=async", "rollout.max_staleness=1", "algorithm.rollout_correction.weights=token"]


def train(tmp: Path, name: str, *sets: str) -> tuple[int | None, float, list[str], list[dict[str, Any]]]:
    run_dir, log = tmp / name, tmp / f"{name}.log"
    args = cli_args(
        "train", run_dir, f"run.steps={STEPS}", "trainer.engine=hf", "rollout.weight_sync=adapter", *sets
    )
    rc, seconds, left = procs.run(args, log, time_left(P.cli_timeout_s + 120))
    keep_logs(name, log, run_dir)
    assert rc == 0, f"{name}: exit {rc} after {seconds:.0f} s\n{log.read_text(errors='replace')[-6000:]}"
    return rc, seconds, left, train_records(run_dir)


def steady(records: list[dict[str, Any]]) -> float:
    return statistics.fmean(float(r["time_step"]) for r in records[1:])


def test_async_overlaps_and_trains_on_one_gpu(tmp_path: Path) -> None:
    _, sync_s, sync_left, sync = train(tmp_path, "sync")
    _, async_s, async_left, asyn = train(tmp_path, "async", *ASYNC)
    phases = {
        mode: {k: [round(float(r[k]), 3) for r in recs if k in r]
               for k in ("time_generate", "time_rollout_wait", "time_update", "time_sync", "time_step")}
        for mode, recs in (("sync", sync), ("async", asyn))
    }  # fmt: skip
    figure(
        "async_vs_sync",
        sync_s_per_step=steady(sync),
        async_s_per_step=steady(asyn),
        async_speedup=steady(sync) / steady(asyn),
        sync_wall_s=sync_s,
        async_wall_s=async_s,
        gaps=[r.get("logprob_diff_mean") for r in asyn],
        **{f"{m}_{k}": v for m, d in phases.items() for k, v in d.items()},
    )
    assert not sync_left and not async_left, (sync_left, async_left)
    assert [r["staleness"] for r in asyn] == [0] + [1] * (STEPS - 1)
    assert [r["rollout_version"] for r in asyn] == [0, *range(STEPS - 1)]
    gaps = [r.get("logprob_diff_mean") for r in asyn]
    assert all(isinstance(g, float) and math.isfinite(g) and g < 0.2 for g in gaps), gaps


def test_sync_mode_with_vllm_resident(tmp_path: Path) -> None:
    """rollout.sleep auto on the quickstart: the plan keeps vLLM resident through the update (a trainer of a few
    GiB beside vLLM's share), so no step records a sleep or a wake; the run trains with the sync run's gap gate.
    Figure: the steady seconds per step and phases, to set beside test_async's sync run (same recipe and GPU)."""
    _, wall_s, left, records = train(tmp_path, "sync-resident", "rollout.sleep=auto")
    log = (tmp_path / "sync-resident.log").read_text(errors="replace")
    figure(
        "sync_vllm_resident",
        s_per_step=steady(records),
        wall_s=wall_s,
        time_update=[round(float(r["time_update"]), 3) for r in records],
        time_sync=[round(float(r["time_sync"]), 3) for r in records],
        gaps=[r.get("logprob_diff_mean") for r in records],
    )
    assert not left, left
    assert len(records) == STEPS
    if P.device == "cuda":
        assert "rollout.sleep auto: vLLM stays resident" in log, log[-3000:]
    assert not any("sleep_s" in r or "wake_s" in r for r in records)
    gaps = [r.get("logprob_diff_mean") for r in records]
    assert all(isinstance(g, float) and math.isfinite(g) and g < P.cli_gap_bound for g in gaps), gaps
