"""vLLM's log-probs of fixed texts under a model directory, in a process of its own (one vLLM engine per
process; test_gpu_kill_resume_export.py starts it on an `export-hf` output).

    python tests/gpu/vllm_score_job.py --model DIR --device cuda|cpu --dtype bfloat16 --out SCORES.json
        [--gpu-memory-utilization 0.1]   # enough for small models; a 7B's weights need ~0.5 of an H200

The engine is built from rlbridge's own `engine_kwargs` (what a run's rollout gets: raw log-probs, the
dtype), with eager mode on CUDA too (no torch.compile / CUDA graphs: ~1 min less start-up, same kernels for
one forward of each text) and without LoRA or sleep mode. Each text of tests/gpu/common.TEXTS (chat prompt +
answer) is scored with `prompt_logprobs=0`: the log-prob of every given token under the model. Writes
{"prompts": [[ids]], "answers": [[ids]], "logprobs": [[answer token log-probs]], "startup_s": s}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.gpu.common import TEXTS, fixed_sequences  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", choices=["cuda", "cpu"], required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--gpu-memory-utilization", type=float, default=0.1, help="raise for large models (7B: 0.5)"
    )
    args = ap.parse_args()
    os.environ.setdefault(
        "VLLM_ENABLE_V1_MULTIPROCESSING", "0"
    )  # engine core in this process, as VllmRollout has it
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from rlbridge.model.tokenizer import load_tokenizer
    from rlbridge.recipe.schema import ModelCfg, RolloutCfg
    from rlbridge.rollout.vllm_compat import engine_kwargs

    rows = fixed_sequences(load_tokenizer(Path(args.model)), len(TEXTS))
    cpu = args.device == "cpu"
    cfg = RolloutCfg(engine="vllm", max_prompt_tokens=192, max_response_tokens=64, gpu_memory_utilization=args.gpu_memory_utilization,
                     kv_cache_gib=0.25)  # fmt: skip
    kwargs = engine_kwargs(
        args.model, cfg, ModelCfg(path=args.model, dtype=args.dtype), lora_rank=0, seed=0, cpu=cpu
    )
    kwargs.update(enforce_eager=True, enable_sleep_mode=False)
    start = time.perf_counter()
    llm = LLM(**kwargs)
    startup_s = time.perf_counter() - start
    outs = llm.generate([TokensPrompt(prompt_token_ids=p + a) for p, a in rows],
                        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0), use_tqdm=False)  # fmt: skip
    logprobs = []
    for (prompt, answer), out in zip(rows, outs, strict=True):
        ids = prompt + answer
        per_pos: Any = out.prompt_logprobs  # [None, {token: Logprob}, ...], one entry per prompt token
        assert per_pos is not None and len(per_pos) == len(ids), "vLLM returned no prompt log-probs"
        logprobs.append([float(per_pos[i][ids[i]].logprob) for i in range(len(prompt), len(ids))])
    Path(args.out).write_text(json.dumps({"prompts": [p for p, _ in rows], "answers": [a for _, a in rows],
                                          "logprobs": logprobs, "startup_s": startup_s}))  # fmt: skip
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
