"""The shipped 7B recipe through the CLI on one GPU (issue 44): train, kill -9, resume, export-hf, with the plan's
memory held against the measured peaks.

The model is `qwen2.5-7b-random` (Qwen2.5-7B-Instruct's published architecture, random bf16 weights, the byte
tokenizer padded to the 152064-id vocabulary: rlbridge.model.info). `recipes/qwen2.5-7b-grpo-lora.yaml` runs
with `--set` overrides only (`ONE_GPU` below: one GPU, the parallel sizes 1, the arithmetic task's data, 32
prompts x 8 samples, <= 256 response tokens, vLLM eager so its start fits a device call) and the engine.

    python bench/size7b.py train --engine hf --steps 5 --out OUT/7bhf [--run-dir DIR] [--set K=V ...]
    python bench/size7b.py resume --run-dir DIR --kill-after-step 6 --steps 7 --out OUT/7bresume
    python bench/size7b.py export --run-dir DIR --out OUT/7bexport
    python bench/size7b.py fit --engine hf --out OUT/7bfit

`train` first materializes the model (timed, once per machine), writes `rlbridge plan --json`, then trains while
sampling `nvidia-smi`'s per-process GPU memory every 0.5 s (the vLLM worker and the trainer told apart by their
Ray actor's process title). `fit` finds the largest token budget per pass the plan accepts, trains a step at it with every
pass at the plan's worst case, and checks that the next budget is refused by validate-recipe. `resume` resumes a
run, kills its whole process group with SIGKILL once step N is in
metrics.jsonl, and resumes again to the end. `export` runs `rlbridge export-hf --merge-lora` and scores fixed texts
with vLLM (tests/gpu/vllm_score_job.py, bf16) and with a float32 transformers forward of the same export. Each writes
`summary.json` (per step: generate, update, sync, sleep, wake, tokens/s, trainer peak, vLLM peak; the plan's
estimates and their ratio to the peaks; checkpoint size and seconds) and a markdown table beside the logs.

`--model tiny-qwen2-smoke --device cpu` checks the whole script on a machine without a GPU (memory columns empty).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "qwen2.5-7b-grpo-lora.yaml"
ONE_GPU = [
    "cluster.gpus_per_node=1",
    "trainer.parallel.tensor=1",
    "trainer.parallel.sequence_parallel=false",
    "rollout.tensor_parallel=1",
    "rollout.enforce_eager=true",
    "rollout.max_prompt_tokens=128",
    "rollout.max_response_tokens=256",
    "data.batch_size=32",
    "rollout.n=8",
    "trainer.max_tokens_per_micro_batch=16384",  # what `rlbridge plan` advises over 128 passes of 2 rows
    "data.train.path=builtin:arithmetic",
    "data.val=null",
    "run.eval_every=0",
]
"""The overrides that put the 8-GPU recipe on one GPU at the issue's batch (32 x 8, <= 256 tokens)."""
GIB = 1024**3


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlbridge", *args]


def overrides(args: argparse.Namespace, *extra: str) -> list[str]:
    sets = [*ONE_GPU, f"model.path={args.model}", f"cluster.device={args.device}", *extra, *args.set]
    if args.device == "cuda":
        sets.insert(0, f"cluster.gpu_memory_gib={card_gib()}")
    return [x for s in sets for x in ("--set", s)]


def bf16_logprobs(
    model_dir: Path, prompts: list[list[int]], answers: list[list[int]], device: str
) -> list[list[float]]:
    """Log-probs of each answer after its prompt under a bfloat16 transformers forward of `model_dir` (the
    precision vLLM runs in), log-softmax in float64 as tests/gpu/common.hf_logprobs does in float32."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).to(device).eval()
    out = []
    with torch.no_grad():
        for prompt, answer in zip(prompts, answers, strict=True):
            ids = torch.tensor([prompt + answer], device=device)
            logits = model(input_ids=ids).logits[0].double()
            lp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
            out.append(lp.gather(-1, torch.tensor(answer, device=device)[:, None])[:, 0].tolist())
    del model
    return out


def card_gib() -> int:
    """The first GPU's memory in whole GiB as nvidia-smi reports it (139 on an H200, 79 on an H100)."""
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return int(float(out.split()[0]) / 1024)


