"""rlbridge.engines.hf against plain transformers / peft on tiny random models (no hub, CPU, float32).

Tolerances: engine log-probs (float32) vs an unpadded float64 transformers forward: atol 1e-5. Logits of
exported weights vs the trainer's: relative Frobenius error < 1e-5. Gradients compared across code paths
(recompute on/off, micro-batching): rtol 1e-5 plus atol 1e-6 of the largest entry (float32 summation
order differs).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from safetensors.torch import load, load_file, save

from rlbridge.batch import LossFn, SeqBatch
from rlbridge.engines.base import TrainEngine
from rlbridge.engines.hf.engine import HFTrainEngine
from rlbridge.engines.hf.token_stats import response_logits, token_entropy
from rlbridge.engines.optim import lr_at
from rlbridge.errors import RlbridgeError
from rlbridge.recipe.schema import OptimCfg, Recipe
from rlbridge.weights.hf_files import save_hf
from tests.fixtures.tiny_models import BUILDERS

torch.set_num_threads(2)
PROMPTS = [[5, 31, 40, 7], [9, 12], [44, 45, 46, 47, 48, 49], [60]]
RESPONSES = [[100, 101, 102], [200], [300, 301, 302, 303, 304], [400, 401]]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {kind: build(root / kind) for kind, build in BUILDERS.items()}


def make_recipe(model_dir: Path, **sections: Any) -> Recipe:
    raw: dict[str, Any] = {
        "name": "t",
        "model": {"path": str(model_dir), "dtype": "float32"},
        "reward": {"fn": "arithmetic"},
        "data": {"train": {"path": "builtin:arithmetic"}},
        "trainer": {"logprob_chunk_size": 3, "optim": {"lr": 1e-2}},
    }
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return Recipe.model_validate(raw)


def lora(model_dir: Path, rank: int = 4, kind: str = "lora", **sections: Any) -> HFTrainEngine:
    lora_cfg = {"rank": rank, "alpha": 8.0, "targets": ["all-linear"], "type": kind}
    return HFTrainEngine(make_recipe(model_dir, lora=lora_cfg, **sections), model_dir)


def perturb_lora_b(engine: HFTrainEngine, seed: int = 1) -> None:
    """LoRA B starts at zero (adapters are a no-op); make them matter."""
    gen = torch.Generator().manual_seed(seed)
    state = engine.trainable_state()
    for name, tensor in state.items():
        if "lora_B" in name:
            state[name] = torch.randn(tensor.shape, generator=gen) * 0.2
    engine.load_trainable_state(state)


def ragged_batch() -> SeqBatch:
    return SeqBatch.from_token_lists(PROMPTS, RESPONSES, pad_id=0)


def token_sum_loss(batch: SeqBatch, scale: float = 1.0) -> LossFn:
    def loss_fn(
        logp: torch.Tensor, entropy: torch.Tensor, rows: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        return -(logp * batch.response_mask[rows]).sum() * scale, {"entropy": float(entropy.mean())}

    return loss_fn


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def full_logits(model: torch.nn.Module, batch: SeqBatch) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        out = model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
        )
    return out.logits * batch.attention_mask.unsqueeze(-1)


def assert_grads_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Equal up to float32 summation order: elementwise within 1e-5 relative + 4e-6 of the tensor's largest entry
    (the same sums in another order differ by ~1e-6 of the tensor's norm; on the 2026-12-01 venv one element of
    a 4-vs-1 micro-batch gradient was 1.1x the former 1e-6 bound, norm-relative gap 9.6e-7). A lost or doubled
    micro-batch moves gradients by 25-100 %."""
    assert a.keys() == b.keys()
    for name in a:
        scale = float(b[name].abs().max())
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=4e-6 * scale + 1e-12, msg=name)


# ------------------------------------------------------------------------------------------ log-probs
@pytest.mark.parametrize("kind", list(BUILDERS))
def test_logprobs_match_unpadded_float64_reference(model_dirs: dict[str, Path], kind: str) -> None:
    from transformers import AutoModelForCausalLM

    engine = HFTrainEngine(make_recipe(model_dirs[kind]), model_dirs[kind])
    protocol: TrainEngine = engine  # mypy checks the protocol
    del protocol
    batch = ragged_batch()
    got = engine.logprobs(batch)
    assert got.dtype == torch.float32 and got.shape == batch.response_mask.shape
    ref_model = AutoModelForCausalLM.from_pretrained(model_dirs[kind], dtype=torch.float64).eval()
    expected = torch.zeros_like(got, dtype=torch.float64)
    for i, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        with torch.no_grad():
            logits = ref_model(torch.tensor([prompt + response])).logits[0]
        logp = torch.log_softmax(logits, dim=-1)
        for j, token in enumerate(response):
            expected[i, j] = logp[len(prompt) + j - 1, token]
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-5)
    assert float(got.abs().sum()) > 1.0 and bool((got[batch.response_mask == 0] == 0).all())


