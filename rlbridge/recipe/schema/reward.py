"""The recipe's `reward` and `eval` sections: the reward terms that score completions, and the metrics an
evaluation computes from those terms."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from rlbridge.recipe.schema.base import PositiveInt, Section


class RewardTerm(Section):
    fn: str | None = None
    """Builtin reward name or `package.module:function` (or `model` instead)."""
    model: str | None = None
    """A reward model instead of a function: a sequence-classification model (local directory or Hub id in the
    Hugging Face cache) whose first logit scores prompt + completion, as TRL's GRPOTrainer scores with one; it runs
    in batches in a reward worker of its own (loaded once, when the run starts), on `device`. Its name in
    eval.metrics: `model:<this value>`; its time and failures are metrics of their own (reward_model_s,
    reward_model_error)."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where a reward model scores: `cpu`, or `cuda` (needs cluster.device cuda): the first GPU the driver node's
    reward worker sees, beside the trainer and rollout engines colocated there, in float32. `rlbridge plan` counts
    it on that device (its weights, one batch_size batch and a CUDA context), and validation refuses a peak over
    the device with it as with the rest."""
    batch_size: PositiveInt = 16
    """Completions a reward model scores in one forward pass (right-padded); a larger batch is faster where memory
    allows."""
    weight: float = 1.0
    """Weight in the sum."""
    batched: bool | None = None
    """The function scores the whole batch in one call as TRL's reward_funcs do (`fn(prompts=..., completions=...,
    **columns) -> list[float]`) rather than one sample (`fn(prompt, completion, sample) -> float`). Default:
    batched when its signature has a `prompts`, `completions` or `completion_ids` parameter."""

    @model_validator(mode="after")
    def _fn_or_model(self) -> RewardTerm:
        if (self.fn is None) == (self.model is None):
            raise ValueError("a reward term names either fn (a function) or model (a reward model)")
        # compared with the defaults, not with the keys written: a resolved recipe (run directory, --set of a
        # whole list) carries every field of every term
        defaults = type(self).model_fields
        model_only = sorted(k for k in ("device", "batch_size") if getattr(self, k) != defaults[k].default)
        if self.fn is not None and model_only:
            raise ValueError(
                f"{' and '.join(model_only)} belong to a reward model term (model: ...), not to fn {self.fn}"
            )
        return self

    @property
    def name(self) -> str:
        """The term's name: its fn, or model:<model> (RewardResult.terms keys, eval.metrics terms)."""
        return self.fn if self.fn is not None else f"model:{self.model}"


REWARD_BUILTINS = ("arithmetic", "gsm8k", "format", "length")
"""The builtin reward names (rlbridge.data.rewards.BUILTINS), for messages: no reward is implied."""
NO_REWARD = (
    "every recipe names its reward: reward: {fn: NAME} with a builtin ("
    + ", ".join(REWARD_BUILTINS)
    + "), a package.module:function (per sample, or batched as TRL's reward_funcs), or reward.terms for a "
    "weighted sum"
)


class RewardCfg(Section):
    fn: str | None = None
    """Builtin reward (arithmetic, gsm8k, format, length) or `package.module:function`. Use `terms` for a weighted sum.
    There is no default: a recipe names its reward."""
    terms: list[RewardTerm] | None = None
    """Weighted sum of reward functions (instead of fn)."""
    timeout_s: Annotated[float, Field(gt=0)] = 10.0
    """Per-sample time limit; a call past it counts as a reward_error."""
    workers: PositiveInt = 2
    """Reward worker processes. Raise it when a slow reward function (not the model) makes the reward phase
    long."""
    error_budget: Annotated[int, Field(ge=0)] = 100
    """Reward errors tolerated over the run before it stops with the function's traceback."""

    @model_validator(mode="before")
    @classmethod
    def _terms_replace_the_default_fn(cls, data: Any) -> Any:
        # with terms, fn is None rather than its default: the resolved recipe (run dir, checkpoints) then
        # loads again, which `rlbridge resume` relies on
        if isinstance(data, dict) and data.get("terms") is not None and "fn" not in data:
            return {**data, "fn": None}
        return data

    @model_validator(mode="after")
    def _one_of(self) -> RewardCfg:
        if self.terms is not None and self.fn is not None and "fn" in self.model_fields_set:
            raise ValueError("set either reward.fn or reward.terms, not both")
        if self.terms is None and self.fn is None:
            raise ValueError(NO_REWARD)
        return self

    def resolved_terms(self) -> list[RewardTerm]:
        return list(self.terms) if self.terms is not None else [RewardTerm(fn=str(self.fn))]


# ----------------------------------------------------------------------------------------------- eval
class EvalMetric(Section):
    term: str = "reward"
    """What is measured: a reward term's fn as the reward section writes it (`arithmetic`, `pkg.mod:fn`), or `reward`
    for the weighted sum of the terms."""
    threshold: float | None = None
    """None: the mean of the term over the evaluation's completions. A number: the pass rate, the share of prompts
    whose completion scores >= threshold (a failed or unscored completion does not pass)."""
    k: PositiveInt = 1
    """1: one greedy completion per prompt. k > 1: pass@k, k completions per prompt sampled as the rollout samples
    (rollout.temperature, top_p, top_k); a prompt passes when one of them reaches the threshold (needed)."""
    name: str | None = None
    """The metric's name: metrics.jsonl and the console show it as eval_<name>. Default: the term's name (a user
    function's name after the colon), with _pass_rate or _pass@k added for a threshold."""

    @model_validator(mode="after")
    def _pass_at_k_needs_a_threshold(self) -> EvalMetric:
        if self.k > 1 and self.threshold is None:
            raise ValueError(
                f"pass@{self.k} needs a threshold (what counts as a pass); set threshold, or k: 1"
            )
        return self

    @property
    def key(self) -> str:
        """The metric's key in the eval records (eval_...)."""
        if self.name:
            return f"eval_{self.name}"
        base = self.term.rsplit(":", 1)[-1].rsplit(".", 1)[-1]
        if self.threshold is None:
            return f"eval_{base}"
        return f"eval_{base}_pass@{self.k}" if self.k > 1 else f"eval_{base}_pass_rate"

    @property
    def is_rate(self) -> bool:
        """A share of prompts (printed as a percentage) rather than a mean reward."""
        return self.threshold is not None


class EvalCfg(Section):
    metrics: list[EvalMetric] = [EvalMetric()]
    """What each evaluation (run.eval_every, and the first and last step, on run.eval_samples prompts of data.val)
    measures, printed in this order. The first pass rate (a threshold, k 1) is also the `accuracy` of every training
    step's samples (console `acc`). Default: the mean of the weighted reward (eval_reward). E.g.
    `[{term: arithmetic, threshold: 1.0, name: accuracy}, {term: format}, {term: arithmetic, threshold: 1.0, k: 4}]`."""