class GpuMemory:
    """nvidia-smi's used memory per process, sampled every `period` s in a thread; peaks by role (the vLLM worker,
    the trainer) from each process's title (Ray names an actor's process `ray::ClassName...`)."""

    def __init__(self, period: float = 0.5) -> None:
        self.period, self.peaks, self._stop = (
            period,
            {"rollout": 0.0, "trainer": 0.0, "other": 0.0},
            threading.Event(),
        )
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> GpuMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    @staticmethod
    def role(pid: int) -> str:
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return "other"
        if "Rollout" in title or "EngineCore" in title:
            return "rollout"
        if "Trainer" in title or "Rank" in title:
            return "trainer"
        return "other"

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                    capture_output=True, text=True, timeout=10,
                ).stdout  # fmt: skip
            except (OSError, subprocess.TimeoutExpired):
                return
            for line in out.splitlines():
                pid, _, mib = line.partition(",")
                if pid.strip().isdigit() and mib.strip().isdigit():
                    role = self.role(int(pid))
                    self.peaks[role] = max(self.peaks[role], int(mib) / 1024)


def steps_of(run_dir: Path) -> list[dict[str, Any]]:
    """The train records of metrics.jsonl, one per step (the last record of a step repeated by a resume wins),
    each with its step's checkpoint record's time_save where the step saved."""
    by_step: dict[int, dict[str, Any]] = {}
    saves: dict[int, float] = {}
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            rec = json.loads(line)
            kind = rec.get("kind", "train")
            if kind == "train" and "step" in rec:
                by_step[int(rec["step"])] = rec
            elif kind == "checkpoint" and "time_save" in rec:
                saves[int(rec["step"])] = rec["time_save"]
    return [{**by_step[k], **({"time_save": saves[k]} if k in saves else {})} for k in sorted(by_step)]


def step_row(rec: dict[str, Any]) -> dict[str, Any]:
    def get(k: str) -> float | None:
        v = rec.get(k)
        return round(float(v), 3) if isinstance(v, (int, float)) else None

    return {
        "step": rec["step"], "generate_s": get("time_generate"), "update_s": get("time_update"),
        "sync_s": get("time_sync"), "sleep_s": get("sleep_s"), "wake_s": get("wake_s"), "step_s": get("time_step"),
        "tokens": rec.get("tokens"), "tokens_per_s": get("tokens_per_s"), "save_s": get("time_save"),
        "trainer_gib_max": get("trainer_gpu_gib_max"), "trainer_reserved_gib_max": get("trainer_gpu_reserved_gib_max"),
    }  # fmt: skip


def checkpoints(run_dir: Path) -> list[dict[str, Any]]:
    out = []
    for d in sorted((run_dir / "checkpoints").glob("step_*")):
        files = [f for f in d.rglob("*") if f.is_file()]
        out.append(
            {
                "dir": d.name,
                "files": len(files),
                "mib": round(sum(f.stat().st_size for f in files) / 2**20, 2),
            }
        )
    return out


def run_logged(cmd: list[str], log: Path, *, timeout: float | None = None) -> tuple[int, float]:
    start = time.monotonic()
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, timeout=timeout).returncode
    return rc, time.monotonic() - start


def plan_json(args: argparse.Namespace, out: Path, extra: list[str]) -> dict[str, Any]:
    res = subprocess.run(cli("plan", str(args.recipe), "--json", *overrides(args, *extra)), capture_output=True, text=True,
                         cwd=ROOT)  # fmt: skip
    (out / "plan.json").write_text(res.stdout or res.stderr)
    try:
        return json.loads(res.stdout)  # type: ignore[no-any-return]
    except json.JSONDecodeError:
        return {"error": (res.stdout + res.stderr)[-2000:]}


def plan_memory(plan: dict[str, Any]) -> dict[str, Any]:
    mem = plan.get("memory") or {}
    return {k: mem.get(k) for k in ("trainer_total", "rollout_total", "peak") if k in mem}


def write_summary(out: Path, summary: dict[str, Any]) -> None:
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    rows = summary.get("steps", [])
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])] if rows else []
    lines += ["| " + " | ".join("" if v is None else str(v) for v in r.values()) + " |" for r in rows]
    (out / "steps.md").write_text("\n".join(lines) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "steps"}, indent=1))
    print("\n".join(lines))


