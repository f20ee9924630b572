"""Held-out accuracy after the same wall-clock time: TRL's GRPOTrainer, rlbridge sync and rlbridge async.

    TRL_VENV=/tmp/trl-venv bash bench/setup_trl.sh
    PYTHONPATH=$PWD /tmp/trl-venv/bin/python bench/equal_wall.py --recipe recipes/quickstart.yaml --wall-s 240 \
        --seeds 1 2 3 --out DIR
    python bench/equal_wall.py --out DIR --summarize-only

Speed is only worth having if it buys learning: each arm trains the recipe's work (bench/trl_grpo.py builds TRL's
side from it: same model, LoRA, prompts in the same order, samples, lengths, lr, one optimizer step per batch,
TRL with the whole batch in one micro-batch, the same allocator settings on a CPU) from its process start for
--wall-s seconds. What is scored is the adapter of the **last optimizer step that ended within that time** (the
rule is the same for every arm): TRL keeps a copy of its LoRA weights at each step end inside the time and stops at
the first step end past it; rlbridge runs with run.time_limit_s at the time (it saves after the last step whose
successor and a save would not fit, and exits 75: its save time counts against it, and its estimate may stop it a
step early), and that step's checkpoint is exported with `rlbridge export-hf --adapter-only`. A step that ran past
the time after all (slower than the estimate) is the one saved: it is scored and its overrun is reported
(`overran_s`); a run still going at the time plus STOP_GRACE_S is stopped with SIGTERM.

One evaluator scores every adapter, so neither tool's own evaluation enters: the base model with the adapter merged
(peft), float32, transformers greedy decoding of the first run.eval_samples validation prompts of the arm's seed
(those rlbridge's own evaluation uses), at most rollout.max_response_tokens new tokens, scored by the recipe's first
eval metric (its reward term at its threshold). The base model without an adapter is scored once per seed.

Arms run one at a time, their order rotated per seed (A B C, B C A, C A B). Files in DIR, flat: <arm>-s<seed>.json
(steps inside the time, their end times, the accuracy), <arm>-s<seed>.log (tail of the console), rlbridge's
metrics.jsonl as <arm>-s<seed>.metrics.jsonl, summary.json and summary.md (mean and per-seed accuracy per arm).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import trl_grpo  # noqa: E402
from bench.ab_rounds import cpu_env, machine  # noqa: E402
from bench.common import keep_log  # noqa: E402
from bench.proctree import LineArrivals  # noqa: E402
from rlbridge.run.checkpoint import list_checkpoints  # noqa: E402

ARMS: dict[str, list[str] | None] = {"trl": None, "rlbridge-sync": [], "rlbridge-async": trl_grpo.ASYNC}
"""Arm -> rlbridge's overrides (None: TRL's GRPOTrainer)."""

MAX_STEPS = 1000
"""Steps asked of each arm: more than any fits in the time, so the time ends every run."""

STOP_GRACE_S = 120.0
"""How long a stopped run may take to save and exit before its process group is killed."""

RUN_FILE = re.compile(r"[a-z-]+-s\d+\.json")
"""An arm's result file in --out (not TRL's record, not the summary)."""

RLBRIDGE_SETS = ["run.save_every=0", "run.eval_every=0"]
"""Besides run.time_limit_s: no saves but the time limit's, no evaluation inside the time."""


# ------------------------------------------------------------------------------------------ the arithmetic
def scored_step(saved: list[int], ends: dict[int, float], deadline: float) -> tuple[int, float]:
    """rlbridge's scored step: its last saved one (the time limit's save), and how far past `deadline` it ended
    (0.0 inside; the step's end unknown: 0.0). (0, 0.0) when nothing was saved."""
    if not saved:
        return 0, 0.0
    step = max(saved)
    return step, max(0.0, ends.get(step, deadline) - deadline)


