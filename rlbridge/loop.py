"""The training loop: a readable list of verbs.

    for step: prompts -> generate -> reward -> (reference log-probs) -> (PPO: critic values) -> advantages
              -> update (PPO: policy and critic) -> sync -> log
              -> evaluate (every run.eval_every) -> checkpoint (every run.save_every, at the end, on a signal)
              -> send the generations of the next steps (rollout.mode async: pipeline.py)

Everything else (workers, data, rewards, health gates) sits behind Session and TrainerRole; checkpoints,
resuming and the stop on SIGTERM / Ctrl-C behind checkpointer.Checkpointer and signals.StopSignals.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlbridge.algo.advantages import dynamic_sampling_filter, overlong_penalty
from rlbridge.algo.correction import MismatchNotices, health_problems
from rlbridge.algo.drift import DriftWatch, measures_agreement
from rlbridge.algo.objective import compute_advantages
from rlbridge.batch import Rollouts, SeqBatch, pad_lists
from rlbridge.checkpointer import Checkpointer
from rlbridge.errors import RlbridgeError
from rlbridge.metrics.log import Timer
from rlbridge.pipeline import RolloutSource
from rlbridge.plan import Plan, num_mini_batches
from rlbridge.recipe.schema import DapoCfg, EvalMetric, Recipe, RewardCfg
from rlbridge.run import directory
from rlbridge.run.resume import ResumePoint, rollout_seed
from rlbridge.run.signals import StopSignals
from rlbridge.session import Session, log


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
    phase finishes, a checkpoint is saved, and signals.Interrupted (a KeyboardInterrupt) is raised."""
    start = time.perf_counter()
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


def memory_notice(plan: Plan, record: dict[str, Any], told: set[str]) -> None:
    """The trainer's measured GPU peak (metrics trainer_gpu_gib_max, on CUDA only) against the plan's estimate:
    one line after the first step, and a warning the first time a step's peak exceeds the estimate by > 15 %
    (the plan is what tells a user of an out-of-memory before launching). `told`: what was said ("first",
    "over"), kept by the session."""
    peak = record.get("trainer_gpu_gib_max")
    if peak is None or plan.memory is None:
        return
    est = plan.memory.trainer_total
    reserved = record.get("trainer_gpu_reserved_gib_max", peak)
    text = f"trainer GPU memory: peak {peak:.2f} GiB allocated ({reserved:.2f} reserved); the plan estimated {est:.2f}"
    if peak > 1.15 * est and "over" not in told:
        told.update(("first", "over"))
        log(
            f"[yellow]warning[/] step {record['step']}: {text}: the plan underestimates this run's trainer memory"
        )
    elif "first" not in told:
        told.add("first")
        log(f"step {record['step']}: {text}")


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


def collect(
    s: Session, step: int, timer: Timer, stopping: Any, source: RolloutSource
) -> tuple[Rollouts, torch.Tensor, dict[str, float]] | None:
    """generate -> reward for one step's prompts, with DAPO's additions when algorithm.name is dapo:
    the soft overlong penalty added to the rewards, and dynamic sampling, which drops the groups whose
    rewards are all equal and refills the batch by generating for further prompts (at most
    max_refill_rounds extra rounds; still short: it trains on the groups it has and says so in the metrics
    `groups_short`). None when a stop was requested. The first round's rollouts come from `source`: generated
    now, or (rollout.mode async) sent steps earlier and waited for here (the phase `rollout_wait`)."""
    r, n = s.recipe, s.recipe.rollout.n
    dapo = r.algorithm if isinstance(r.algorithm, DapoCfg) else None  # DAPO's settings, None for the others
    want = r.data.batch_size
    kept_ro: list[Rollouts] = []
    kept_rewards: list[torch.Tensor] = []
    all_rewards: list[torch.Tensor] = []
    round_metrics: list[tuple[int, dict[str, float]]] = []
    dropped = rounds = have = 0
    while True:
        if rounds == 0:
            with timer("rollout_wait" if source.overlapped else "generate"):
                rows, ro = source.take(step)
        else:  # DAPO's refills (sync only: checks.check_async)
            rows = s.sampler.next_indices(want - have)
            with timer("generate"):
                ro = s.generate(
                    [s.train_data.ids[i] for i in rows],
                    seed=rollout_seed(r.run.seed, step, f"refill{rounds}"),
                )
        prompts = [s.train_data.prompts[i] for i in rows]
        if stopping():
            return None
        with timer("reward"):
            rewards, m = score(s, prompts, ro, n=n)
        if stopping():
            return None
        all_rewards.append(rewards)
        if dapo is not None and dapo.overlong.buffer > 0:
            lengths = torch.tensor([len(x) for x in ro.response_ids], dtype=torch.float32)
            pen = overlong_penalty(
                lengths,
                max_len=r.rollout.max_response_tokens,
                buffer=dapo.overlong.buffer,
                penalty_factor=dapo.overlong.penalty,
            )
            rewards = rewards + pen
            m["overlong_penalty"] = float(pen.mean())
        round_metrics.append((len(ro), m))
        keep_g = torch.ones(len(rows), dtype=torch.bool)
        if dapo is not None and dapo.dynamic_sampling:
            keep_g, num_dropped = dynamic_sampling_filter(rewards, n)
            dropped += num_dropped
        keep = keep_g.repeat_interleave(n).nonzero().view(-1).tolist()
        kept_ro.append(_take(ro, keep))
        kept_rewards.append(rewards[keep])
        have += int(keep_g.sum())
        if have >= want or dapo is None or rounds >= dapo.max_refill_rounds:
            break
        rounds += 1
    if have == 0:  # no group with a signal: the last round as it is (all-zero advantages move nothing)
        kept_ro, kept_rewards = [ro], [rewards]
    ro, rewards = _cat(kept_ro), torch.cat(kept_rewards)
    metrics = _merge(round_metrics)
    raw = torch.cat(all_rewards)  # every sampled completion, before any penalty or filtering
    metrics["reward_mean"] = float(raw.mean())
    metrics["reward_std"] = float(raw.std()) if raw.numel() > 1 else 0.0
    if dapo is not None:
        metrics.update(
            groups_dropped=float(dropped),
            refill_rounds=float(rounds),
            groups_trained=float(min(have, want)),
            groups_short=float(max(want - have, 0)),
        )
        if have < want:
            log(
                f"step {step}: dynamic sampling kept {have} of {want} groups after {rounds} refill rounds "
                "(algorithm.max_refill_rounds); training on those"
            )
    if have > want:
        ro, rewards = _take(ro, list(range(want * n))), rewards[: want * n]
    return ro, rewards, metrics