def cmd_train(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run_dir = Path(args.run_dir or out / "run")
    log = out / "train.log"
    start = time.monotonic()
    rc, materialize_s = run_logged(
        [sys.executable, "-c", f"from rlbridge.model.cache import materialize; materialize({args.model!r})"],
        log,
    )
    if rc:
        print(f"materializing {args.model} failed: see {log}", file=sys.stderr)
        return rc
    extra = [f"trainer.engine={args.engine}", f"run.steps={args.steps}", f"run.save_every={args.save_every}"]
    plan = plan_json(args, out, extra)
    with GpuMemory() as mem:
        rc, train_s = run_logged(
            cli("train", str(args.recipe), "--run-dir", str(run_dir), *overrides(args, *extra)), log
        )
    steps = [step_row(r) for r in steps_of(run_dir)]
    est = plan_memory(plan)
    summary = {
        "what": f"rlbridge train {Path(args.recipe).name} ({args.model}, {args.engine}, {args.device})", "exit": rc,
        "materialize_s": round(materialize_s, 1), "train_s": round(train_s, 1), "wall_s": round(time.monotonic() - start, 1),
        "plan": est, "gpu_peaks_gib_nvidia_smi": {k: round(v, 2) for k, v in mem.peaks.items()},
        "checkpoints": checkpoints(run_dir), "steps": steps,
    }  # fmt: skip
    trainer_peak = max((s["trainer_reserved_gib_max"] or 0.0 for s in steps), default=0.0)
    if est.get("trainer_total") and trainer_peak:
        summary["trainer_reserved_peak_over_plan"] = round(trainer_peak / est["trainer_total"], 3)
    if est.get("rollout_total") and mem.peaks["rollout"]:
        summary["rollout_peak_over_plan"] = round(mem.peaks["rollout"] / est["rollout_total"], 3)
    write_summary(out, summary)
    return rc


def cmd_resume(args: argparse.Namespace) -> int:
    """Resume to --steps, SIGKILL the run's process group once step --kill-after-step is logged, resume again."""
    out, run_dir = Path(args.out), Path(args.run_dir)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "resume.log"
    sets = [x for s in [f"run.steps={args.steps}", *args.set] for x in ("--set", s)]
    start = time.monotonic()
    with log.open("a") as f:
        proc = subprocess.Popen(cli("resume", str(run_dir), *sets), stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)  # fmt: skip
        killed_at = None
        while proc.poll() is None:
            if any(r["step"] >= args.kill_after_step for r in steps_of(run_dir)):
                killed_at = time.monotonic() - start
                os.killpg(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.5)
        first_rc = proc.wait()
    time.sleep(5)  # Ray's processes of the killed run: their own session, killed with the group
    rc, second_s = run_logged(cli("resume", str(run_dir), *sets), log)
    steps = steps_of(run_dir)
    summary = {
        "what": f"rlbridge resume {run_dir.name}: kill -9 after step {args.kill_after_step}, resume to {args.steps}",
        "killed_after_s": None if killed_at is None else round(killed_at, 1), "first_exit": first_rc,
        "second_exit": rc, "second_resume_s": round(second_s, 1),
        "steps_logged": [r["step"] for r in steps], "checkpoints": checkpoints(run_dir),
        "steps": [step_row(r) for r in steps],
    }  # fmt: skip
    write_summary(out, summary)
    return rc


def cmd_export(args: argparse.Namespace) -> int:
    """export-hf --merge-lora, then vLLM (CUDA) and transformers log-probs of fixed texts on the export."""
    out, run_dir = Path(args.out), Path(args.run_dir)
    out.mkdir(parents=True, exist_ok=True)
    log, export = out / "export.log", Path(args.export_dir or out / "merged")
    rc, export_s = run_logged(cli("export-hf", str(run_dir), "--out", str(export), "--merge-lora"), log)
    size = sum(f.stat().st_size for f in export.rglob("*.safetensors")) / GIB if export.is_dir() else 0.0
    summary: dict[str, Any] = {"what": f"rlbridge export-hf {run_dir.name} --merge-lora", "exit": rc,
                               "export_s": round(export_s, 1), "safetensors_gib": round(size, 2)}  # fmt: skip
    if rc == 0:
        score = out / "vllm_scores.json"
        job = [sys.executable, str(ROOT / "tests" / "gpu" / "vllm_score_job.py"), "--model", str(export),
               "--device", args.device, "--dtype", "bfloat16", "--out", str(score),
               "--gpu-memory-utilization", "0.5"]  # fmt: skip
        rc, score_s = run_logged(job, log)
        summary.update(vllm_score_exit=rc, vllm_score_s=round(score_s, 1))
        if rc == 0:
            sys.path.insert(0, str(ROOT))
            from tests.gpu.common import gap, load_hf

            s = json.loads(score.read_text())
            start = time.monotonic()
            # vLLM bf16 against a float32 transformers forward of the same export; and the bf16 floor at this
            # size: a bf16 transformers forward (on the GPU when there is one) against the same float32 one
            reference = load_hf(export)
            summary["vllm_vs_transformers"] = gap(reference, s["prompts"], s["answers"], s["logprobs"])
            summary["reference_s"] = round(time.monotonic() - start, 1)
            bf16 = bf16_logprobs(export, s["prompts"], s["answers"], args.device)
            summary["transformers_bf16_vs_float32"] = gap(reference, s["prompts"], s["answers"], bf16)
            summary["vllm_startup_s"] = s.get("startup_s")
    write_summary(out, summary)
    return rc


def accepts(args: argparse.Namespace, extra: list[str]) -> bool:
    """Whether `rlbridge validate-recipe` (no --force) accepts --recipe with these overrides."""
    res = subprocess.run(
        cli("validate-recipe", str(args.recipe), *overrides(args, *extra)), capture_output=True, cwd=ROOT
    )
    return res.returncode == 0


def cmd_fit(args: argparse.Namespace) -> int:
    """The largest trainer.max_tokens_per_micro_batch (a multiple of --step) that validate-recipe accepts for the
    engine; one training step at it, its passes filled to the plan's worst case (prompts padded to
    max_prompt_tokens by the template, responses to max_response_tokens with ignore_eos), must fit; the next
    multiple must be refused by validate-recipe, naming the device memory."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = [f"trainer.engine={args.engine}", "run.steps=1", "run.save_every=0"]
    lo, hi = 1, args.hi // args.step  # multiples of step: lo accepted (checked), hi refused (checked)
    if not accepts(args, [*base, f"trainer.max_tokens_per_micro_batch={lo * args.step}"]):
        print(f"even trainer.max_tokens_per_micro_batch={args.step} is refused", file=sys.stderr)
        return 2
    if accepts(args, [*base, f"trainer.max_tokens_per_micro_batch={hi * args.step}"]):
        print(f"trainer.max_tokens_per_micro_batch={hi * args.step} is accepted: raise --hi", file=sys.stderr)
        return 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (
            (mid, hi)
            if accepts(args, [*base, f"trainer.max_tokens_per_micro_batch={mid * args.step}"])
            else (lo, mid)
        )
    best, past = lo * args.step, hi * args.step
    refusal = subprocess.run(cli("validate-recipe", str(args.recipe), *overrides(args, *base, f"trainer.max_tokens_per_micro_batch={past}")),
                             capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    # prompts of max_prompt_tokens (the byte tokenizer: one token per byte) and responses of max_response_tokens
    pad = (
        "x" * 72
    )  # + the question and the chat template: ~110-125 of the 128 tokens (longer ones are left out)
    worst = [*base, f"trainer.max_tokens_per_micro_batch={best}", "rollout.ignore_eos=true",
             f"data.template={{prompt}} {pad}", "data.batch_size=64"]  # fmt: skip
    plan = plan_json(args, out, worst)
    run_dir = out / "run"
    with GpuMemory() as mem:
        rc, train_s = run_logged(
            cli("train", str(args.recipe), "--run-dir", str(run_dir), *overrides(args, *worst)),
            out / "train.log",
        )
    steps = [step_row(r) for r in steps_of(run_dir)]
    summary = {
        "what": f"the largest token budget validate-recipe accepts ({args.engine}), one step at it; the next refused",
        "accepted_budget": best, "refused_budget": past, "refused_exit": refusal.returncode,
        "refusal": (refusal.stdout + refusal.stderr)[-1500:], "train_exit": rc, "train_s": round(train_s, 1),
        "plan": plan_memory(plan), "gpu_peaks_gib_nvidia_smi": {k: round(v, 2) for k, v in mem.peaks.items()},
        "steps": steps,
    }  # fmt: skip
    write_summary(out, summary)
    return rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("train", "resume", "export", "fit"):
        p = sub.add_parser(name)
        p.add_argument("--out", required=True)
        p.add_argument("--model", default="qwen2.5-7b-random")
        p.add_argument("--recipe", default=str(RECIPE), help="the recipe ONE_GPU's overrides apply to")
        p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
        p.add_argument("--set", action="append", default=[], help="more recipe overrides K=V")
        p.add_argument("--run-dir", required=name != "train")
        if name in ("train", "fit"):
            p.add_argument("--engine", default="hf", choices=["hf", "megatron"])
        if name == "fit":
            p.add_argument("--step", type=int, default=4096, help="budget granularity (tokens)")
            p.add_argument("--hi", type=int, default=1 << 20, help="a budget the plan must refuse")
        if name == "train":
            p.add_argument("--steps", type=int, default=5)
            p.add_argument("--save-every", type=int, default=5)
        if name == "resume":
            p.add_argument("--kill-after-step", type=int, required=True)
            p.add_argument("--steps", type=int, required=True)
        if name == "export":
            p.add_argument(
                "--export-dir", default=None, help="where the merged model goes (default OUT/merged)"
            )
    args = ap.parse_args()
    return {"train": cmd_train, "resume": cmd_resume, "export": cmd_export, "fit": cmd_fit}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
