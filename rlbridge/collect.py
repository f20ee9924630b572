"""A step's samples: generate -> reward for its prompts, with DAPO's additions (the soft overlong penalty, and
dynamic sampling's refills of groups whose rewards are all equal). The first round's rollouts come from the
loop's RolloutSource (generated now, or sent steps earlier under rollout.mode async); rewards come from the
session's reward pool, failed samples filled with their group's mean.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from rlbridge.algo.advantages import dynamic_sampling_filter, overlong_penalty
from rlbridge.batch import Rollouts
from rlbridge.metrics.evals import train_accuracy
from rlbridge.metrics.log import Timer, log
from rlbridge.recipe.schema import DapoCfg
from rlbridge.run.resume import rollout_seed

if TYPE_CHECKING:
    from rlbridge.pipeline import RolloutSource
    from rlbridge.session import Session


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


_SUMMED = frozenset({"reward_error", "reward_model_error", "reward_model_s"})


def _merge(items: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """Sample-weighted mean of the rounds' reward metrics (counts and seconds: summed)."""
    total = sum(c for c, _ in items) or 1
    out: dict[str, float] = {}
    for key in {k for _, m in items for k in m}:
        vals = [(c, m[key]) for c, m in items if key in m]
        out[key] = sum(v for _, v in vals) if key in _SUMMED else sum(c * v for c, v in vals) / total
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
    if any(t.model is not None for t in s.recipe.reward.resolved_terms()):
        metrics["reward_model_s"] = res.model_seconds  # inside time_reward
        metrics["reward_model_error"] = float(res.model_errors)  # inside reward_error
    for line in res.errors[:3]:
        log(f"[red]reward error[/] {line}")
    return filled, metrics
