"""In-loop generation against vLLM on its own, on the same prompts and sampling (issue 16 goal 2: >= 70 %).

    python bench/generation_gap.py [--recipe recipes/quickstart.yaml] [--steps 6] [--set KEY=VALUE ...]
                                   [--alone mp|inproc|both] [--no-save]

1. `rlbridge train RECIPE --set run.steps=N ...` (sync mode: the phase `generate` is timed alone); per step the
   generated tokens (metrics `tokens`) over `time_generate`. Step 1 is left out (vLLM's first call warms up).
2. In a child process, after the run has ended (so on a GPU nothing else holds the device): `vllm.LLM` with the
   arguments rlbridge's engine passes (rollout/vllm_compat.py `engine_kwargs`: dtype, max_model_len, TP,
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
core in a process of its own) unless `--alone inproc` (`--alone both`: one after the other): the figures separate the
loop's own overhead from that choice. `engine_s`: the seconds inside `LLM.generate` of the loop's rollout (its log
lines), so loop_s - engine_s is the Ray call, the transfer and rlbridge's conversion. Prints JSON and a table; with --save (the default) a dated copy in bench/results/generation_gap-DATE.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import report, rlbridge_train  # noqa: E402

ENGINE_LINE = re.compile(
    r"vLLM generate: (\d+) rows, (\d+) tokens in ([\d.]+) s \(engine ([\d.]+) s, [\d.]+ tokens/s in the engine\)$",
    re.MULTILINE,
)
"""The line rlbridge/rollout/vllm.py logs per generate into logs/rollout.log."""


def in_loop(recipe: str, run_dir: Path, sets: list[str]) -> list[dict[str, Any]]:
    """Per step: generated tokens and the loop's `time_generate`; `engine_s` (inside `LLM.generate`, the re-seed
    included) from the rollout's log, where it has the lines (the greedy evaluation calls' lines are left out)."""
    rlbridge_train(recipe, run_dir, sets)
    from rlbridge.report.run import read_run

    steps = read_run(run_dir).train
    if any("time_generate" not in r for r in steps):
        raise SystemExit(
            "no time_generate in the run's metrics: run it in sync mode (--set rollout.mode=sync)"
        )
    log_path = run_dir / "logs" / "rollout.log"
    engine = [m.groups() for m in ENGINE_LINE.finditer(log_path.read_text())] if log_path.exists() else []
    rows = [
        {"step": int(r["step"]), "tokens": int(r["tokens"]), "s": float(r["time_generate"])} for r in steps
    ]
    if len(engine) == len(rows):
        for row, (_, _, call_s, engine_s) in zip(rows, engine, strict=True):
            row.update(call_s=float(call_s), engine_s=float(engine_s))
    else:
        print(
            f"[gengap] {len(engine)} engine lines in {log_path} for {len(rows)} steps: no split",
            file=sys.stderr,
        )
    return rows


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
    from rlbridge.rollout.vllm_compat import engine_env, engine_kwargs

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
        ignore_eos=ro.ignore_eos,
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


def _rate(rows: list[dict[str, Any]], tokens: str, seconds: str) -> float | None:
    """Tokens/s summed over steps 2..N (step 1 warms up); None where a row lacks the figure."""
    timed = rows[1:]
    if any(seconds not in r for r in timed):
        return None
    return sum(r[tokens] for r in timed) / sum(r[seconds] for r in timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="recipes/quickstart.yaml")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument(
        "--alone",
        choices=("mp", "inproc", "both"),
        default="mp",
        help="vLLM alone with its engine core in its own process (mp, vLLM's default), in-process "
        "(VLLM_ENABLE_V1_MULTIPROCESSING=0, as in rlbridge), or both one after the other",
    )
    ap.add_argument("--inproc", action="store_true", help=argparse.SUPPRESS)  # the child's mode
    ap.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.steps < 2:
        raise SystemExit("--steps must be at least 2 (step 1 warms up)")
    if a.child is not None:
        if a.inproc:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        _standalone_child(a.recipe, a.sets, a.steps, a.child)
        return
    sets = [*a.sets, f"run.steps={a.steps}", "rollout.mode=sync", "run.eval_every=0", "data.val=null"]
    with tempfile.TemporaryDirectory(prefix="rlbridge-gengap-") as tmp:
        loop_rows = in_loop(a.recipe, Path(tmp) / "run", sets)
    print(
        f"in the loop: {json.dumps(loop_rows)}; now vLLM alone on the same prompts",
        file=sys.stderr,
        flush=True,
    )
    modes = ("mp", "inproc") if a.alone == "both" else (a.alone,)
    alone = {m: standalone(a.recipe, sets, a.steps, inproc=m == "inproc") for m in modes}
    rows = []
    for i, lp in enumerate(loop_rows):
        row = {"step": lp["step"], "loop_tokens": lp["tokens"], "loop_s": lp["s"]}
        row.update({k: lp[k] for k in ("call_s", "engine_s") if k in lp})
        row["loop_tok_s"] = lp["tokens"] / lp["s"]
        for m, sa in alone.items():
            row.update(
                {
                    f"{m}_tokens": sa[i]["tokens"],
                    f"{m}_s": sa[i]["s"],
                    f"{m}_tok_s": sa[i]["tokens"] / sa[i]["s"],
                }
            )
        rows.append(row)
    loop_rate = _rate(rows, "loop_tokens", "loop_s")
    assert loop_rate is not None
    result: dict[str, Any] = {
        "recipe": a.recipe,
        "steps": a.steps,
        "sets": a.sets,
        "loop_tok_s": loop_rate,
        "loop_engine_tok_s": _rate(rows, "loop_tokens", "engine_s"),
        "goal": ">= 0.70 (issue 16 goal 2)",
    }
    for m in modes:
        rate = _rate(rows, f"{m}_tokens", f"{m}_s")
        assert rate is not None
        result[f"alone_{m}_tok_s"] = rate
        result[f"loop_over_alone_{m}"] = loop_rate / rate
    report("generation_gap", result, rows, save=not a.no_save)


if __name__ == "__main__":
    main()
