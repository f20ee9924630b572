"""The evaluation metrics: which a run has, for the console, the final summary and the report (the recipe's
eval.metrics in their order, each a mean, printed as a number, or a pass rate, printed as a percentage, then the
fixed metrics older runs logged, eval_accuracy and eval_format, where their records have them), and each one's
value from the reward pool's result (`eval_metric`: a mean, a pass rate or pass@k; `train_accuracy` of a
training step's samples)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from pydantic import ValidationError

from rlbridge.recipe.schema import EvalCfg, EvalMetric, Recipe, RewardCfg


class EvalColumn(NamedTuple):
    key: str
    """The record key (eval_...)."""
    label: str
    is_rate: bool
    """A share of prompts (a percentage), else a mean reward."""

    def show(self, value: float) -> str:
        return f"{value:.1%}" if self.is_rate else f"{value:.3f}"


LEGACY = (EvalColumn("eval_accuracy", "accuracy", True), EvalColumn("eval_format", "format", True))
"""What runs before eval.metrics logged at every evaluation (besides eval_reward)."""


def eval_columns(
    recipe: Mapping[str, Any] | None, records: Iterable[Mapping[str, Any]] = ()
) -> list[EvalColumn]:
    """The metrics of a run from its resolved recipe (a dict, as saved in recipe.yaml); with `records` (its eval
    records), only those logged, the legacy ones included."""
    try:
        cfg = EvalCfg.model_validate((recipe or {}).get("eval") or {})
    except ValidationError:  # a recipe.yaml from another version: its records still say what was logged
        cfg = EvalCfg()
    cols = [EvalColumn(m.key, m.key.removeprefix("eval_"), m.is_rate) for m in cfg.metrics]
    logged = {k for r in records for k in r}
    if not logged:
        return cols
    known = {c.key for c in cols}
    return [c for c in [*cols, *(c for c in LEGACY if c.key not in known)] if c.key in logged]


def train_accuracy(r: Recipe, res: Any) -> dict[str, float]:
    """`accuracy` of a step's samples: the share passing the recipe's first pass-rate metric of eval.metrics (k 1:
    its term and threshold); nothing when the recipe names none (no task-specific default)."""
    rate = next((m for m in r.eval.metrics if m.threshold is not None and m.k == 1), None)
    if rate is None:
        return {}
    return {"accuracy": eval_metric(rate, res, r.reward, n=1)}


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