def rotation(arms: list[str], k: int) -> list[str]:
    """The arms' order for the k-th seed (0-based): rotated by k, so each arm runs first, second, ... in turn."""
    k %= len(arms)
    return arms[k:] + arms[:k]


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm: the accuracy of each seed, their mean and min-max, the mean number of steps inside the time; and each
    arm's mean difference to TRL over the seeds both completed."""
    by_arm: dict[str, dict[int, dict[str, Any]]] = {}
    for run in runs:
        if run.get("accuracy") is not None:
            by_arm.setdefault(run["arm"], {})[run["seed"]] = run
    out: dict[str, Any] = {}
    for arm, seeds in sorted(by_arm.items()):
        acc = [seeds[s]["accuracy"] for s in sorted(seeds)]
        out[arm] = {
            "seeds": sorted(seeds),
            "accuracy": acc,
            "accuracy_mean": statistics.fmean(acc),
            "accuracy_min": min(acc),
            "accuracy_max": max(acc),
            "steps_mean": statistics.fmean(seeds[s]["steps"] for s in seeds),
        }
        if arm != "trl" and "trl" in by_arm:
            both = sorted(set(seeds) & set(by_arm["trl"]))
            if both:
                out[arm]["minus_trl"] = statistics.fmean(
                    seeds[s]["accuracy"] - by_arm["trl"][s]["accuracy"] for s in both
                )
    return out


