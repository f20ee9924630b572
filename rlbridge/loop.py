"""The training loop: a readable list of verbs.

    for step: prompts -> generate -> reward -> (reference log-probs) -> (PPO: critic values) -> advantages
              -> update (PPO: policy and critic) -> sync -> log
              -> evaluate (every run.eval_every) -> checkpoint (every run.save_every, at the end, on a signal)
              -> send the generations of the next steps (rollout.mode async: pipeline.py)

Everything else sits behind one name each: the workers, data and rewards behind Session, the update's own
gates behind TrainerRole, a step's samples (generate -> reward, DAPO's refills) in collect.py, the checks after
the update (run.health) in health.py; checkpoints, resuming and the stop on SIGTERM / Ctrl-C or at
run.time_limit_s behind checkpointer.Checkpointer, signals.StopSignals and time_limit.TimeLimit.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlbridge.algo.objective import compute_advantages
from rlbridge.batch import Rollouts, SeqBatch, pad_lists
from rlbridge.checkpointer import Checkpointer
from rlbridge.collect import collect, reward_batch
from rlbridge.errors import RlbridgeError
from rlbridge.health import agreement_gap, check_agreement, check_drift, check_mismatch, memory_notice
from rlbridge.metrics.evals import eval_metric
from rlbridge.metrics.log import Timer, log
from rlbridge.pipeline import RolloutSource
from rlbridge.plan import Plan
from rlbridge.recipe.schema import Recipe
from rlbridge.run import directory
from rlbridge.run.resume import ResumePoint, rollout_seed
from rlbridge.run.signals import TIME_LIMIT, StopSignals
from rlbridge.run.time_limit import TimeLimit
from rlbridge.session import Session


@dataclass
class Summary:
    run_dir: Path
    steps: int
    before: dict[str, float]
    after: dict[str, float]
    seconds: float
    recipe: dict[str, Any] | None = None
    """The resolved recipe (JSON form): which eval.metrics `before` and `after` hold."""


def train(
    recipe: Recipe, plan: Plan, run_dir: Path, model_dir: Path, *, resume: ResumePoint | None = None
) -> Summary:
    """Steps 1..run.steps, or from the step after `resume`'s checkpoint. SIGTERM / Ctrl-C: the current
    phase finishes, a checkpoint is saved, and signals.Interrupted (a KeyboardInterrupt) is raised; so does a
    step after which run.time_limit_s would be passed (run/time_limit.py)."""
    start = time.perf_counter()
    limit = TimeLimit(recipe.run.time_limit_s)
    # the handlers go in after Session has started Ray: ray.init installs its own SIGTERM handler in the driver
    # (it dies at once), so ours must come later to win
    with Session(recipe, plan, run_dir, model_dir) as s, StopSignals() as stop, s.stall.armed():
        source = RolloutSource(s)
        saver = Checkpointer(s, stop, log, source=source)
        if resume is None:
            if s.loads_initial_adapter():
                s.sync_weights(version=0)
            saver.eval_before = evaluate(s, step=0)
            first = 1
        else:
            first = (
                saver.restore(resume) + 1
            )  # the rollout has the checkpoint's weights before any generation
        source.fill(first - 1)
        limit.begin()
        for step in range(first, recipe.run.steps + 1):
            saver.begin_step(step)
            record = train_step(s, step, stop=stop, source=source)
            if record is None:
                saver.abandon(step)  # stopped before the update: saves step - 1, raises Interrupted
            source.done(step)
            saver.nonfinite = saver.nonfinite + 1 if record.get("skipped") else 0
            if saver.nonfinite > recipe.run.health.max_nonfinite_steps:
                raise RlbridgeError(
                    f"{saver.nonfinite} steps in a row had non-finite loss or gradients ({record.get('nonfinite')}); "
                    "stopping (run.health.max_nonfinite_steps)"
                )
            if (
                recipe.run.eval_every
                and step % recipe.run.eval_every == 0
                and step < recipe.run.steps
                and not stop.requested
            ):
                evaluate(s, step)
            if step < recipe.run.steps and limit.stop_after_step(step, saver.expected_save_s()):
                stop.request(TIME_LIMIT)
            if saver.due(step) or stop.requested:
                saver.save(step)
            if stop.requested:
                saver.interrupt(step)
            source.fill(step)  # async: the generation of step + 1 + max_staleness, with this step's weights
        after = evaluate(s, step=recipe.run.steps)
        s.wait_loaded()  # async: the last weights' load, sent unwaited (reported if it failed; no-op otherwise)
        saver.save(recipe.run.steps)
    return Summary(
        run_dir,
        recipe.run.steps,
        saver.eval_before,
        after,
        time.perf_counter() - start,
        recipe.model_dump(mode="json"),
    )


def train_step(
    s: Session, step: int, *, stop: StopSignals | None = None, source: RolloutSource | None = None
) -> dict[str, Any] | None:
    """One step; None when a stop was requested before the update (the step is then abandoned, having
    changed nothing but the data position, which the caller's snapshot restores)."""
    r, timer = s.recipe, Timer(s.stall)  # s.stall: a line when a phase runs far longer than in earlier steps
    trainer = s.started_trainer()
    stopping = lambda: stop is not None and stop.requested is not None  # noqa: E731
    source = source or RolloutSource(s)  # a caller without the loop's pipeline: generated on the spot (sync)
    collected = collect(s, step, timer, stopping, source)
    if collected is None:
        return None
    ro, rewards, reward_metrics = collected
    staleness = s.version - ro.weight_version
    if (
        staleness > r.rollout.ahead
    ):  # the pipeline's schedule makes this impossible; a sample must never be older
        raise RlbridgeError(
            f"step {step}: rollouts of weight version {ro.weight_version} while the trainer is at {s.version}: "
            f"{staleness} versions old, more than rollout.max_staleness {r.rollout.ahead}"
        )
    if r.rollout.routing_replay and len(ro.routed_experts) != len(ro):
        raise RlbridgeError(
            f"step {step}: rollout.routing_replay is on but the rollout returned the routed experts of "
            f"{len(ro.routed_experts)} of {len(ro)} samples"
        )
    batch = SeqBatch.from_token_lists(ro.prompt_ids, ro.response_ids, s.pad_id, ro.routed_experts)
    rollout_lp = pad_lists(ro.response_logprobs, batch.response_width)
    with timer(
        "update"
    ):  # colocated GPUs: vLLM sleeps before the trainer's first pass (reference, values, update)
        s.release_rollout_memory()
    ref = None
    if r.algorithm.kl.coef > 0:  # in the loss, or in the reward (compute_advantages subtracts it there)
        with timer("ref_logprobs"):
            ref = trainer.logprobs(batch, reference=True)
        if stopping():
            return None
    values = None
    # PPO: the critic's values before the update: GAE's baseline, the value clip's centre
    if r.algorithm.has_critic:
        with timer("values"):
            values = trainer.values(batch)
    kl_ctl = s.kl_control
    adv = compute_advantages(
        r.algorithm,
        r.rollout,
        rewards,
        batch.response_mask,
        logp_bt=rollout_lp,
        ref_logp_bt=ref,
        values_bt=values,
        kl_coef=None if kl_ctl is None else kl_ctl.coef,
    )
    # this step's rewards used the coefficient before it moves
    if kl_ctl is not None and adv.kl_seq_mean is not None:
        kl_ctl.update(adv.kl_seq_mean, batch.size)
    with timer("update"):
        m = trainer.update(batch, adv.adv_bt, rollout_lp, ref, adv.old_values_bt, adv.returns_bt)
    check_agreement(r, m)
    check_mismatch(r, m, step, s.mismatch_notices)
    check_drift(r, s.drift, agreement_gap(r, m, batch.size), staleness, step, s.drift_notices)
    background = source.overlapped and s.loads_in_background()
    if source.overlapped and not background:  # the load below would wait for them: time it as what it is
        with timer("rollout_wait"):
            source.wait_sent()
    with timer("sync"):  # async, vLLM resident: the load queues behind the generation in flight, unwaited
        m["sync_bytes"] = s.sync_weights(background=background)
    record = {
        "kind": "train",
        "step": step,
        **reward_metrics,
        **adv.metrics,
        **m,
        "kl": m.get("kl_loss", adv.metrics.get("kl_reward")),
        "tokens": int(batch.response_mask.sum()),
        # rollout.routing_replay: positions (prompt + response) whose rollout routing the trainer replayed
        **({} if batch.routed_experts is None else {"routing_replayed": int(batch.attention_mask.sum())}),
        "weight_version": s.version,
        "rollout_version": ro.weight_version,
        "staleness": staleness,
        **s.rollout_memory_seconds(),  # sleep_s inside time_update, wake_s inside time_sync
        "data_epoch": s.sampler.state()["epoch"],
        "prompt_sha": token_digest(ro.prompt_ids),
        "rollout_sha": token_digest(ro.response_ids),
        **{f"time_{k}": v for k, v in timer.seconds.items()},
    }
    record["time_step"] = sum(timer.seconds.values())
    record["tokens_per_s"] = record["tokens"] / max(record["time_step"], 1e-9)
    s.metrics.write(record)
    if r.run.save_rollouts:
        save_rollouts(s.run_dir, step, ro, rewards, r.rollout.n)
    memory_notice(s.plan, record, s.memory_told)
    return record


def save_rollouts(run_dir: Path, step: int, ro: Rollouts, rewards: torch.Tensor, n: int) -> None:
    """run.save_rollouts: the step's samples in the batch's order (sample i belongs to prompt group i // n)."""
    rows = [
        {
            "step": step,
            "sample": i,
            "group": i // n,
            "response_ids": ro.response_ids[i],
            "text": ro.texts[i] if ro.texts else None,
            "finish_reason": ro.finish_reasons[i],
            "reward": float(rewards[i]),
            "weight_version": ro.weight_version,
        }
        for i in range(len(ro))
    ]
    directory.write_rollouts(run_dir, step, rows)


def token_digest(token_lists: list[list[int]]) -> str:
    """A short hash of token id lists, in order. Of a step's prompts (`prompt_sha`): two runs (a resumed one and
    the uninterrupted one) trained on the same prompts in the same order iff their records carry the same
    digest; of the sampled completions (`rollout_sha`): they sampled the same completions."""
    h = hashlib.sha256()
    for ids in token_lists:
        h.update(b",".join(str(i).encode() for i in ids) + b";")
    return h.hexdigest()[:16]


def rollout_digest(ro: Rollouts) -> str:
    """`rollout_sha`: the digest of the sampled completions."""
    return token_digest(ro.response_ids)


def evaluate(s: Session, step: int) -> dict[str, float]:
    """The recipe's eval.metrics on the first run.eval_samples validation prompts: one greedy completion per
    prompt for the metrics with k 1, k sampled ones (the most any metric asks for) for pass@k."""
    if s.val_data is None:
        return {}
    r = s.recipe
    num = min(r.run.eval_samples, len(s.val_data.prompts))
    prompts, ids = list(s.val_data.prompts[:num]), list(s.val_data.ids[:num])
    start = time.perf_counter()
    k_max = max(m.k for m in r.eval.metrics)
    scored: dict[bool, Any] = {}  # sampled -> the RewardResult of those completions
    with s.stall("eval"):  # stall warnings and the stall stop (run.health.stall_*) watch evaluations too
        if any(m.k == 1 for m in r.eval.metrics):
            ro = s.generate(ids, greedy=True, seed=rollout_seed(r.run.seed, step, "eval"))
            scored[False] = _eval_score(s, prompts, ro, n=1)
        if k_max > 1:
            ro = s.generate(ids, seed=rollout_seed(r.run.seed, step, "eval-k"), n=k_max)
            scored[True] = _eval_score(s, prompts, ro, n=k_max)
    out = {
        m.key: eval_metric(m, scored[m.k > 1], r.reward, n=k_max if m.k > 1 else 1) for m in r.eval.metrics
    }
    out["eval_samples"] = float(num)
    s.metrics.write({"kind": "eval", "step": step, **out, "time_eval": time.perf_counter() - start})
    return out


def _eval_score(s: Session, prompts: list[Any], ro: Rollouts, *, n: int) -> Any:
    return s.rewards.score(
        [p.text for p in prompts for _ in range(n)],
        ro.texts,
        [p.sample for p in prompts for _ in range(n)],
        batch=reward_batch(s, prompts, ro, n=n, split="val"),
    )
