"""vLLM-CPU generation time by KV-cache block size (rollout/vllm_compat.CPU_BLOCK_SIZE), on the quickstart's work.

Each round starts one engine per block size, alternating (A B A B), in a fresh process: SmolLM2-135M-Instruct in
float32 (in-process engine core, eager, unchunked prefill, 1 GiB KV cache: what rlbridge asks on a CPU), 8
two-digit addition chat prompts x `--n` samples (per-prompt seeds), <= `--max-tokens` tokens, the prefix cache
reset before every call (rlbridge resets it after every weight sync, so no call reuses an earlier one's prompts).
Every call after the first of each process is timed and kept; the report gives the median per block size. The
same seeds give the same tokens under every block size (token counts are compared).

    python bench/vllm_cpu_block.py [--blocks 128 32] [--rounds 3] [--calls 4] [--max-tokens 48] [--ignore-eos]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import report  # noqa: E402


def engine_calls(block: int, calls: int, n: int, max_tokens: int, ignore_eos: bool) -> list[dict[str, float]]:
    """In this process: one engine at `block`, `calls` + 1 generate calls (the first untimed)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from rlbridge.model.cache import materialize

    model = str(materialize("smollm2-135m-instruct"))
    tok = AutoTokenizer.from_pretrained(model)
    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=128 + max_tokens,
        seed=1,
        logprobs_mode="raw_logprobs",
        enforce_eager=True,
        kv_cache_memory_bytes=1 << 30,
        enable_chunked_prefill=False,
        max_num_batched_tokens=4096,
        block_size=block,
    )
    rng = random.Random(0)
    out = []
    for call in range(calls + 1):
        prompts = [
            tok.apply_chat_template(
                [
                    {
                        "role": "user",
                        "content": f"What is {rng.randint(10, 99)} + {rng.randint(10, 99)}? "
                        "Put the final answer after '####'.",
                    }
                ],
                tokenize=False,
                add_generation_prompt=True,
            )
            for _ in range(8)
        ]
        params = [
            SamplingParams(
                n=n,
                temperature=1.0,
                max_tokens=max_tokens,
                ignore_eos=ignore_eos,
                logprobs=0,
                seed=100 * call + i,
                detokenize=False,
            )
            for i in range(8)
        ]
        llm.reset_prefix_cache()
        start = time.perf_counter()
        done = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(c.token_ids) for o in done for c in o.outputs)
        if call:
            out.append({"call": call, "seconds": seconds, "tokens": tokens})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, nargs="+", default=[128, 32])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        print("RESULT " + json.dumps(engine_calls(a.child, a.calls, a.n, a.max_tokens, a.ignore_eos)))
        return
    runs: dict[int, list[dict[str, float]]] = {b: [] for b in a.blocks}
    for rnd in range(a.rounds):
        for block in a.blocks:
            cmd = [
                sys.executable,
                __file__,
                "--child",
                str(block),
                "--calls",
                str(a.calls),
                "--n",
                str(a.n),
                "--max-tokens",
                str(a.max_tokens),
            ] + (["--ignore-eos"] if a.ignore_eos else [])
            proc = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
            line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
            calls = json.loads(line[len("RESULT ") :])
            runs[block] += [{"round": rnd + 1, **c} for c in calls]
            print(
                f"round {rnd + 1} block {block}: " + ", ".join(f"{c['seconds']:.2f}" for c in calls),
                flush=True,
            )
    tokens = {b: [c["tokens"] for c in runs[b]] for b in a.blocks}
    rows = [
        {
            "block_size": b,
            "median_s": statistics.median(c["seconds"] for c in runs[b]),
            "min_s": min(c["seconds"] for c in runs[b]),
            "max_s": max(c["seconds"] for c in runs[b]),
            "calls": len(runs[b]),
            "tokens_per_call": statistics.median(tokens[b]),
        }
        for b in a.blocks
    ]
    same = all(tokens[b] == tokens[a.blocks[0]] for b in a.blocks)
    name = "vllm_cpu_block" + ("-long" if a.max_tokens > 128 else "")
    report(f"{name}-cpu", {"config": vars(a), "runs": runs, "same_tokens": same}, rows, save=not a.no_save)
    print(f"same token counts under every block size: {same}")


if __name__ == "__main__":
    main()
