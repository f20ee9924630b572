"""The megatron GPU quickstart (bf16, LoRA) killed with kill -9, resumed, exported (issue 15, item 5). Passed on one H200 on 2026-12-02 (391 s).

`python -m rlbridge train` (trainer.engine=megatron, merged sync, 2 steps, a checkpoint after every step) is
killed (process group and every process of the run) once the step-1 checkpoint is complete; the checkpoint
verifies, `resume` exits 0 from step_000001 with steps 1 and 2 once each and weight versions 1, 2; then
`export-hf --merge-lora` and `--adapter-only` of that run (a CPU process: no Ray, no GPU) load in
transformers / peft, and vLLM's log-probs of the merged export match a transformers float32 forward of it
(the same bound as the hf engine's export, tests/gpu/common.Profile). Figures (gpu_figures.jsonl, then
bench/results/): checkpoint size and save time, resume wall time, export times and sizes.

GPU time, measured 2026-12-02 (bench/results/gpu_check-2026-12-02.md): 391 s in all (resume 67 s, exports 18 s + 15 s). Run: `bash scripts/gpu_check.sh 3`.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlbridge.run import checkpoint as ckpt
from tests.gpu import procs
from tests.gpu.common import DRY_RUN, ROOT, P, figure, gap, load_hf, python, subprocess_env, time_left
from tests.gpu.test_gpu_cli_runs import cli_args, keep_logs, train_records

pytestmark = [pytest.mark.timeout(3600 if DRY_RUN else 480)]
STEPS = 2
SAVED = re.compile(r"saved step (\d+): \S+ \(([\d.]+) MB in ([\d.]+) s\)")


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    base = tmp_path_factory.mktemp("megatron_killed")
    run_dir, log = base / "run", base / "train.log"
    args = cli_args(
        "train", run_dir, "trainer.engine=megatron", "rollout.weight_sync=merged", "run.save_every=1"
    )
    manifest = run_dir / "checkpoints" / ckpt.step_dir_name(1) / "manifest.json"
    run = procs.start(args, log)
    try:
        rc = run.wait(time_left(P.cli_timeout_s), until=manifest.is_file)
        if rc is not None or not manifest.is_file():
            pytest.fail(
                f"the run exited ({rc}) or timed out before its step-1 checkpoint:\n{run.text()[-6000:]}"
            )
        run.kill()
        left = run.gone_within(30.0)
        assert not left, f"processes of the killed run still alive: {left}"
        saves = SAVED.findall(run.text())
        size = sum(f.stat().st_size for f in manifest.parent.iterdir())
        figure(
            "megatron_checkpoint",
            bytes=size,
            saves=[{"step": int(s), "mb": float(m), "seconds": float(t)} for s, m, t in saves],
        )
        yield run_dir
    finally:
        run.kill()
        keep_logs("megatron-killed-train", log, run_dir)


def test_megatron_kill_9_resume_export(killed: Path, tmp_path: Path) -> None:
    assert ckpt.verify_checkpoint(killed / "checkpoints" / ckpt.step_dir_name(1)) is None
    log = killed.parent / "resume.log"
    rc, seconds, left = procs.run(["resume", str(killed)], log, time_left(P.cli_timeout_s))
    keep_logs("megatron-resume", log, killed)
    out = log.read_text(errors="replace")
    figure("megatron_resume_after_kill", exit=rc, wall_s=seconds)
    assert rc == 0, out[-6000:]
    assert "step_000001" in out.split("resuming", 1)[-1], out[-3000:]
    assert not left, left
    records = train_records(killed)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), records
    assert [r["weight_version"] for r in records] == list(range(1, STEPS + 1))

    exports = {}
    for flag in ("--merge-lora", "--adapter-only"):
        dest = tmp_path / flag.strip("-")
        start = time.perf_counter()
        proc = subprocess.run([python(), "-m", "rlbridge", "export-hf", str(killed), "--out", str(dest), flag],
                              cwd=ROOT, env={**subprocess_env(), "CUDA_VISIBLE_DEVICES": ""}, capture_output=True,
                              text=True, timeout=time_left(300))  # fmt: skip
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        exports[flag] = {
            "seconds": time.perf_counter() - start,
            "bytes": sum(f.stat().st_size for f in dest.iterdir()),
        }
    figure("megatron_export_hf", **{k.strip("-"): v for k, v in exports.items()})
    merged = tmp_path / "merge-lora"
    from peft import PeftModel

    base_dir = json.loads((tmp_path / "adapter-only" / "adapter_config.json").read_text())[
        "base_model_name_or_path"
    ]
    PeftModel.from_pretrained(load_hf(Path(base_dir)), tmp_path / "adapter-only")  # peft loads the adapter
    scores = tmp_path / "scores.json"
    job = [python(), str(ROOT / "tests" / "gpu" / "vllm_score_job.py"), "--model", str(merged), "--device", P.device,
           "--dtype", P.dtype, "--out", str(scores)]  # fmt: skip
    proc = subprocess.run(job, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                          timeout=time_left(1200 if DRY_RUN else 240))  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    s = json.loads(scores.read_text())
    exported = gap(load_hf(merged), s["prompts"], s["answers"], s["logprobs"])
    figure(
        "megatron_export_merged_in_vllm", mean=exported["mean"], max=exported["max"], bound=P.logprob_bound
    )
    assert exported["mean"] < P.logprob_bound, exported
