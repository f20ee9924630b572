"""Code the recipe points at: reward functions, logger packages (datasets: data.py)."""

from __future__ import annotations

from rlbridge.errors import RecipeIssue
from rlbridge.recipe.checks.common import Issues
from rlbridge.recipe.schema import Recipe


# ------------------------------------------------------------------------------- code
def check_reward(r: Recipe, out: Issues) -> None:
    from rlbridge.data.rewards import check_reward_fn  # light module: no heavy imports

    for i, term in enumerate(r.reward.resolved_terms()):
        if term.model is not None:
            from rlbridge.model.reward_model import model_problem

            if term.device == "cuda" and r.cluster.device != "cuda":
                out.append(
                    RecipeIssue(
                        f"reward.terms.{i}.device",
                        f"the reward model would score on a GPU, but cluster.device is {r.cluster.device}",
                        value="cuda",
                        fix=f"set reward.terms.{i}.device: cpu (or cluster.device: cuda)",
                    )
                )

            problem = model_problem(term.model)
            if problem:
                out.append(
                    RecipeIssue(
                        f"reward.terms.{i}.model",
                        problem,
                        value=term.model,
                        fix="point it at a sequence-classification model: a local directory, or a Hub id in the "
                        "Hugging Face cache (hf download ORG/NAME)",
                    )
                )
            continue
        key = "reward.fn" if r.reward.terms is None else f"reward.terms.{i}.fn"
        problem = check_reward_fn(str(term.fn), term.batched)
        if problem:
            out.append(
                RecipeIssue(
                    key,
                    problem,
                    value=term.fn,
                    fix="use a builtin (arithmetic, gsm8k, format, length), package.module:function(prompt, "
                    "completion, sample) -> float, or a TRL-style batched function(prompts, completions, **columns) "
                    "-> list[float]",
                )
            )


def check_loggers(r: Recipe, out: Issues) -> None:
    import importlib.util

    for i, logger in enumerate(r.run.loggers):
        if logger in ("wandb", "tensorboard") and importlib.util.find_spec(logger) is None:
            out.append(
                RecipeIssue(
                    f"run.loggers.{i}",
                    f"the {logger} logger needs the {logger} package, which is not installed",
                    value=logger,
                    fix="pip install 'rlbridge-cli[report]', or remove it from run.loggers",
                )
            )
