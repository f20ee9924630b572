"""Cross-field rules, and rules that need the model's config.json and the cluster shape.

Each rule appends a RecipeIssue naming the key, the numbers involved and the smallest fix. All rules run;
all problems are reported together. Rules are plain functions of (recipe, model info) so each is tested
with a failing and a passing recipe.

Rule modules: layout (cluster and batches), checkpoints (layouts that cannot be saved), model (config.json:
shape, MoE, recompute), training (LoRA, sync, algorithm, rollout correction, async), data (datasets: their first
rows), files (reward code, loggers); common (the shared helpers).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rlbridge.errors import RecipeIssue, RlbridgeError
from rlbridge.model.hub import is_hub_id
from rlbridge.model.info import SHORT_NAMES, ModelInfo, read_model_info
from rlbridge.recipe.checks.checkpoints import check_checkpoints
from rlbridge.recipe.checks.common import Issues
from rlbridge.recipe.checks.data import check_data, check_eval
from rlbridge.recipe.checks.files import check_loggers, check_reward
from rlbridge.recipe.checks.layout import (
    check_batches,
    check_cuda_graphs,
    check_layout,
    check_packed_passes,
    check_rollout_layout,
    check_shared_prompts,
    check_token_budget,
)
from rlbridge.recipe.checks.model import check_model_shape
from rlbridge.recipe.checks.training import (
    check_algorithm,
    check_async,
    check_async_memory,
    check_device_memory,
    check_lora,
    check_rollout_correction,
    check_rollout_share,
    check_weight_transport,
)
from rlbridge.recipe.schema import Recipe

__all__ = ["Issues", "RULES", "check_loggers", "check_model_shape", "run_checks"]

# ---------------------------------------------------------------------------------------- entry
RecipeRule = Callable[[Recipe, Issues], None]
RULES: tuple[RecipeRule, ...] = (
    check_layout,
    check_checkpoints,
    check_rollout_layout,
    check_batches,
    check_token_budget,
    check_shared_prompts,
    check_packed_passes,
    check_cuda_graphs,
    check_lora,
    check_weight_transport,
    check_algorithm,
    check_rollout_correction,
    check_async,
    check_data,
    check_eval,
    check_reward,
    check_loggers,
)


def run_checks(
    r: Recipe, *, model_checks: bool = True, force: bool = False
) -> tuple[Issues, ModelInfo | None]:
    """All rules; returns every issue found and the model info (None when not read). force: an estimated memory
    peak over the device is not an issue (the plan still notes it)."""
    out: Issues = []
    for rule in RULES:
        rule(r, out)
    if not model_checks:
        return out, None
    info = _model_info(r, out)
    if info is None:
        return out, None
    check_model_shape(r, info, out)
    check_async_memory(r, info, out)
    if not out:  # the estimates below are of a valid recipe
        check_rollout_share(r, info, out)
    if not force and not out:  # the estimate is of a valid recipe (async's own memory issue says enough)
        check_device_memory(r, info, out)
    return out, info


def _model_info(r: Recipe, out: Issues) -> ModelInfo | None:
    """The model's ModelInfo (short name, local directory or Hub id: info.read_model_info), or None with the
    issue that says why it cannot be read."""
    m = r.model
    local = Path(m.path).expanduser()
    hub = m.path not in SHORT_NAMES and not local.exists() and is_hub_id(m.path)
    if m.revision is not None and not hub:
        out.append(
            RecipeIssue(
                "model.revision",
                "a revision applies to a Hugging Face Hub id (org/name), not to a local directory or short name",
                value=m.revision,
                fix="remove model.revision, or set model.path to the Hub id",
            )
        )
    if m.path not in SHORT_NAMES and not hub and not local.is_dir():
        out.append(
            RecipeIssue(
                "model.path",
                "model directory not found" if not local.exists() else "not a directory",
                value=m.path,
                fix="point model.path at a local HF model directory, a Hugging Face Hub id (org/name), or a short "
                f"name ({', '.join(SHORT_NAMES)}); or pass --no-model-checks",
            )
        )
        return None
    try:
        return read_model_info(m.path, m.revision)
    except RlbridgeError as e:
        out.append(RecipeIssue("model.path", str(e), value=m.path))
        return None
