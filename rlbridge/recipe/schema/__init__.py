"""The recipe: one typed, frozen description of a training run.

Every section is a pydantic model with `extra="forbid"` (a typo is an error with a suggestion, never
silently ignored) and attribute docstrings, so `rlbridge schema` and the docs come from this one package:
one module per part of the run (model, trainer, rollout, algorithm, data, reward and eval, run and cluster),
assembled into `Recipe` here. The rest of the code imports every section from `rlbridge.recipe.schema`.
The recipe is validated once and then passed around typed; it is never turned back into a dict except
to save it.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, model_validator

from rlbridge.recipe.schema.algorithm import (
    GROUP_ALGORITHMS,
    AlgorithmCfg,
    ClipCfg,
    CriticCfg,
    DapoCfg,
    DrGrpoCfg,
    GrpoCfg,
    GspoCfg,
    KlCfg,
    LossAgg,
    OverlongCfg,
    PpoCfg,
    ReinforcePPCfg,
    RejectCfg,
    RlooCfg,
    RolloutCorrectionCfg,
)
from rlbridge.recipe.schema.base import MAX_INT, PositiveInt, Section
from rlbridge.recipe.schema.data import ArithmeticCfg, ColumnsCfg, DataCfg, DatasetCfg
from rlbridge.recipe.schema.model import Dtype, LoraCfg, ModelCfg
from rlbridge.recipe.schema.reward import (
    NO_REWARD,
    REWARD_BUILTINS,
    EvalCfg,
    EvalMetric,
    RewardCfg,
    RewardTerm,
)
from rlbridge.recipe.schema.rollout import RolloutCfg
from rlbridge.recipe.schema.run import ClusterCfg, HealthCfg, RunCfg, WandbCfg
from rlbridge.recipe.schema.trainer import (
    AUTO_WIDTH_MULTIPLE,
    MAX_GRAPHS,
    MAX_PASS_TOKENS,
    OptimCfg,
    ParallelCfg,
    RecomputeCfg,
    TrainerCfg,
    round_width,
)

__all__ = [
    "AUTO_WIDTH_MULTIPLE",
    "GROUP_ALGORITHMS",
    "MAX_GRAPHS",
    "MAX_INT",
    "MAX_PASS_TOKENS",
    "NO_REWARD",
    "REWARD_BUILTINS",
    "AlgorithmCfg",
    "ArithmeticCfg",
    "ClipCfg",
    "ClusterCfg",
    "ColumnsCfg",
    "CriticCfg",
    "DapoCfg",
    "DataCfg",
    "DatasetCfg",
    "DrGrpoCfg",
    "Dtype",
    "EvalCfg",
    "EvalMetric",
    "GrpoCfg",
    "GspoCfg",
    "HealthCfg",
    "KlCfg",
    "LoraCfg",
    "LossAgg",
    "ModelCfg",
    "OptimCfg",
    "OverlongCfg",
    "ParallelCfg",
    "PositiveInt",
    "PpoCfg",
    "Recipe",
    "RecomputeCfg",
    "ReinforcePPCfg",
    "RejectCfg",
    "RewardCfg",
    "RewardTerm",
    "RlooCfg",
    "RolloutCfg",
    "RolloutCorrectionCfg",
    "RunCfg",
    "Section",
    "TrainerCfg",
    "WandbCfg",
    "round_width",
]


class Recipe(Section):
    name: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
    """Run name (letters, digits, dot, dash, underscore)."""
    model: ModelCfg
    lora: LoraCfg = LoraCfg()
    trainer: TrainerCfg = TrainerCfg()
    rollout: RolloutCfg = RolloutCfg()
    algorithm: AlgorithmCfg = GrpoCfg()
    data: DataCfg
    reward: RewardCfg
    """The reward (required: nothing is implied)."""
    eval: EvalCfg = EvalCfg()
    run: RunCfg = RunCfg()
    cluster: ClusterCfg = ClusterCfg()

    @model_validator(mode="before")
    @classmethod
    def _default_algorithm_name(cls, data: Any) -> Any:
        """An algorithm section without `name` is GRPO's, the default (e.g. only `--set algorithm.kl.coef=0.1`
        on a recipe without the section): without this pydantic could not pick the section's type."""
        if (
            isinstance(data, dict)
            and isinstance(data.get("algorithm"), dict)
            and "name" not in data["algorithm"]
        ):
            return {**data, "algorithm": {"name": "grpo", **data["algorithm"]}}
        return data

    @property
    def world_size(self) -> int:
        return self.cluster.nodes * self.cluster.gpus_per_node

    @property
    def mini_batch_size(self) -> int:
        return self.data.mini_batch_size or self.data.batch_size

    @property
    def rollout_devices(self) -> int:
        """Devices the rollout generates on: the trainer's when colocated, else rollout.gpus of its own (default: as
        many as the trainer's)."""
        return self.world_size if self.cluster.colocate else (self.rollout.gpus or self.world_size)

    @property
    def rollouts_per_step(self) -> int:
        """Samples generated and trained on per step: data.batch_size prompts x rollout.n."""
        return self.data.batch_size * self.rollout.n