def test_reference_logprobs_under_lora_are_the_base_model(model_dirs: dict[str, Path]) -> None:
    path = model_dirs["qwen2-bias"]
    base = HFTrainEngine(make_recipe(path), path).logprobs(ragged_batch())
    engine = lora(path)
    perturb_lora_b(engine)
    torch.testing.assert_close(engine.logprobs(ragged_batch(), reference=True), base, rtol=0, atol=1e-6)
    policy = engine.logprobs(ragged_batch())
    assert float((policy - base).abs().max()) > 1e-2
    torch.testing.assert_close(engine.logprobs(ragged_batch()), policy, rtol=0, atol=0)  # adapters back on


def test_full_finetune_reference_is_a_frozen_copy_only_with_kl(model_dirs: dict[str, Path]) -> None:
    path = model_dirs["llama-tied"]
    batch = ragged_batch()
    with pytest.raises(RlbridgeError, match="kl.coef"):
        HFTrainEngine(make_recipe(path), path).logprobs(batch, reference=True)
    engine = HFTrainEngine(make_recipe(path, algorithm={"name": "grpo", "kl": {"coef": 0.1}}), path)
    before = engine.logprobs(batch)
    engine.train_step(batch, token_sum_loss(batch), num_micro_batches=1)
    assert float((engine.logprobs(batch) - before).abs().max()) > 1e-3
    torch.testing.assert_close(engine.logprobs(batch, reference=True), before, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------ training
def test_train_step_changes_every_lora_tensor_and_no_frozen_one(model_dirs: dict[str, Path]) -> None:
    engine = lora(model_dirs["qwen2-bias"])
    perturb_lora_b(engine)
    start = engine.trainable_state()
    frozen = {n: p.detach().clone() for n, p in engine.model.named_parameters() if not p.requires_grad}
    fingerprint = engine.frozen_fingerprint()
    batch = ragged_batch()
    metrics = engine.train_step(batch, token_sum_loss(batch), num_micro_batches=2)
    assert metrics["skipped"] == 0.0 and metrics["lr"] == pytest.approx(1e-2)
    assert 0 < metrics["grad_norm"] < float("inf") and "entropy" in metrics
    after = engine.trainable_state()
    assert len(after) == 2 * 7 * 2  # lora_A + lora_B, 7 projections, 2 layers
    assert [n for n in after if torch.equal(after[n], start[n])] == []
    assert all(torch.equal(p, frozen[n]) for n, p in engine.model.named_parameters() if not p.requires_grad)
    assert engine.frozen_fingerprint() == fingerprint


def test_recompute_with_lora_gives_the_same_nonzero_adapter_grads(model_dirs: dict[str, Path]) -> None:
    path = model_dirs["llama-tied"]
    plain = lora(path)
    recomputed = lora(path, trainer={"recompute": {"granularity": "full"}})
    assert recomputed.hf_model.is_gradient_checkpointing and recomputed.input_grads_enabled()
    perturb_lora_b(plain)
    perturb_lora_b(recomputed)
    layer_calls: list[int] = []
    cast(Any, recomputed.hf_model).model.layers[0].register_forward_pre_hook(lambda *_: layer_calls.append(1))
    batch = ragged_batch()
    got = recomputed.gradients(batch, token_sum_loss(batch), num_micro_batches=1)
    assert len(layer_calls) == 2  # forward + recompute in backward: checkpointing is really on
    expected = plain.gradients(batch, token_sum_loss(batch), num_micro_batches=1)
    assert_grads_close(got, expected)
    assert all(float(g.abs().max()) > 0 for g in got.values())


def test_micro_batches_accumulate_exactly(model_dirs: dict[str, Path]) -> None:
    engine = lora(model_dirs["qwen2-bias"])
    perturb_lora_b(engine)
    batch = ragged_batch()
    # the engine backpropagates loss / num_micro_batches, so a token sum scaled by it is micro-batch invariant
    one = engine.gradients(batch, token_sum_loss(batch, scale=1.0), num_micro_batches=1)
    four = engine.gradients(batch, token_sum_loss(batch, scale=4.0), num_micro_batches=4)
    assert_grads_close(four, one)


def test_nonfinite_loss_or_gradient_skips_the_step(model_dirs: dict[str, Path]) -> None:
    engine = lora(model_dirs["qwen2-bias"])
    perturb_lora_b(engine)
    start = engine.trainable_state()
    batch = ragged_batch()

    def nan_loss(
        logp: torch.Tensor, entropy: torch.Tensor, rows: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        return logp.sum() * float("nan"), {}

    def inf_grad(
        logp: torch.Tensor, entropy: torch.Tensor, rows: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        return torch.sqrt(logp - logp.detach()).sum(), {}  # value 0, gradient 1 / (2 sqrt 0) = inf

    metrics = engine.train_step(batch, nan_loss, num_micro_batches=2)
    assert metrics["skipped"] == 1.0 and metrics["nonfinite"] == ["loss"]
    metrics = engine.train_step(batch, inf_grad, num_micro_batches=1)
    assert (
        metrics["skipped"] == 1.0 and metrics["nonfinite"] and all("lora_" in n for n in metrics["nonfinite"])
    )
    assert all(torch.equal(v, start[k]) for k, v in engine.trainable_state().items())
    assert engine.num_optimizer_steps == 0 and not engine.optimizer.state


def test_optimizer_state_round_trip_reproduces_the_next_step(model_dirs: dict[str, Path]) -> None:
    path = model_dirs["llama-tied"]
    optim = {"lr": 1e-2, "schedule": "cosine", "warmup_steps": 1, "min_lr": 1e-3, "weight_decay": 0.1}
    first = lora(path, trainer={"optim": optim})
    perturb_lora_b(first)
    batch = ragged_batch()
    first.train_step(batch, token_sum_loss(batch), num_micro_batches=1)
    tensors, meta = first.optimizer_state()
    weights = load(save(first.trainable_state()))  # through safetensors bytes and JSON: no pickle
    tensors, meta = load(save(tensors)), json.loads(json.dumps(meta))
    expected = first.train_step(batch, token_sum_loss(batch), num_micro_batches=1)

    second = lora(path, trainer={"optim": optim})
    second.load_trainable_state(weights)
    second.load_optimizer_state(tensors, meta)
    got = second.train_step(batch, token_sum_loss(batch), num_micro_batches=1)
    assert got == expected and got["lr"] == lr_at(second.recipe.trainer.optim, 1, second.total_steps)
    final = second.trainable_state()
    assert all(torch.equal(final[k], v) for k, v in first.trainable_state().items())


def test_entropy_and_its_gradient(model_dirs: dict[str, Path]) -> None:
    from rlbridge.algo.losses import entropy_from_logits

    logits = torch.randn(3, 5, 50, dtype=torch.float64) * 4
    torch.testing.assert_close(token_entropy(logits), entropy_from_logits(logits), rtol=1e-12, atol=1e-12)
    engine = lora(model_dirs["llama-tied"], algorithm={"name": "grpo", "entropy_coef": 0.01})
    perturb_lora_b(engine)
    batch = ragged_batch()

    def entropy_loss(
        logp: torch.Tensor, entropy: torch.Tensor, rows: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        return -(entropy * batch.response_mask[rows]).sum(), {}

    # through engines/hf/token_stats' hand-written backward
    got = engine.gradients(batch, entropy_loss, num_micro_batches=1)
    engine.model.train()
    for entropy_fn, atol in (
        (token_entropy, 1e-5),
        (entropy_from_logits, 1e-5),
    ):  # autograd through two other float32 formulas (measured: 5e-6 of the largest gradient)
        entropy = entropy_fn(response_logits(engine.model, batch))
        (-(entropy * batch.response_mask).sum()).backward()
        for name, param in engine.model.named_parameters():
            if param.grad is not None:
                scale = float(param.grad.abs().max())
                torch.testing.assert_close(got[name], param.grad, rtol=1e-5, atol=atol * scale, msg=name)
        engine.optimizer.zero_grad(set_to_none=True)


def test_lr_schedule() -> None:
    optim = OptimCfg(lr=1.0, min_lr=0.1, schedule="cosine", warmup_steps=2)
    assert [lr_at(optim, s, 12) for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert lr_at(optim, 7, 12) == pytest.approx(0.55) and lr_at(optim, 12, 12) == pytest.approx(0.1)
    linear = OptimCfg(lr=1.0, schedule="linear")
    assert lr_at(linear, 5, 10) == pytest.approx(0.5) and lr_at(OptimCfg(lr=0.3), 99, 10) == 0.3


# ------------------------------------------------------------------------------------------ export
def _plain_save_keys(model_dir: Path, tmp: Path) -> set[str]:
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(model_dir).save_pretrained(tmp)
    return set(load_file(tmp / "model.safetensors"))


@pytest.mark.parametrize(
    ("kind", "adapter"), [("llama-tied", "lora"), ("qwen2-bias", "lora"), ("llama-tied", "dora")]
)
def test_merged_export_reproduces_the_trainer_logits(
    model_dirs: dict[str, Path], tmp_path: Path, kind: str, adapter: str
) -> None:
    from transformers import AutoModelForCausalLM

    path = model_dirs[kind]
    engine = lora(path, kind=adapter)
    perturb_lora_b(engine)
    batch = ragged_batch()
    engine.train_step(batch, token_sum_loss(batch), num_micro_batches=1)  # DoRA magnitudes move too
    before = engine.trainable_state()
    weights = engine.export_weights("merged")
    assert set(weights.tensors) == _plain_save_keys(path, tmp_path / "plain")
    assert ("lm_head.weight" in weights.tensors) == (kind == "qwen2-bias")
    assert all(torch.equal(v, before[k]) for k, v in engine.trainable_state().items())  # live model untouched
    out = save_hf(tmp_path / "merged", weights, base_dir=path)
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert rel_err(full_logits(exported, batch), full_logits(engine.model, batch)) < 1e-5


def test_adapter_export_is_what_peft_saves_and_loads(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = model_dirs["qwen2-bias"]
    engine = lora(path)
    perturb_lora_b(engine)
    weights = engine.export_weights("adapter")
    out = save_hf(tmp_path / "adapter", weights)
    engine.model.save_pretrained(tmp_path / "peft")  # type: ignore[operator]
    peft_config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    ours = json.loads((out / "adapter_config.json").read_text())
    assert sorted(ours.pop("target_modules")) == sorted(peft_config.pop("target_modules"))  # peft: set order
    assert ours == {**peft_config, "base_model_name_or_path": str(path)}
    assert set(load_file(out / "adapter_model.safetensors")) == set(
        load_file(tmp_path / "peft" / "adapter_model.safetensors")
    )
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), out)
    batch = ragged_batch()
    assert rel_err(full_logits(loaded, batch), full_logits(engine.model, batch)) < 1e-5


def test_repeated_adapter_exports_follow_the_live_parameters(model_dirs: dict[str, Path]) -> None:
    """The second and later adapter exports read the parameters the first one found (no state_dict walk): after
    a train step, a perturbation and a checkpoint load they still equal peft's own state dict, name by name, in
    its order, and stay copies."""
    from peft import get_peft_model_state_dict

    engine = lora(model_dirs["qwen2-bias"])
    first = engine.export_weights("adapter").tensors
    batch = ragged_batch()
    engine.train_step(batch, token_sum_loss(batch), num_micro_batches=1)
    perturb_lora_b(engine, seed=2)
    saved = engine.trainable_state()
    engine.load_trainable_state({k: v + 0.01 for k, v in saved.items()})
    for _ in range(2):
        ours = engine.export_weights("adapter").tensors
        peft = get_peft_model_state_dict(engine.model, adapter_name="default")
        assert list(ours) == list(peft) == list(first)
        assert all(torch.equal(ours[k], peft[k]) for k in peft)
        assert any(not torch.equal(ours[k], first[k]) for k in peft)  # it moved since the first export
    with torch.no_grad():
        next(p for n, p in engine.model.named_parameters() if "lora_B" in n).add_(1.0)
    assert any(not torch.equal(ours[k], v) for k, v in get_peft_model_state_dict(engine.model).items())


def test_full_finetune_export(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = model_dirs["qwen2-bias"]
    engine = HFTrainEngine(make_recipe(path), path)
    with pytest.raises(RlbridgeError, match="lora.rank"):
        engine.export_weights("adapter")
    assert engine.frozen_fingerprint() == {}
    weights = engine.export_weights("merged")
    assert set(weights.tensors) == _plain_save_keys(path, tmp_path / "plain")
    saved = load_file(save_hf(tmp_path / "m", weights, base_dir=path) / "model.safetensors")
    assert saved.keys() == weights.tensors.keys()
    assert all(torch.equal(v, weights.tensors[k]) for k, v in saved.items())
