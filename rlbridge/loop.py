"""The training loop: a readable list of verbs.

    for step: prompts -> generate -> reward -> (reference log-probs) -> advantages -> update -> sync -> log
              -> evaluate (every run.eval_every) -> checkpoint (every run.save_every, at the end, on a signal)

Everything else (workers, data, rewards, health gates) sits behind Session and TrainerRole; checkpoints,
resuming and the stop on SIGTERM / Ctrl-C behind resume.Checkpointer and signals.StopSignals.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlbridge.algo.objective import compute_advantages
from rlbridge.batch import Rollouts, SeqBatch, pad_lists
from rlbridge.data.rewards import format_reward
from rlbridge.errors import RlbridgeError
from rlbridge.metrics import Timer
from rlbridge.plan import Plan
from rlbridge.recipe.schema import Recipe
from rlbridge.resume import Checkpointer, ResumePoint, rollout_seed
from rlbridge.session import Session, log
from rlbridge.signals import StopSignals


@dataclass
class Summary:
    run_dir: Path
    steps: int
    before: dict[str, float]
    after: dict[str, float]
    seconds: float


def train(recipe: Recipe, plan: Plan, run_dir: Path, model_dir: Path, *, resume: ResumePoint | None = None) -> Summary:
    """Steps 1..run.steps, or from the step after `resume`'s checkpoint. SIGTERM / Ctrl-C: the current
    phase finishes, a checkpoint is saved, and signals.Interrupted (a KeyboardInterrupt) is raised."""
    start = time.perf_counter()
    with StopSignals() as stop, Session(recipe, plan, run_dir, model_dir) as s:
        saver = Checkpointer(s, stop, log)
        if resume is None:
            saver.eval_before = evaluate(s, step=0)
            first = 1
        else:
            first = saver.restore(resume) + 1  # the rollout has the checkpoint's weights before any generation
        for step in range(first, recipe.run.steps + 1):
            saver.begin_step(step)
            record = train_step(s, step, stop=stop)
            if record is None:
                saver.abandon(step)  # stopped before the update: saves step - 1, raises Interrupted
            saver.nonfinite = saver.nonfinite + 1 if record.get("skipped") else 0
            if saver.nonfinite > recipe.run.health.max_nonfinite_steps:
                raise RlbridgeError(f"{saver.nonfinite} steps in a row had non-finite loss or gradients ({record.get('nonfinite')}); "
                                    "stopping (run.health.max_nonfinite_steps)")
            if recipe.run.eval_every and step % recipe.run.eval_every == 0 and step < recipe.run.steps and not stop.requested:
                evaluate(s, step)
            if saver.due(step) or stop.requested:
                saver.save(step)
            if stop.requested:
                saver.interrupt(step)
        after = evaluate(s, step=recipe.run.steps)
        saver.save(recipe.run.steps)
    return Summary(run_dir, recipe.run.steps, saver.eval_before, after, time.perf_counter() - start)


def train_step(s: Session, step: int, *, stop: StopSignals | None = None) -> dict[str, Any] | None:
    """One step; None when a stop was requested before the update (the step is then abandoned, having
    changed nothing but the data position, which the caller's snapshot restores)."""
    r, timer = s.recipe, Timer()
    stopping = lambda: stop is not None and stop.requested is not None  # noqa: E731
    rows = s.sampler.next_indices(r.data.batch_size)
    prompts = [s.train_data.prompts[i] for i in rows]
    with timer("generate"):
        ro = s.generate([s.train_data.ids[i] for i in rows], seed=rollout_seed(r.run.seed, step))
    if stopping():
        return None
    with timer("reward"):
        rewards, reward_metrics = score(s, prompts, ro, n=r.rollout.n)
    if stopping():
        return None
    batch = SeqBatch.from_token_lists(ro.prompt_ids, ro.response_ids, s.pad_id)
    rollout_lp = pad_lists(ro.response_logprobs, batch.response_width)
    ref = None
    if r.algorithm.kl.coef > 0:
        with timer("ref_logprobs"):
            ref = s.trainer.call("logprobs", batch, True)  # type: ignore[union-attr]
        if stopping():
            return None
    adv = compute_advantages(r.algorithm, r.rollout, rewards, batch.response_mask, logp_bt=rollout_lp, ref_logp_bt=ref)
    with timer("update"):
        m = s.trainer.call("update", batch, adv.adv_bt, rollout_lp, ref)  # type: ignore[union-attr]
    check_agreement(r, m)
    with timer("sync"):
        m["sync_bytes"] = s.sync_weights()
    record = {"kind": "train", "step": step, **reward_metrics, **adv.metrics, **m,
              "kl": m.get("kl_loss", adv.metrics.get("kl_reward")),
              "tokens": int(batch.response_mask.sum()), "weight_version": s.version,
              "data_epoch": s.sampler.state()["epoch"], **{f"time_{k}": v for k, v in timer.seconds.items()}}
    record["time_step"] = sum(timer.seconds.values())
    record["tokens_per_s"] = record["tokens"] / max(record["time_step"], 1e-9)
    s.metrics.write(record)
    return record


def score(s: Session, prompts: list[Any], ro: Rollouts, *, n: int) -> tuple[torch.Tensor, dict[str, float]]:
    """Rewards for each completion; failed samples (None) get the group mean so they push no gradient."""
    texts = [p.text for p in prompts for _ in range(n)]
    rows = [p.sample for p in prompts for _ in range(n)]
    res = s.rewards.score(texts, ro.texts, rows)
    values = torch.tensor([float("nan") if v is None else v for v in res.scores], dtype=torch.float32).view(-1, n)
    group_mean = torch.nanmean(values, dim=1, keepdim=True).nan_to_num(0.0)
    filled = torch.where(values.isnan(), group_mean, values).view(-1)
    first = next(iter(res.terms.values())) if res.terms else res.scores
    correct = [1.0 if (v is not None and v >= 1.0) else 0.0 for v in first]
    metrics = {"reward_mean": float(filled.mean()), "reward_std": float(filled.std()) if filled.numel() > 1 else 0.0,
               "accuracy": sum(correct) / max(len(correct), 1), "reward_error": float(res.num_errors),
               "response_length": sum(len(x) for x in ro.response_ids) / max(len(ro), 1),
               "clipped_ratio": sum(f == "length" for f in ro.finish_reasons) / max(len(ro), 1)}
    for line in res.errors[:3]:
        log(f"[red]reward error[/] {line}")
    return filled, metrics


def check_agreement(r: Recipe, m: dict[str, Any]) -> None:
    limit = r.run.health.max_logprob_diff
    diff = m.get("logprob_diff_mean")
    if limit is not None and diff is not None and diff > limit:
        raise RlbridgeError(f"trainer and rollout log-probs disagree: mean |diff| {diff:.3g} > run.health.max_logprob_diff {limit} "
                            "(stale rollout weights or a dtype mismatch; raise the limit or set it to null to continue anyway)")


def evaluate(s: Session, step: int) -> dict[str, float]:
    """Greedy completions of the first eval_samples validation prompts: accuracy and format rate."""
    if s.val_data is None:
        return {}
    k = min(s.recipe.run.eval_samples, len(s.val_data.prompts))
    prompts, ids = s.val_data.prompts[:k], s.val_data.ids[:k]
    start = time.perf_counter()
    ro = s.generate(ids, greedy=True, seed=rollout_seed(s.recipe.run.seed, step, "eval"))
    res = s.rewards.score([p.text for p in prompts], ro.texts, [p.sample for p in prompts])
    first = next(iter(res.terms.values())) if res.terms else res.scores
    out = {"eval_accuracy": sum(1.0 for v in first if v is not None and v >= 1.0) / max(k, 1),
           "eval_format": sum(format_reward(p.text, t, p.sample) for p, t in zip(prompts, ro.texts, strict=True)) / max(k, 1),
           "eval_reward": sum(v for v in res.scores if v is not None) / max(k, 1), "eval_samples": float(k)}
    s.metrics.write({"kind": "eval", "step": step, **out, "time_eval": time.perf_counter() - start})
    return out
