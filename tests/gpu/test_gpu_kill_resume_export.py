"""A GPU run killed with kill -9 resumes, and its export loads in vLLM (issue 14.2, items 6 and 7).

6. `python -m rlbridge train` (hf engine, merged sync, 2 steps, a checkpoint after every step) is killed with
   SIGKILL (its process group and every process of the run: Ray, its actors, vLLM, reward workers) as soon as
   the step-1 checkpoint is complete. Then no process of the run may be left (found by a tag in their
   environment and as the driver's recorded descendants, tests/gpu/procs.py), the checkpoint verifies
   (sha256 of every file), and `python -m rlbridge resume RUN` exits 0 having resumed from step_000001, with
   steps 1 and 2 in metrics.jsonl once each.
7. `rlbridge export-hf RUN --merge-lora` of that run is loaded by vLLM on CUDA in a process of its own
   (tests/gpu/vllm_score_job.py, bfloat16); its log-probs of fixed texts (chat prompt + answer) match a
   transformers float32 forward of the same export: mean |diff| over the answer tokens < 6e-2 (~2x the floor,
   tests/gpu/common.Profile).

GPU time (estimate, vLLM eager as in the CLI runs): the killed run ~45-70 s (start-up, step 1, save), the
resume ~45-70 s, export ~5 s, vLLM scoring subprocess ~20-40 s, references ~5 s: ~2-3 min. CPU dry run: ~10-15 min on 2 cores.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rlbridge.run import checkpoint as ckpt
from tests.gpu import procs
from tests.gpu.common import DRY_RUN, ROOT, P, figure, gap, load_hf, python, subprocess_env, time_left
from tests.gpu.test_gpu_cli_runs import cli_args, keep_logs, train_records

pytestmark = [pytest.mark.timeout(3600 if DRY_RUN else 420)]
STEPS = 2


@dataclass
class Killed:
    run_dir: Path
    log: Path
    kill_after_s: float
    left: list[str]
    manifest_ok: str | None


def nvidia_smi_pids() -> set[int] | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return {int(x) for x in out.split() if x.strip().isdigit()}


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Killed]:
    base = tmp_path_factory.mktemp("killed")
    run_dir, log = base / "run", base / "train.log"
    args = cli_args("train", run_dir, "trainer.engine=hf", "rollout.weight_sync=merged", "run.save_every=1")
    manifest = run_dir / "checkpoints" / ckpt.step_dir_name(1) / "manifest.json"
    run = procs.start(args, log)
    try:
        rc = run.wait(time_left(P.cli_timeout_s), until=manifest.is_file)
        waited = run.started
        if rc is not None or not manifest.is_file():
            pytest.fail(
                f"the run exited ({rc}) or timed out before its step-1 checkpoint:\n{run.text()[-6000:]}"
            )
        import time

        kill_after_s = time.monotonic() - waited
        run.kill()
        left = run.gone_within(30.0)
        gpu_pids = nvidia_smi_pids() if P.device == "cuda" else None
        on_gpu = sorted(gpu_pids & set(run.seen)) if gpu_pids is not None else []
        if on_gpu:
            left += [f"{pid} still holds GPU memory (nvidia-smi)" for pid in on_gpu]
        figure("kill_9_after_step_1", kill_after_s=kill_after_s, processes_seen=len(run.seen), left=len(left),
               gpu_processes_after=None if gpu_pids is None else len(gpu_pids))  # fmt: skip
        yield Killed(run_dir, log, kill_after_s, left, ckpt.verify_checkpoint(manifest.parent))
    finally:
        run.kill()
        keep_logs("killed-train", log, run_dir)


@pytest.fixture(scope="module")
def resumed(killed: Killed) -> tuple[int | None, float, list[str], str]:
    log = killed.run_dir.parent / "resume.log"
    rc, seconds, left = procs.run(["resume", str(killed.run_dir)], log, time_left(P.cli_timeout_s))
    keep_logs("killed-resume", log, killed.run_dir)
    return rc, seconds, left, log.read_text(errors="replace")


def test_kill_9_after_step_1_leaves_nothing_and_resume_finishes(killed: Killed,
                                                                resumed: tuple[int | None, float, list[str], str]) -> None:  # fmt: skip
    assert not killed.left, f"processes of the killed run still alive: {killed.left}"
    assert killed.manifest_ok is None, killed.manifest_ok
    rc, seconds, left, out = resumed
    records = train_records(killed.run_dir)
    figure("resume_after_kill", exit=rc, wall_s=seconds, steps=[r["step"] for r in records],
           logprob_diff_mean=[r.get("logprob_diff_mean") for r in records])  # fmt: skip
    assert rc == 0, f"resume exit {rc}:\n{out[-6000:]}"
    assert "step_000001" in out.split("resuming", 1)[-1], out[-3000:]
    assert not left, f"processes of the resumed run still alive 30 s after it exited: {left}"
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), records
    assert [r["weight_version"] for r in records] == list(range(1, STEPS + 1))


def test_export_hf_merged_loads_in_vllm_with_transformers_logprobs(killed: Killed, resumed: tuple[int | None, float, list[str], str],
                                                                   model_dir: Path, tmp_path: Path) -> None:  # fmt: skip
    out = tmp_path / "merged"
    proc = subprocess.run([python(), "-m", "rlbridge", "export-hf", str(killed.run_dir), "--out", str(out), "--merge-lora"],
                          cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=time_left(300))  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    scores = tmp_path / "scores.json"
    job = [python(), str(ROOT / "tests" / "gpu" / "vllm_score_job.py"), "--model", str(out), "--device", P.device,
           "--dtype", P.dtype, "--out", str(scores)]  # fmt: skip
    proc = subprocess.run(job, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                          timeout=time_left(1200 if DRY_RUN else 240))  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    s = json.loads(scores.read_text())
    exported = gap(load_hf(out), s["prompts"], s["answers"], s["logprobs"])
    base = gap(load_hf(model_dir), s["prompts"], s["answers"], s["logprobs"])
    step = json.loads((out / "config.json").read_text()).get("torch_dtype") or json.loads(
        (out / "config.json").read_text()
    ).get("dtype")
    figure("export_hf_merged_in_vllm", mean=exported["mean"], max=exported["max"], tokens=exported["tokens"],
           vs_base_model_mean=base["mean"], bound=P.logprob_bound, vllm_startup_s=s["startup_s"], export_dtype=step)  # fmt: skip
    assert exported["mean"] < P.logprob_bound, exported
