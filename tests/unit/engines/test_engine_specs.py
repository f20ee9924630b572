"""Engine specs (engines/spec.py, rollout/spec.py): the one place that says what an engine is.

- no code outside the spec modules compares an engine's name (the test reads rlbridge/ as text);
- the registries and the schema's choices name the same engines;
- a third trainer engine is one spec plus one registry entry: a toy engine, registered here only, is built by
  the registry, trains through TrainerRole, and is what the recipe checks, the plan and export-hf ask.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, get_args

import pytest
import torch

from rlbridge.batch import SeqBatch
from rlbridge.engines import registry
from rlbridge.engines.hf.spec import HF
from rlbridge.engines.spec import TrainerEngineSpec, TrainerMemory
from rlbridge.model.info import ModelInfo
from rlbridge.plan import make_plan
from rlbridge.recipe.checks.layout import check_layout, check_shared_prompts
from rlbridge.recipe.schema import AUTO_WIDTH_MULTIPLE, Recipe, RolloutCfg, TrainerCfg
from rlbridge.rollout.registry import ROLLOUT_ENGINES
from rlbridge.trainer.client import LocalTrainer
from rlbridge.trainer.role import TrainerRole
from rlbridge.weights import WeightExport
from tests.unit.test_import_rules import SPEC_MODULES  # the modules that may know engines by name

PKG = Path(__file__).resolve().parents[3] / "rlbridge"
NAME_COMPARE = re.compile(r"engine\s*(==|!=|in\s*\(|not\s+in\b)")


def name_compares(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if NAME_COMPARE.search(line)]


def test_no_engine_name_compare_outside_the_spec_modules() -> None:
    found = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel not in SPEC_MODULES:
            found += [f"{rel}: {line}" for line in name_compares(path.read_text(encoding="utf-8"))]
    assert not found, "ask the engine's spec (engines/registry.py, rollout/registry.py):\n" + "\n".join(found)


def test_the_compare_pattern_sees_compares() -> None:
    """A negative control: the test above would pass vacuously if the pattern matched nothing."""
    sample = 'if r.trainer.engine == "hf":\nx = r.rollout.engine != "vllm"\nif ro.engine in ("a",):\n'
    assert len(name_compares(sample)) == 3
    assert name_compares("spec = trainer_engine(r)\nname = r.trainer.engine\n") == []
    for rel in SPEC_MODULES:
        assert (PKG / rel).is_file(), rel


def test_the_registries_name_the_schemas_choices() -> None:
    assert set(get_args(TrainerCfg.model_fields["engine"].annotation)) == set(registry.TRAINER_ENGINES)
    assert set(get_args(RolloutCfg.model_fields["engine"].annotation)) == set(ROLLOUT_ENGINES)
    for name, spec in {**registry.TRAINER_ENGINES, **ROLLOUT_ENGINES}.items():
        assert spec.name == name
    assert HF.auto_width_multiple_cuda == AUTO_WIDTH_MULTIPLE


# ------------------------------------------------------------------------------------- a third engine
VOCAB = 11


class ToyEngine:
    """A unigram policy (one logit per token id): the TrainEngine protocol in thirty lines."""

    def __init__(self) -> None:
        self.theta = torch.zeros(VOCAB, requires_grad=True)
        self.optimizer = torch.optim.SGD([self.theta], lr=0.5)

    def _logp(self, batch: SeqBatch) -> tuple[torch.Tensor, torch.Tensor]:
        logp_v = torch.log_softmax(self.theta, dim=0)
        entropy = -(logp_v.exp() * logp_v).sum().expand(batch.response_ids.shape)
        return logp_v[batch.response_ids] * batch.response_mask, entropy * batch.response_mask

    def logprobs(self, batch: SeqBatch, *, reference: bool = False) -> torch.Tensor:
        with torch.no_grad():
            return self._logp(batch)[0]

    def train_step(self, batch: SeqBatch, loss_fn: Any, *, num_micro_batches: int) -> dict[str, float]:
        for rows in torch.arange(batch.size).tensor_split(num_micro_batches):
            logp, ent = self._logp(batch.select(rows))
            loss, _ = loss_fn(logp, ent, rows)
            (loss / num_micro_batches).backward()
        assert self.theta.grad is not None
        grad_norm = float(self.theta.grad.norm())
        self.optimizer.step()
        self.optimizer.zero_grad()
        return {"grad_norm": grad_norm, "skipped": 0.0}

    def export_weights(self, kind: str) -> WeightExport:
        return WeightExport(kind, {"theta": self.theta.detach().clone()})

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {"theta": self.theta.detach().clone()}

    def frozen_fingerprint(self) -> dict[str, float]:
        return {}


def _toy_critic(recipe: Recipe, model_dir: Path, device: str) -> Any:
    raise NotImplementedError("the toy engine has no critic")


def _toy_export(*args: Any) -> Any:
    raise NotImplementedError


TOY = TrainerEngineSpec(
    name="toy",
    build=lambda recipe, model_dir, device: ToyEngine(),
    build_critic=_toy_critic,
    exporter=_toy_export,
    memory=TrainerMemory(
        mlp_bytes=100.0, logits_bytes=8.0, lora_input_copies=False, logits_response_only=True
    ),
    moe="peft",
)  # every capability left out: none (no model parallelism, one process, no shared prompts, ...)
TINY = ModelInfo(
    architecture="LlamaForCausalLM", model_type="llama", hidden=64, intermediate=128, layers=2, heads=4,
    kv_heads=2, head_dim=16, vocab=VOCAB, max_positions=512, tied_embeddings=True,
)  # fmt: skip


def _recipe(engine: str, **trainer: Any) -> Recipe:
    """A valid recipe whose trainer.engine is then set to `engine` (the schema's choices do not name the toy)."""
    r = Recipe.model_validate({
        "name": "toy", "model": {"path": "unused", "dtype": "float32"}, "rollout": {"n": 2},
        "reward": {"fn": "arithmetic"},
        "data": {"train": {"path": "builtin:arithmetic"}, "batch_size": 2},
    })  # fmt: skip
    return r.model_copy(update={"trainer": r.trainer.model_copy(update={"engine": engine, **trainer})})


def test_a_third_trainer_engine_is_one_spec_and_one_registry_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry.TRAINER_ENGINES, "toy", TOY)  # the one registry line
    recipe = _recipe("toy")
    assert registry.trainer_engine(recipe) is TOY
    # built by the registry, trained through the role as the loop drives it
    trainer = LocalTrainer(TrainerRole(recipe, "unused"))
    assert isinstance(trainer.role.engine, ToyEngine)
    batch = SeqBatch.from_token_lists([[1, 2]] * 4, [[3, 4], [5], [3], [6, 7, 8]], pad_id=0)
    adv = torch.tensor([[1.0], [-1.0], [1.0], [-1.0]]).expand(4, batch.response_width) * batch.response_mask
    before = trainer.logprobs(batch)
    m = trainer.update(batch, adv, before, None)
    assert m["grad_norm"] > 0
    after = trainer.logprobs(batch)
    assert after[0, 0] > before[0, 0] and after[1, 0] < before[1, 0]  # rewarded tokens up, penalized down
    # the recipe checks ask its spec: no model parallelism, one process, no shared-prompt passes
    issues: list[Any] = []
    check_layout(_recipe("toy", parallel=recipe.trainer.parallel.model_copy(update={"tensor": 2})), issues)
    assert [(i.key, i.message) for i in issues] == [
        ("trainer.parallel.tensor", "the toy engine has no tensor parallelism")
    ]
    assert "trainer.engine: megatron" in (issues[0].fix or "")
    issues = []
    check_shared_prompts(_recipe("toy", shared_prompts="always"), issues)
    assert "the toy engine has no shared-prompt passes (the hf engine has)" in issues[0].message
    # the plan uses its memory coefficients (a wider MLP term than the hf engine's)
    toy_plan, hf_plan = make_plan(recipe, TINY).memory, make_plan(_recipe("hf"), TINY).memory
    assert toy_plan is not None and hf_plan is not None
    assert toy_plan.activations > hf_plan.activations
    # export-hf asks its spec for the exporter
    assert registry.trainer_engine(recipe).exporter is _toy_export
    assert registry.trainer_engine(_recipe("hf")) is HF
