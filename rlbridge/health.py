"""What the driver checks after each update (run.health), and what it does about each: the trainer and the
rollout agree on the rollout's log-probs (`check_agreement`), the importance weights stay inside their limits
(`check_mismatch`), the trainer-vs-rollout gap does not grow (`check_drift`), and the trainer's measured GPU peak
is held against the plan's estimate (`memory_notice`). A check warns (not at every step of a long gap:
algo/correction.MismatchNotices), or stops the run with an error naming the key to change. What they measure is
computed in algo/correction.py and algo/drift.py; the loop (loop.py) calls them in order.
"""

from __future__ import annotations

from typing import Any

from rlbridge.algo.correction import MismatchNotices, health_problems
from rlbridge.algo.drift import DriftWatch, measures_agreement
from rlbridge.errors import RlbridgeError
from rlbridge.metrics.log import log
from rlbridge.plan import Plan, num_mini_batches
from rlbridge.recipe.schema import Recipe


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
