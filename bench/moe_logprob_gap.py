"""Trainer-vs-rollout log-prob gap of the tiny MoE against the dense model of the same size (issue 22; docs/moe.md).

Runs `rlbridge train recipes/moe-lora-cpu.yaml` (megatron trainer, LoRA on attention and experts, merged sync) on
`tiny-qwen3-moe-smoke` and on its dense counterpart `tiny-qwen3-dense-smoke` (same attention, layers and
vocabulary; a dense MLP as wide as the two experts a token is routed to), in each `--dtype`, and reports the mean
and max |trainer - rollout| log-prob of the sampled tokens per run (the loop's `logprob_diff_mean/max`, averaged
over the steps) and the update time. In bfloat16 a near-tie between two experts' router scores can flip the
routing between the engines, which a dense model cannot do.

    python -m bench.moe_logprob_gap                          # CPU: hf rollouts (vLLM-CPU cannot sync MoE)
    python -m bench.moe_logprob_gap --device cuda --rollout vllm --dtype bfloat16   # the H200
    python -m bench.moe_logprob_gap --dtype bfloat16 --routing-replay    # MoE rows with replay off and on

`--routing-replay` adds a row of the MoE model with `rollout.routing_replay: true` (the trainer's forwards take the
experts the rollout routed each token to; docs/moe.md) next to the one without.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import report

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"moe": "tiny-qwen3-moe-smoke", "dense": "tiny-qwen3-dense-smoke"}


def run(
    model: str, dtype: str, args: argparse.Namespace, work: Path, replay: bool = False
) -> dict[str, object]:
    run_dir = work / f"{model}-{dtype}{'-replay' if replay else ''}"
    sets = [
        f"rollout.routing_replay={str(replay).lower()}",
        f"model.path={model}",
        f"model.dtype={dtype}",
        f"run.steps={args.steps}",
        f"rollout.engine={args.rollout}",
        f"cluster.device={args.device}",
        "run.health.max_logprob_diff=null",
        "data.val=null",
    ]
    if args.device == "cuda":  # one GPU shared by trainer and vLLM; eager vLLM starts in seconds
        sets += ["rollout.gpu_memory_utilization=0.15", "rollout.enforce_eager=true"]
    cmd = [sys.executable, "-m", "rlbridge", "train", "recipes/moe-lora-cpu.yaml", "--run-dir", str(run_dir)]
    for s in sets:
        cmd += ["--set", s]
    # keep the caller's PYTHONPATH (the GPU machine's packages live in /tmp/site, named only there)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONWARNINGS": "ignore"}
    env.setdefault("RLBRIDGE_CACHE", str(work / "cache"))
    start = time.time()
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{(res.stdout + res.stderr)[-4000:]}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    train = [r for r in map(json.loads, lines) if r["kind"] == "train"]
    mean = sum(r["logprob_diff_mean"] for r in train) / len(train)
    top = max(r["logprob_diff_max"] for r in train)
    update = sum(r.get("time_update", 0.0) for r in train) / len(train)
    return {
        "model": model,
        "dtype": dtype,
        "routing_replay": replay,
        "steps": len(train),
        "lp_diff_mean": mean,
        "lp_diff_max": top,
        "update_s": update,
        "wall_s": time.time() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rollout", default="hf", choices=["hf", "vllm"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--routing-replay", action="store_true", help="also the MoE with rollout.routing_replay"
    )
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="moe_gap_"))
    cases = [("moe", False)] + ([("moe", True)] if args.routing_replay else []) + [("dense", False)]
    rows = [run(MODELS[kind], dtype, args, work, replay) for dtype in args.dtype for kind, replay in cases]
    name = f"moe_routing_replay-{args.device}" if args.routing_replay else "moe_logprob_gap"
    report(name, {"rollout": args.rollout, "device": args.device}, rows, save=not args.no_save)


if __name__ == "__main__":
    main()
