"""Which evaluation metrics a run has, for the console, the final summary and the report: the recipe's eval.metrics
in their order (each a mean, printed as a number, or a pass rate, printed as a percentage), then the fixed metrics
older runs logged (eval_accuracy, eval_format) where their records have them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from pydantic import ValidationError

from rlbridge.recipe.schema import EvalCfg


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
