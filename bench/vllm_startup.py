"""Where a vLLM engine's start-up time goes, cold and warm, in a plain process and inside a Ray actor.

    python -m bench.vllm_startup [--conditions plain,ray,ray-warm,plain-merged] [--out DIR] [--sequential]

Each condition runs in a child process with caches of its own (HOME, VLLM_CACHE_ROOT, TORCHINDUCTOR_CACHE_DIR,
TRITON_CACHE_DIR under one fresh folder), so "cold" means what a fresh machine sees: no torch.compile,
Triton, CUDA-graph or FlashInfer cache. `ray-warm` reuses the cache folder `ray` filled. Every condition
builds the engine through rlbridge's own VllmRollout (the quickstart's rollout settings; adapter sync, i.e.
vLLM with LoRA enabled, unless the condition's name has "merged"), then
times the first sampled generate (kernels JIT-compiled on first use land here), a second one, and sleep/wake.
A faulthandler stack dump every 45 s goes into the condition's log, so a stall shows where it sits.

Prints JSON and a table; --out DIR keeps each condition's log (vLLM's INFO lines with times) there.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _cfgs(gpu_memory_utilization: float, sync: str) -> tuple[Any, Any]:
    from rlbridge.recipe.schema import ModelCfg, RolloutCfg

    rollout = RolloutCfg(engine="vllm", n=4, max_prompt_tokens=128, max_response_tokens=48, weight_sync=sync,
                         max_lora_rank=16, gpu_memory_utilization=gpu_memory_utilization)
    return rollout, ModelCfg(path="smollm2-135m-instruct", dtype="bfloat16")


def _prompts(model_dir: str, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = [f"What is {10 + i} + {37 + 2 * i}? Put the final answer after '####'." for i in range(count)]
    return [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True) for t in texts]


class TracedRollout:
    """VllmRollout built with a periodic stack dump into `trace_path`, and timings of its first calls."""

    def __init__(self, model_dir: str, trace_path: str, gpu_memory_utilization: float, cpu: bool, sync: str) -> None:
        self._trace = open(trace_path, "a")  # noqa: SIM115 (lives as long as the engine)
        faulthandler.dump_traceback_later(45, repeat=True, file=self._trace)
        import torch

        self.env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "torch_threads": torch.get_num_threads(),
                    "affinity": len(os.sched_getaffinity(0)), "cpu_count": os.cpu_count()}
        try:
            from torch._inductor import config as inductor_config

            self.env["inductor_compile_threads"] = inductor_config.compile_threads
        except Exception:  # noqa: BLE001
            pass
        from rlbridge.rollout.vllm import VllmRollout

        rollout, model = _cfgs(gpu_memory_utilization, sync)
        start = time.perf_counter()
        self.engine = VllmRollout(model_dir, rollout, model, lora_rank=16, seed=1, cpu=cpu)
        self.startup_s = time.perf_counter() - start

    def exercise(self, prompts: list[list[int]]) -> dict[str, Any]:
        from rlbridge.rollout.base import SamplingCfg

        sampling = SamplingCfg(n=4, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=48, greedy=False)
        out: dict[str, Any] = {"startup_s": round(self.startup_s, 2), **self.env}
        for name in ("first_generate_s", "second_generate_s"):
            start = time.perf_counter()
            rollouts = self.engine.generate(prompts, sampling, expect_version=0, seed=1)
            out[name] = round(time.perf_counter() - start, 2)
        out["tokens"] = sum(len(r) for r in rollouts.response_ids)
        if not self.engine.cpu:
            import torch

            free0, total = torch.cuda.mem_get_info()
            start = time.perf_counter()
            self.engine.sleep(1)
            out["sleep_s"] = round(time.perf_counter() - start, 2)
            free1, _ = torch.cuda.mem_get_info()
            out["sleep_freed_gib"] = round((free1 - free0) / 2**30, 2)
            start = time.perf_counter()
            self.engine.wake_up()
            out["wake_s"] = round(time.perf_counter() - start, 2)
        faulthandler.cancel_dump_traceback_later()
        return out


def child(condition: str, model_dir: str, log_dir: Path, gpu_memory_utilization: float) -> dict[str, Any]:
    cpu = not __import__("torch").cuda.is_available()
    trace = str(log_dir / f"{condition}.trace")
    sync = "merged" if "merged" in condition else "adapter"
    prompts = _prompts(model_dir, 8)
    start = time.perf_counter()
    if condition.startswith("ray"):
        import ray

        env = {k: v for k, v in os.environ.items()
               if k.startswith(("VLLM_", "HOME", "TORCHINDUCTOR_", "TRITON_", "NCCL_", "PYTHONPATH"))}
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, runtime_env={"env_vars": env},
                 log_to_driver=True, configure_logging=False)
        ray_s = time.perf_counter() - start
        actor: Any = ray.remote(TracedRollout).options(num_cpus=0.5, num_gpus=0 if cpu else 0.5)
        handle = actor.remote(model_dir, trace, gpu_memory_utilization, cpu, sync)
        result = ray.get(handle.exercise.remote(prompts))
        result["ray_init_s"] = round(ray_s, 2)
        ray.shutdown()
    else:
        engine = TracedRollout(model_dir, trace, gpu_memory_utilization, cpu, sync)
        result = engine.exercise(prompts)
    result["total_s"] = round(time.perf_counter() - start, 2)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conditions", default="plain,ray,ray-warm")
    ap.add_argument("--out", type=Path, default=None, help="keep each condition's log here")
    ap.add_argument("--sequential", action="store_true", help="one condition after another (default: the cold "
                    "ones run side by side, which is faster but shares the CPU cores)")
    ap.add_argument("--timeout", type=float, default=540)
    ap.add_argument("--caches", type=Path, default=None, help="cache folders live here (one per condition, "
                    "'-warm' shares its cold twin's); default: a fresh temporary folder")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        result = child(args.child, args.model_dir, args.out, args.gpu_memory_utilization)
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    from rlbridge.model_cache import ensure_model

    model_dir = str(ensure_model("smollm2-135m-instruct"))
    out = args.out or Path(tempfile.mkdtemp(prefix="vllm_startup_"))
    out.mkdir(parents=True, exist_ok=True)
    caches = args.caches or Path(tempfile.mkdtemp(prefix="vllm_startup_caches_"))
    caches.mkdir(parents=True, exist_ok=True)
    conditions = args.conditions.split(",")

    def launch(cond: str) -> tuple[subprocess.Popen[bytes], Any]:
        cache = caches / cond.removesuffix("-warm")
        cache.mkdir(exist_ok=True)
        env = dict(os.environ, HOME=str(cache), VLLM_CACHE_ROOT=str(cache / "vllm"),
                   TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), TRITON_CACHE_DIR=str(cache / "triton"),
                   VLLM_LOGGING_LEVEL="INFO", PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
        log = open(out / f"{cond}.log", "wb")  # noqa: SIM115
        cmd = [sys.executable, "-m", "bench.vllm_startup", "--child", cond, "--model-dir", model_dir, "--out", str(out),
               "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT), log

    rows: list[dict[str, Any]] = []

    def collect(cond: str, proc: subprocess.Popen[bytes], log: Any, started: float) -> None:
        try:
            code = proc.wait(timeout=max(1.0, args.timeout - (time.perf_counter() - started)))
        except subprocess.TimeoutExpired:
            proc.kill()
            code = -9
        log.close()
        text = (out / f"{cond}.log").read_text(errors="replace")
        found = [line for line in text.splitlines() if line.startswith("RESULT ")]
        row: dict[str, Any] = {"condition": cond, "exit": code}
        row.update(json.loads(found[-1][7:]) if found else {"error": text.strip().splitlines()[-1:] or ["no output"]})
        row["wall_s"] = round(time.perf_counter() - started, 1)
        rows.append(row)
        print(f"[vllm_startup] {cond}: {json.dumps(row)}", flush=True)

    started = time.perf_counter()
    cold = [c for c in conditions if not c.endswith("-warm")]
    warm = [c for c in conditions if c.endswith("-warm")]
    if args.sequential:
        for cond in cold:
            t = time.perf_counter()
            collect(cond, *launch(cond), t)
    else:
        procs = {c: launch(c) for c in cold}
        for cond, (proc, log) in procs.items():
            collect(cond, proc, log, started)
    for cond in warm:
        t = time.perf_counter()
        collect(cond, *launch(cond), t)
    from bench.common import report

    report("vllm_startup", {"logs": str(out), "side_by_side": not args.sequential}, rows, save=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
