"""In-loop generation against vLLM on its own, on the same prompts and sampling (issue 16 goal 2: >= 70 %).

    python bench/generation_gap.py [--recipe recipes/quickstart.yaml] [--steps 6] [--set KEY=VALUE ...]
                                   [--no-save]

1. `rlbridge train RECIPE --set run.steps=N ...` (sync mode: the phase `generate` is timed alone); per step the
   generated tokens (metrics `tokens`) over `time_generate`. Step 1 is left out (vLLM's first call warms up).
2. In a child process, after the run has ended (so on a GPU nothing else holds the device): `vllm.LLM` with the
   arguments rlbridge's engine passes (rollout/vllm.py `engine_kwargs`: dtype, max_model_len, TP,
   gpu_memory_utilization, enforce_eager, sleep mode on a GPU, the KV-cache size on a CPU; its environment and,
   on a CPU, torch threads on every core, as the sync loop's rollout has) but no LoRA, and the
   very prompts of steps 2..N (the run's prompt sampler, replayed with its seed), n completions each at the
   recipe's temperature / top-p / top-k / max tokens, the sampled tokens' log-probs as rlbridge asks. One
   warm-up call on step 1's prompts, then one timed call per step.

The ratio is in-loop tokens/s over standalone tokens/s (sums over steps 2..N). What separates them: the loop's
Ray call and result transfer, rlbridge's re-seeding and output conversion, and with `rollout.weight_sync:
adapter` vLLM's LoRA kernels (the standalone engine has none: set `--set rollout.weight_sync=merged` for the
like-for-like figure). The response lengths differ (the run's policy moves, the standalone one is the base
model), which tokens/s absorbs. rlbridge runs vLLM's engine core inside its rollout worker's
process (VLLM_ENABLE_V1_MULTIPROCESSING=0, for reproducible batches); vLLM alone keeps its default (the engine
core in a process of its own) unless `--inproc`: the two figures separate the loop's own overhead from that
choice. Prints JSON and a table; with --save (the default) a dated copy in bench/results/generation_gap-DATE.{json,md}.
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import report, rlbridge_train  # noqa: E402


def in_loop(recipe: str, run_dir: Path, sets: list[str]) -> list[dict[str, Any]]:
    rlbridge_train(recipe, run_dir, sets)
    from rlbridge.report.run import read_run

    steps = read_run(run_dir).train
    if any("time_generate" not in r for r in steps):
        raise SystemExit(
            "no time_generate in the run's metrics: run it in sync mode (--set rollout.mode=sync)"
        )
    return [
        {"step": int(r["step"]), "tokens": int(r["tokens"]), "s": float(r["time_generate"])} for r in steps
    ]


def standalone(recipe: str, sets: list[str], steps: int, *, inproc: bool = False) -> list[dict[str, Any]]:
    """Runs `_standalone_child` in a fresh process (vLLM pins torch threads and holds the device)."""
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        args = [sys.executable, __file__, "--child", out.name, "--recipe", recipe, "--steps", str(steps)]
        args += ["--inproc"] if inproc else []
        for s in sets:
            args += ["--set", s]
        res = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
        if res.returncode != 0:
            raise SystemExit(
                f"standalone vLLM failed ({res.returncode}):\n{(res.stdout + res.stderr)[-4000:]}"
            )
        return list(json.loads(Path(out.name).read_text()))


def _standalone_child(recipe_path: str, sets: list[str], steps: int, out: Path) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from rlbridge.data.datasets import PromptSampler, encode_prompts, load_dataset
    from rlbridge.model.cache import ensure_model
    from rlbridge.model.tokenizer import load_tokenizer
    from rlbridge.recipe import load_recipe
    from rlbridge.rollout.vllm import engine_env, engine_kwargs

    r = load_recipe(ROOT / recipe_path if not Path(recipe_path).is_absolute() else Path(recipe_path), sets)
    model_dir = ensure_model(r.model.path)
    prompts = load_dataset(r.data.train, r.data, split="train", seed=r.run.seed)
    ids, kept, _ = encode_prompts(load_tokenizer(model_dir), prompts, r.data, r.rollout.max_prompt_tokens)
    sampler = PromptSampler(kept, seed=r.run.seed, shuffle=r.data.shuffle)  # as Session: step k = k-th draw
    plain = r.rollout.model_copy(update={"weight_sync": "merged", "routing_replay": False})
    kwargs = engine_kwargs(
        model_dir, plain, r.model, lora_rank=0, seed=r.run.seed, cpu=r.cluster.device == "cpu"
    )
    kwargs.pop("worker_extension_cls", None)
    # as rlbridge's engine (rollout/vllm.py): its environment, and on a CPU torch threads on every core (the
    # sync loop's rollout gets them all) before vLLM's in-process CPU worker fixes its thread count
    os.environ.update(engine_env(plain, os.environ))
    if r.cluster.device == "cpu":
        import torch

        torch.set_num_threads(os.cpu_count() or 1)
    llm = LLM(**kwargs)
    ro = r.rollout
    params = SamplingParams(
        n=ro.n,
        max_tokens=ro.max_response_tokens,
        temperature=ro.temperature,
        top_p=ro.top_p,
        top_k=ro.top_k if ro.top_k > 0 else 0,
        logprobs=0,
        skip_special_tokens=True,
    )
    rows: list[dict[str, Any]] = []
    for step in range(1, steps + 1):
        batch = [TokensPrompt(prompt_token_ids=list(ids[i])) for i in sampler.next_indices(r.data.batch_size)]
        start = time.perf_counter()
        outputs = llm.generate(batch, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        rows.append({"step": step, "tokens": tokens, "s": seconds})  # step 1: the warm-up call
    out.write_text(json.dumps(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="recipes/quickstart.yaml")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument(
        "--inproc",
        action="store_true",
        help="vLLM alone with its engine core in-process too (VLLM_ENABLE_V1_MULTIPROCESSING=0, as in rlbridge)",
    )
    ap.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.steps < 2:
        raise SystemExit("--steps must be at least 2 (step 1 warms up)")
    if a.child is not None:
        if a.inproc:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        _standalone_child(a.recipe, a.sets, a.steps, a.child)
        return
    sets = [*a.sets, f"run.steps={a.steps}", "rollout.mode=sync", "run.eval_every=0"]
    with tempfile.TemporaryDirectory(prefix="rlbridge-gengap-") as tmp:
        loop_rows = in_loop(a.recipe, Path(tmp) / "run", sets)
    print(
        f"in the loop: {json.dumps(loop_rows)}; now vLLM alone on the same prompts",
        file=sys.stderr,
        flush=True,
    )
    alone_rows = standalone(a.recipe, sets, a.steps, inproc=a.inproc)
    rows = []
    for lp, sa in zip(loop_rows, alone_rows, strict=True):
        rows.append(
            {
                "step": lp["step"],
                "loop_tokens": lp["tokens"],
                "loop_s": lp["s"],
                "loop_tok_s": lp["tokens"] / lp["s"],
                "standalone_tokens": sa["tokens"],
                "standalone_s": sa["s"],
                "standalone_tok_s": sa["tokens"] / sa["s"],
            }
        )
    timed = rows[1:]
    loop_rate = sum(r["loop_tokens"] for r in timed) / sum(r["loop_s"] for r in timed)
    alone_rate = sum(r["standalone_tokens"] for r in timed) / sum(r["standalone_s"] for r in timed)
    result = {
        "recipe": a.recipe,
        "steps": a.steps,
        "sets": a.sets,
        "loop_tok_s": loop_rate,
        "standalone_tok_s": alone_rate,
        "loop_over_standalone": loop_rate / alone_rate,
        "standalone_engine_core": "in-process" if a.inproc else "vLLM's default (its own process)",
        "goal": ">= 0.70 (issue 16 goal 2)",
    }
    report("generation_gap", result, rows, save=not a.no_save)


if __name__ == "__main__":
    main()