def _take(ro: Rollouts, idx: list[int]) -> Rollouts:
    return Rollouts(
        [ro.prompt_ids[i] for i in idx],
        [ro.response_ids[i] for i in idx],
        [ro.response_logprobs[i] for i in idx],
        [ro.finish_reasons[i] for i in idx],
        ro.weight_version,
        [ro.texts[i] for i in idx] if ro.texts else [],
        [ro.routed_experts[i] for i in idx] if ro.routed_experts else [],
    )


def _cat(items: list[Rollouts]) -> Rollouts:
    return Rollouts(
        [x for r in items for x in r.prompt_ids],
        [x for r in items for x in r.response_ids],
        [x for r in items for x in r.response_logprobs],
        [x for r in items for x in r.finish_reasons],
        items[-1].weight_version,
        [x for r in items for x in r.texts],
        [x for r in items for x in r.routed_experts],
    )


def _merge(items: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """Sample-weighted mean of the rounds' reward metrics (reward_error: summed)."""
    total = sum(c for c, _ in items) or 1
    out: dict[str, float] = {}
    for key in {k for _, m in items for k in m}:
        vals = [(c, m[key]) for c, m in items if key in m]
        out[key] = sum(v for _, v in vals) if key == "reward_error" else sum(c * v for c, v in vals) / total
    return out


def reward_batch(
    s: Session, prompts: list[Any], ro: Rollouts, *, n: int, split: str = "train"
) -> dict[str, Any] | None:
    """The keyword lists of the batched (TRL-style) reward terms, as TRL builds them (rewards.batch_kwargs):
    the dataset's prompts (strings or conversations) and raw columns, n per prompt; None without such terms."""
    if not s.rewards.has_batched:
        return None
    from rlbridge.data.datasets import Columns
    from rlbridge.data.rewards import batch_kwargs

    ds = s.recipe.data.train if split == "train" else s.recipe.data.val
    column = Columns.of(ds, s.recipe.data, split).prompt if ds is not None else None
    return batch_kwargs(
        [p.messages if p.messages is not None else p.text for p in prompts for _ in range(n)],
        list(ro.texts),
        [p.row for p in prompts for _ in range(n)],
        prompt_column=column,
        completion_ids=[list(ids) for ids in ro.response_ids],
    )


def score(s: Session, prompts: list[Any], ro: Rollouts, *, n: int) -> tuple[torch.Tensor, dict[str, float]]:
    """Rewards for each completion; failed samples (None) get the group mean so they push no gradient."""
    texts = [p.text for p in prompts for _ in range(n)]
    rows = [p.sample for p in prompts for _ in range(n)]
    res = s.rewards.score(texts, ro.texts, rows, batch=reward_batch(s, prompts, ro, n=n))
    values = torch.tensor([float("nan") if v is None else v for v in res.scores], dtype=torch.float32).view(
        -1, n
    )
    group_mean = torch.nanmean(values, dim=1, keepdim=True).nan_to_num(0.0)
    filled = torch.where(values.isnan(), group_mean, values).view(-1)
    metrics = {
        "reward_mean": float(filled.mean()),
        "reward_std": float(filled.std()) if filled.numel() > 1 else 0.0,
        **train_accuracy(s.recipe, res),
        "reward_error": float(res.num_errors),
        "response_length": sum(len(x) for x in ro.response_ids) / max(len(ro), 1),
        "clipped_ratio": sum(f == "length" for f in ro.finish_reasons) / max(len(ro), 1),
    }
    for line in res.errors[:3]:
        log(f"[red]reward error[/] {line}")
    return filled, metrics


def train_accuracy(r: Recipe, res: Any) -> dict[str, float]:
    """`accuracy` of a step's samples: the share passing the recipe's first pass-rate metric of eval.metrics (k 1:
    its term and threshold); nothing when the recipe names none (no task-specific default)."""
    rate = next((m for m in r.eval.metrics if m.threshold is not None and m.k == 1), None)
    if rate is None:
        return {}
    return {"accuracy": eval_metric(rate, res, r.reward, n=1)}


def check_agreement(r: Recipe, m: dict[str, Any]) -> None:
    limit = r.run.health.max_logprob_diff
    diff = m.get("logprob_diff_mean")
    if limit is not None and diff is not None and diff > limit:
        raise RlbridgeError(
            f"trainer and rollout log-probs disagree: mean |diff| {diff:.3g} > run.health.max_logprob_diff {limit} "
            "(stale rollout weights or a dtype mismatch; raise the limit or set it to null to continue anyway)"
        )


def check_mismatch(r: Recipe, m: dict[str, Any], step: int, notices: MismatchNotices | None = None) -> None:
    """run.health's importance-weight limits (algo/correction.py): a warning (the first step out, then every 10th
    while they stay out: `notices`), or a stop with on_mismatch: stop."""
    problems = health_problems(r.run.health, m)
    _tell(
        r,
        step,
        problems,
        notices,
        stop=f"step {step}: rollout and trainer disagree: {'; '.join(problems)} (run.health.on_mismatch: stop; set "
        "it to warn to continue, or correct the gap with algorithm.rollout_correction: docs/rollout-correction.md)",
        hint="algorithm.rollout_correction corrects it: docs/rollout-correction.md",
    )


def _tell(
    r: Recipe, step: int, problems: list[str], notices: MismatchNotices | None, *, stop: str, hint: str
) -> None:
    """run.health.on_mismatch for one check's problems at this step: raise `stop`, or print what `notices` says now
    (the first step out with `hint`, every 10th while it lasts, its end)."""
    if problems and r.run.health.on_mismatch == "stop":
        raise RlbridgeError(stop)
    text = (notices or MismatchNotices()).notice(step, problems)
    if text is not None:
        log(f"[yellow]warning[/] {text} ({hint})" if problems else text)


def agreement_gap(r: Recipe, m: dict[str, Any], num_rows: int) -> float | None:
    """The step's logprob_diff_mean where it measures how the trainer and the rollout agree on the same weights
    (drift.measures_agreement), else None."""
    minis = num_mini_batches(r, num_rows)
    if not measures_agreement(
        bypass=r.algorithm.rollout_correction.bypass, ppo_epochs=r.trainer.ppo_epochs, mini_batches=minis
    ):
        return None
    diff = m.get("logprob_diff_mean")
    return float(diff) if isinstance(diff, (int, float)) else None


def check_drift(
    r: Recipe,
    watch: DriftWatch,
    diff: object,
    staleness: int,
    step: int,
    notices: MismatchNotices | None = None,
) -> None:
    """run.health.max_logprob_diff_growth (algo/drift.DriftWatch): a warning, as check_mismatch's (first step
    out, every 10th while it lasts, its end), or a stop with on_mismatch: stop."""
    problems = watch.observe(diff, staleness)
    if problems is None:
        return
    where = (
        "look for a weight sync that did not reach the rollout or a trainer computing with old weights: "
        "docs/rollout-correction.md#health-checks"
    )
    stop = f"step {step}: {problems[0]} (run.health.on_mismatch: stop; {where})" if problems else ""
    _tell(r, step, problems, notices, stop=stop, hint=where)


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


def eval_metric(m: EvalMetric, res: Any, reward: RewardCfg, *, n: int) -> float:
    """One eval.metrics entry from a RewardResult of n completions per prompt (prompt-major): the term's mean over
    the scored completions, the share of prompts whose completion passes the threshold, or pass@k, unbiased from n
    samples (1 - C(n - c, k) / C(n, k) with c of them passing: Chen et al. 2021), averaged over prompts."""
    values: list[float | None] = (
        list(res.scores) if m.term == "reward" else list(res.terms[term_name(reward, m.term)])
    )
    if m.threshold is None:
        scored = [v for v in values if v is not None]
        return sum(scored) / len(scored) if scored else float("nan")
    groups = [values[i : i + n] for i in range(0, len(values), n)]
    rates = []
    for group in groups:
        c = sum(1 for v in group if v is not None and v >= m.threshold)
        rates.append(1.0 - math.comb(n - c, m.k) / math.comb(n, m.k))
    return sum(rates) / len(rates) if rates else float("nan")


def term_name(reward: RewardCfg, term: str) -> str:
    """The RewardResult.terms key of a term named by its fn or model:<model> (the first term of that name)."""
    fns = [t.name for t in reward.resolved_terms()]
    j = fns.index(term)
    return term if fns.count(term) == 1 else f"{term}#{j}"