# ------------------------------------------------------------------------------------------ the arms
def run_rlbridge_arm(a: argparse.Namespace, arm: str, seed: int, work: Path) -> dict[str, Any]:
    """`rlbridge train` with run.time_limit_s a.wall_s (SIGTERM STOP_GRACE_S later if it still runs); the adapter
    of the step it saved."""
    run_dir = work / f"{arm}-s{seed}"
    sets = [
        f"run.steps={MAX_STEPS}",
        f"run.seed={seed}",
        "data.val=null",
        *RLBRIDGE_SETS,
        f"run.time_limit_s={a.wall_s}",
        *(ARMS[arm] or []),
        *a.sets,
    ]
    cmd = [sys.executable, "-m", "rlbridge", "train", a.recipe, "--run-dir", str(run_dir)]
    cmd += [arg for s in sets for arg in ("--set", s)]
    log = work / f"{arm}-s{seed}.log"
    r = trl_grpo.recipe(1, [f"run.seed={seed}", *a.sets])
    t0 = time.time()
    with log.open("w") as f:
        proc = trl_grpo.start_group(cmd, f, cpu_env(r))
        with LineArrivals(run_dir / "metrics.jsonl") as arrivals:
            try:
                rc = proc.wait(timeout=a.wall_s + STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGTERM)
                try:
                    rc = proc.wait(timeout=STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    trl_grpo.kill_group(proc.pid)
                    rc = proc.wait()
    trl_grpo.end_group(proc.pid)
    ends = {
        rec["step"]: t - t0
        for t, rec in ((t, json.loads(line)) for t, line in arrivals.lines)
        if rec.get("kind") == "train"
    }
    saved = [i.step for i in list_checkpoints(run_dir, hashes=False) if i.complete]
    step, overran = scored_step(saved, ends, a.wall_s)
    res: dict[str, Any] = {
        "rc": rc,
        "steps": step,
        "step_ends_s": ends,
        "time_limit_s": a.wall_s,
        "overran_s": overran,
    }
    keep_log(log, a.out / f"{arm}-s{seed}.log")
    if (run_dir / "metrics.jsonl").exists():
        (a.out / f"{arm}-s{seed}.metrics.jsonl").write_bytes((run_dir / "metrics.jsonl").read_bytes())
    if step:
        adapter = work / f"{arm}-s{seed}-adapter"
        export = [sys.executable, "-m", "rlbridge", "export-hf", str(run_dir), "--out", str(adapter)]
        subprocess.run(
            [*export, "--adapter-only", "--step", str(step)], cwd=ROOT, check=True, capture_output=True
        )
        res["adapter"] = str(adapter)
    return res


def run_trl_arm(a: argparse.Namespace, seed: int, work: Path) -> dict[str, Any]:
    """TRL's GRPOTrainer in a child process that stops itself at the time and saves the last step's adapter."""
    adapter, record = work / f"trl-s{seed}-adapter", work / f"trl-s{seed}.record.json"
    log = work / f"trl-s{seed}.log"
    r = trl_grpo.recipe(1, [f"run.seed={seed}", *a.sets])
    t0 = time.time()
    cmd = [
        sys.executable,
        __file__,
        "--recipe",
        a.recipe,
        "--child-trl",
        str(record),
        "--adapter-out",
        str(adapter),
    ]
    cmd += [
        "--deadline",
        str(t0 + a.wall_s),
        "--seeds",
        str(seed),
        *[arg for s in a.sets for arg in ("--set", s)],
    ]
    with log.open("w") as f:
        proc = trl_grpo.start_group(cmd, f, cpu_env(r))
        try:
            rc = proc.wait(
                timeout=a.wall_s + STOP_GRACE_S + 600
            )  # its longest step past the time, and the save
        except subprocess.TimeoutExpired:
            trl_grpo.kill_group(proc.pid)
            rc = proc.wait()
    trl_grpo.end_group(proc.pid)
    keep_log(log, a.out / f"trl-s{seed}.log")
    if rc != 0 or not record.exists():
        return {"rc": rc, "steps": 0, "failed": True}
    (a.out / f"trl-s{seed}.record.json").write_bytes(record.read_bytes())
    rec = json.loads(record.read_text())
    ends = {i + 1: t - t0 for i, t in enumerate(rec["step_ends"])}
    res = {
        "rc": rc,
        "steps": rec["adapter_step"],
        "step_ends_s": ends,
        "prompt_ids_match_rlbridge": rec["prompt_ids_match"],
    }
    if rec["adapter_step"]:
        res["adapter"] = str(adapter)
    return res


def child_trl(a: argparse.Namespace) -> None:
    """In TRL's child: trl_grpo.run_trl with a callback that keeps the LoRA weights of every step that ends before
    a.deadline, stops at the first that ends after it, and saves the kept weights as a PEFT adapter."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from transformers import TrainerCallback

    record = Path(a.child_trl)
    kept: dict[str, Any] = {"step": 0, "weights": None}

    class WallStop(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, _args: Any, state: Any, control: Any, model: Any = None, **k: Any) -> None:
            if time.time() <= a.deadline:
                weights = get_peft_model_state_dict(model)
                kept.update(
                    step=state.global_step, weights={n: w.detach().clone() for n, w in weights.items()}
                )
            else:
                control.should_training_stop = True

        def on_train_end(self, _args: Any, _state: Any, _control: Any, model: Any = None, **k: Any) -> None:
            if kept["weights"] is not None:
                set_peft_model_state_dict(model, kept["weights"])
                model.save_pretrained(a.adapter_out)

    sets = [f"run.seed={a.seeds[0]}", *a.sets]
    r = trl_grpo.recipe(1, sets)
    micro = r.rollouts_per_step
    trl_grpo.run_trl(MAX_STEPS, sets, record, use_vllm=False, micro=micro, callbacks=[WallStop()])
    doc = json.loads(record.read_text())
    doc["adapter_step"] = kept["step"]
    record.write_text(json.dumps(doc))


# ------------------------------------------------------------------------------------------ the evaluator
def heldout_accuracy(recipe: str, sets: list[str], seed: int, adapter: str | None) -> dict[str, Any]:
    """The recipe's first eval metric on its first run.eval_samples validation prompts (seed `seed`), greedy, from
    the base model with `adapter` merged (None: the base model)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlbridge.data.datasets import encode_prompts, load_dataset
    from rlbridge.data.rewards import BUILTINS
    from rlbridge.model.cache import ensure_model
    from rlbridge.model.tokenizer import load_tokenizer
    from rlbridge.recipe import load_recipe

    r = load_recipe(Path(recipe), [f"run.seed={seed}", *sets])
    assert r.data.val is not None, "the recipe needs data.val"
    metric = r.eval.metrics[0]
    term = next(t for t in r.reward.terms if t.fn == metric.term)
    model_dir = ensure_model(r.model.path)
    tok = load_tokenizer(model_dir)
    prompts = load_dataset(r.data.val, r.data, split="val", seed=seed)[: r.run.eval_samples]
    ids, kept, _ = encode_prompts(tok, prompts, r.data, r.rollout.max_prompt_tokens)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    model.eval()
    width = max(len(x) for x in ids)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=r.rollout.max_response_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
    texts = tok.batch_decode(out[:, width:], skip_special_tokens=True)
    fn = BUILTINS[term.fn]
    scores = [fn(p.text, text, p.sample) for p, text in zip(kept, texts, strict=True)]
    hits = [s if metric.threshold is None else float(s >= metric.threshold) for s in scores]
    return {"accuracy": sum(hits) / len(hits), "eval_prompts": len(hits), "metric": metric.key}


# ------------------------------------------------------------------------------------------ the driver
def markdown(a: argparse.Namespace, summary: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    lines = [
        f"Held-out accuracy after {a.wall_s:.0f} s of wall time from process start ({a.recipe}; bench/equal_wall.py)",
        "",
        "| arm | mean accuracy | min-max | per seed | steps inside the time (mean) | minus TRL (mean over seeds) |",
        "|---|---|---|---|---|---|",
    ]
    for arm, s in summary.items():
        per_seed = ", ".join(f"{x:.2f}" for x in s["accuracy"])
        minus = f"{s['minus_trl']:+.3f}" if "minus_trl" in s else ""
        lines.append(
            f"| {arm} | {s['accuracy_mean']:.3f} | {s['accuracy_min']:.2f}-{s['accuracy_max']:.2f} | {per_seed} "
            f"| {s['steps_mean']:.1f} | {minus} |"
        )
    lines += [
        "",
        "| seed | arm | steps inside the time | accuracy | rc | past the time (s) |",
        "|---|---|---|---|---|---|",
    ]
    for run in runs:
        acc = "" if run.get("accuracy") is None else f"{run['accuracy']:.2f}"
        over = f"{run['overran_s']:.1f}" if run.get("overran_s") else ""
        lines.append(
            f"| {run['seed']} | {run['arm']} | {run['steps']} | {acc} | {run.get('rc', '')} | {over} |"
        )
    return "\n".join(lines) + "\n"


def write_summary(a: argparse.Namespace, runs: list[dict[str, Any]]) -> None:
    summary = summarize(runs)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    doc = {
        "wall_s": a.wall_s,
        "recipe": a.recipe,
        "sets": a.sets,
        "commit": commit.stdout.strip(),
        "machine": machine(),
    }
    doc["arms"] = summary
    (a.out / "summary.json").write_text(json.dumps(doc, indent=1))
    (a.out / "summary.md").write_text(markdown(a, summary, runs))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default=str(trl_grpo.RECIPE))
    ap.add_argument(
        "--wall-s", type=float, default=300.0, help="training time of each arm from its process start"
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--set", action="append", default=[], dest="sets", help="recipe override for every arm")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--summarize-only", action="store_true")
    ap.add_argument("--child-trl", help=argparse.SUPPRESS)
    ap.add_argument("--adapter-out", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    a = ap.parse_args()
    trl_grpo.RECIPE = Path(a.recipe).resolve()
    if a.child_trl:
        child_trl(a)
        return
    if a.out is None:
        ap.error("--out is required")
    a.out.mkdir(parents=True, exist_ok=True)
    runs = [json.loads(p.read_text()) for p in sorted(a.out.glob("*.json")) if RUN_FILE.fullmatch(p.name)]
    if a.summarize_only:
        write_summary(a, runs)
        print((a.out / "summary.md").read_text())
        return
    work = Path(tempfile.mkdtemp(prefix="equal-wall-"))
    try:
        measure_arms(a, runs, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # run directories and adapters: ~0.3 GB an arm
    print((a.out / "summary.md").read_text())


def measure_arms(a: argparse.Namespace, runs: list[dict[str, Any]], work: Path) -> None:
    for k, seed in enumerate(a.seeds):
        base = heldout_accuracy(a.recipe, a.sets, seed, None)
        print(f"[equal-wall] seed {seed}: base model accuracy {base['accuracy']:.2f}", flush=True)
        runs.append({"arm": "base", "seed": seed, "steps": 0, **base})
        (a.out / f"base-s{seed}.json").write_text(json.dumps(runs[-1], indent=1))
        for arm in rotation(a.arms, k):
            print(f"[equal-wall] seed {seed}: {arm} for {a.wall_s:.0f} s", flush=True)
            res = run_trl_arm(a, seed, work) if arm == "trl" else run_rlbridge_arm(a, arm, seed, work)
            if res.get("adapter"):
                res.update(heldout_accuracy(a.recipe, a.sets, seed, res["adapter"]))
            res.update(arm=arm, seed=seed)
            print(
                f"[equal-wall] seed {seed}: {arm}: {res['steps']} steps, accuracy {res.get('accuracy')}",
                flush=True,
            )
            runs.append(res)
            (a.out / f"{arm}-s{seed}.json").write_text(json.dumps(res, indent=1))
            write_summary(a, runs)


if __name__ == "__main__":
    main()
