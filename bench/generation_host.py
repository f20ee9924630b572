"""What vLLM's per-token host work costs a rollout: texts and log-probs asked of vLLM against token ids only.

rlbridge's vLLM rollout asks for the sampled tokens' log-probs (logprobs=0). Until 2026-12-02 it also let vLLM
detokenize: vLLM then decodes every generated token incrementally inside its engine loop, and decodes the token
of every returned log-prob as well, and builds a dict and a Logprob object per token. Now it asks for token ids
and flat log-prob lists only (`detokenize=False`, `flat_logprobs=True`) and decodes the texts in one batch at the
end (rlbridge/rollout/vllm.py). Where generation is host-bound (a small model, many sequences: SmolLM2 at 512+
rollouts on an H200, where in-loop generation made 8.7-15k tokens/s against ~30k for vLLM alone,
bench/results/growth-gpu-2026-12-02.md), that work is a large share of each engine step.

Both ways on the same engine (in-process engine core, as rlbridge runs it), the same prompts, every response run
to max_tokens (ignore_eos), each timed from the generate call to the finished texts and log-probs lists:

- `before`: SamplingParams(logprobs=0, skip_special_tokens=True), `completion.text`, a Logprob per token;
- `now`:    VllmRollout.generate (detokenize=False, flat_logprobs=True, one tokenizer.batch_decode).

    python bench/generation_host.py [--model tiny|smollm2] [--prompts 128] [--n 4] [--max-tokens 64] [--reps 3]

`tiny` is the tests' 2-layer random Llama (hidden 64): its forward costs next to nothing on a CPU, so the host
work is what is measured, as on a GPU with a small model. `smollm2` is the real model, compute-bound on a CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import report  # noqa: E402


def model_and_prompts(which: str, num: int, max_tokens: int) -> tuple[Path, list[list[int]]]:
    if which == "tiny":
        from tests.fixtures.tiny_llama import BOS_ID, IM_START_ID, build_tiny_llama

        d = Path(tempfile.mkdtemp(prefix="gen-host-")) / "tiny"
        build_tiny_llama(d)
        return d, [[BOS_ID, IM_START_ID] + [65 + (i * 7 + j) % 50 for j in range(20)] for i in range(num)]
    from bench.rollout_throughput import prompts  # the quickstart's prompts, as rollout_throughput times them

    (_, model_dir), ids = prompts(num, max_tokens, "float32")
    return Path(model_dir), ids


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-save", action="store_true")
    a = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from rlbridge.recipe.schema import ModelCfg, RolloutCfg
    from rlbridge.rollout.base import SamplingCfg
    from rlbridge.rollout.vllm import VllmRollout

    model_dir, prompts = model_and_prompts(a.model, a.prompts, a.max_tokens)
    cfg = RolloutCfg(engine="vllm", max_prompt_tokens=256, max_response_tokens=a.max_tokens, kv_cache_gib=2)
    engine = VllmRollout(
        model_dir, cfg, ModelCfg(path=str(model_dir), dtype="float32"), lora_rank=0, seed=0, cpu=True
    )
    sampling = SamplingCfg(
        n=a.n, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=a.max_tokens, ignore_eos=True
    )
    before_params = SamplingParams(
        n=a.n, temperature=1.0, max_tokens=a.max_tokens, ignore_eos=True, logprobs=0, skip_special_tokens=True
    )
    requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]

    def before() -> int:
        outputs = engine._llm.generate(requests, before_params, use_tqdm=False)
        texts, logprobs = [], []
        for request in outputs:
            for c in sorted(request.outputs, key=lambda c: c.index):
                texts.append(c.text)
                logprobs.append(
                    [float(step[t].logprob) for step, t in zip(c.logprobs, c.token_ids, strict=True)]
                )
        return sum(len(x) for x in logprobs)

    def now() -> int:
        out = engine.generate(prompts, sampling, expect_version=0)
        return sum(len(x) for x in out.response_logprobs)

    rows: list[dict[str, Any]] = []
    before()  # warm-ups
    now()
    seconds: dict[str, list[float]] = {"before": [], "now": []}
    tokens = {}
    for _ in range(a.reps):  # interleaved, so that a load change hits both
        for name, fn in (("before", before), ("now", now)):
            start = time.perf_counter()
            tokens[name] = fn()
            seconds[name].append(time.perf_counter() - start)
    for name in ("before", "now"):
        s = statistics.median(seconds[name])
        rows.append({"way": name, "tokens": tokens[name], "median_s": s, "tokens_per_s": tokens[name] / s})
    ratio = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    settings = {"model": a.model, "prompts": a.prompts, "n": a.n, "max_tokens": a.max_tokens, "reps": a.reps}
    report("generation_host", {"settings": settings, "now_over_before": ratio}, rows, save=not a.no_save)
    engine.shutdown()


if __name__ == "__main__":
    main()
