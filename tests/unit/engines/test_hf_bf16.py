"""bfloat16 numerics of the hf engine and its critic (rlbridge/engines/hf/master.py) on tiny random models, CPU.

Tolerances, and why:
- A full fine-tuning step with a tiny lr (1e-4, weights ~0.4 whose bf16 half-ulp is ~1e-3): three steps of
  the bfloat16 engine move its float32 masters like the float32 engine moves its weights, relative error of
  the whole update < 0.3 (measured 0.17 on both tiny models: bf16 gradients differ, and Adam's first steps
  are about lr * sign(g), so small gradients flip). The negative control, plain AdamW on the bfloat16
  weights with the same gradients, moves ~5 % of the weights and is off by > 0.9 (measured 0.97).
- bf16 log-probs vs an unpadded float64 forward on the float32 checkpoint: mean |diff| < 0.08, max < 0.4
  (measured mean 0.030-0.039, max 0.11-0.14; these tiny models put ~1e-4 probability on the test tokens,
  |log p| ~ 10, so the bf16 rounding of logits of that size dominates).
- Checkpoint round trips are exact (torch.equal), as for float32.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, save

from rlbridge.batch import SeqBatch
from rlbridge.engines.hf.critic import HFCritic
from rlbridge.engines.hf.engine import HFTrainEngine
from rlbridge.recipe.schema import Recipe
from tests.fixtures.tiny_models import BUILDERS
from tests.unit.engines.test_hf_engine import make_recipe, ragged_batch, token_sum_loss

torch.set_num_threads(2)
FULL = {"rank": 0}
LORA = {"rank": 4, "alpha": 8.0, "targets": ["all-linear"]}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {kind: build(root / kind) for kind, build in BUILDERS.items()}


def engine(path: Path, dtype: str, lr: float = 1e-4, lora: dict | None = None) -> HFTrainEngine:
    recipe = make_recipe(path, model={"dtype": dtype}, lora=lora or FULL, trainer={"optim": {"lr": lr}})
    return HFTrainEngine(recipe, path)


def update(start: dict[str, torch.Tensor], end: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: end[k].double() - start[k].double() for k in start}


def rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    num = sum(float((a[k] - b[k]).norm()) ** 2 for k in b)
    return (num / sum(float(b[k].norm()) ** 2 for k in b)) ** 0.5


# ------------------------------------------------------------------------------------------ policy
@pytest.mark.parametrize("kind", list(BUILDERS))
def test_bf16_full_finetune_tiny_lr_moves_like_float32(model_dirs: dict[str, Path], kind: str) -> None:
    path, batch = model_dirs[kind], ragged_batch()
    moves = {}
    for dtype in ("float32", "bfloat16"):
        e = engine(path, dtype)
        start = e.trainable_state()
        for _ in range(3):
            assert e.train_step(batch, token_sum_loss(batch), num_micro_batches=2)["skipped"] == 0.0
        moves[dtype] = update(start, e.trainable_state())
    err = rel(moves["bfloat16"], moves["float32"])
    assert err < 0.3, err
    # the model the forward runs is the masters rounded to bfloat16
    masters = dict(e._trainable)
    assert all(torch.equal(p, masters[n].to(p.dtype)) for n, p in e.model.named_parameters())

    # negative control: plain AdamW on the bfloat16 weights, fed the bf16 engine's own gradients
    plain = engine(path, "bfloat16")
    weights = {n: p.detach().clone().requires_grad_() for n, p in plain.model.named_parameters()}
    start = {n: w.detach().clone() for n, w in weights.items()}
    optimizer = torch.optim.AdamW(
        weights.values(), lr=1e-4, weight_decay=plain.recipe.trainer.optim.weight_decay
    )
    for _ in range(3):
        for n, g in plain.gradients(batch, token_sum_loss(batch), num_micro_batches=2).items():
            weights[n].grad = g.to(torch.bfloat16)
        optimizer.step()
    plain_move = update(start, {n: w.detach() for n, w in weights.items()})
    moved = sum(int((v != 0).sum()) for v in plain_move.values()) / sum(
        v.numel() for v in plain_move.values()
    )
    assert rel(plain_move, moves["float32"]) > 0.9 and moved < 0.2, (rel(plain_move, moves["float32"]), moved)


def test_masters_and_moments_are_float32(model_dirs: dict[str, Path]) -> None:
    path, batch = model_dirs["llama-tied"], ragged_batch()
    full = engine(path, "bfloat16")
    assert full.master.num_copies == len(full._trainable) > 0
    assert {p.dtype for p in full.model.parameters()} == {torch.bfloat16}
    full.train_step(batch, token_sum_loss(batch), num_micro_batches=2)
    assert all(p.dtype == torch.float32 for _, p in full._trainable)
    states = list(full.optimizer.state.values())
    assert len(states) == len(full._trainable)
    assert all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.float32 for s in states)
    assert all(p.grad is None for p in full.model.parameters())  # moved into the masters, then cleared
    tensors, _ = full.optimizer_state()
    assert {v.dtype for k, v in tensors.items() if not k.endswith(":step")} == {torch.float32}

    # LoRA on a bfloat16 base: peft keeps the adapters float32; they are their own masters
    adapters = engine(path, "bfloat16", lora={"rank": 4, "alpha": 8.0, "targets": ["all-linear"]})
    assert adapters.master.num_copies == 0
    assert all(p.dtype == torch.float32 for _, p in adapters._trainable)
    assert {p.dtype for p in adapters.model.parameters() if not p.requires_grad} == {torch.bfloat16}


def float64_logprobs(ref: torch.nn.Module, batch: SeqBatch) -> torch.Tensor:
    """Response log-probs of `batch`'s unpadded rows, one row at a time, through `ref` (a float64 model)."""
    want = torch.zeros(batch.response_mask.shape, dtype=torch.float64)
    for i in range(batch.size):
        ids = batch.input_ids[i][batch.attention_mask[i] > 0]
        n = int(batch.response_mask[i].sum())
        with torch.no_grad():
            logp = torch.log_softmax(ref(input_ids=ids[None]).logits[0], dim=-1)
        want[i, :n] = logp[len(ids) - n - 1 : len(ids) - 1].gather(-1, ids[len(ids) - n :, None]).squeeze(-1)
    return want


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_bf16_logprobs_against_float64(model_dirs: dict[str, Path], kind: str) -> None:
    from transformers import AutoModelForCausalLM

    path, batch = model_dirs[kind], ragged_batch()
    got = engine(path, "bfloat16").logprobs(batch).double()
    want = float64_logprobs(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval(), batch)
    diff = (got - want).abs()[batch.response_mask > 0]
    print(f"{kind}: bf16 log-probs vs float64: mean {float(diff.mean()):.2e} max {float(diff.max()):.2e}")
    assert float(diff.mean()) < 0.08 and float(diff.max()) < 0.4, (float(diff.mean()), float(diff.max()))


@pytest.mark.parametrize("lora", [None, {**LORA, "compute_dtype": "model"}], ids=["full", "bf16 adapters"])
def test_bf16_checkpoint_round_trip_is_exact(model_dirs: dict[str, Path], lora: dict | None) -> None:
    path, batch = model_dirs["llama-tied"], ragged_batch()
    first = engine(path, "bfloat16", lr=1e-3, lora=lora)
    first.train_step(batch, token_sum_loss(batch), num_micro_batches=2)
    weights = load(save(first.trainable_state()))
    tensors, meta = first.optimizer_state()
    tensors = load(save(tensors))
    assert {v.dtype for v in weights.values()} == {torch.float32}
    # the masters carry what bfloat16 rounding loses: a checkpoint of the model's weights would not resume
    assert any(not torch.equal(v, v.bfloat16().float()) for v in weights.values())
    expected = first.train_step(batch, token_sum_loss(batch), num_micro_batches=2)

    second = engine(path, "bfloat16", lr=1e-3, lora=lora)
    second.load_trainable_state(weights)
    second.load_optimizer_state(tensors, meta)
    assert second.train_step(batch, token_sum_loss(batch), num_micro_batches=2) == expected
    a, b = first.trainable_state(), second.trainable_state()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(
        torch.equal(p, q) for p, q in zip(first.model.parameters(), second.model.parameters(), strict=True)
    )


# ------------------------------------------------------------------------------------- LoRA dtype


def lora_engines(path: Path, lr: float = 1e-4) -> dict[str, HFTrainEngine]:
    """The same adapters (B random, not peft's zeros; values bf16 can hold, so both engines start equal) computed
    in float32 (peft's default) and in the model's bfloat16 (lora.compute_dtype model)."""
    engines = {
        d: engine(path, "bfloat16", lr=lr, lora={**LORA, "compute_dtype": d}) for d in ("float32", "model")
    }
    gen = torch.Generator().manual_seed(0)
    start = {
        n: (torch.randn(p.shape, generator=gen) * 0.05).bfloat16().float()
        for n, p in engines["float32"].trainable_state().items()
    }
    for e in engines.values():
        e.load_trainable_state(start)
    return engines


def test_lora_in_the_model_dtype_keeps_float32_masters(model_dirs: dict[str, Path]) -> None:
    path, batch = model_dirs["llama-tied"], ragged_batch()
    e = lora_engines(path)["model"]
    adapters = [p for _, p in e.model.named_parameters() if p.requires_grad]
    assert adapters and {p.dtype for p in adapters} == {torch.bfloat16}
    assert e.master.num_copies == len(e._trainable) == len(adapters)
    e.train_step(batch, token_sum_loss(batch), num_micro_batches=2)
    assert all(p.dtype == torch.float32 for _, p in e._trainable)
    assert all(s["exp_avg"].dtype == torch.float32 for s in e.optimizer.state.values())
    masters = dict(e._trainable)
    assert all(torch.equal(p, masters[n].to(p.dtype)) for n, p in e.model.named_parameters() if n in masters)
    # exported adapters (sync, export-hf) are the model's bfloat16 copies; checkpoints the float32 masters
    assert {v.dtype for v in e.trainable_state().values()} == {torch.float32}


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_lora_in_the_model_dtype_matches_float32_adapters(model_dirs: dict[str, Path], kind: str) -> None:
    path, batch = model_dirs[kind], ragged_batch()
    engines = lora_engines(path)
    mask = batch.response_mask > 0
    # the float32-adapter engine's weights (bf16 base, bf16-exact adapters) in float64
    want = float64_logprobs(copy.deepcopy(engines["float32"].model).double().eval(), batch)[mask]
    err = {}
    for d, e in engines.items():
        diff = (e.logprobs(batch).double()[mask] - want).abs()
        err[d] = float(diff.mean()), float(diff.max())
        print(f"{kind}: log-probs with {d} adapters vs float64: mean {err[d][0]:.2e} max {err[d][1]:.2e}")
    assert err["model"][0] < 1.35 * err["float32"][0] and err["model"][1] < 1.5 * err["float32"][1], err
    moves = {}
    for d, e in engines.items():
        start = e.trainable_state()
        for _ in range(3):
            assert e.train_step(batch, token_sum_loss(batch), num_micro_batches=2)["skipped"] == 0.0
        moves[d] = update(start, e.trainable_state())
    gap = rel(moves["model"], moves["float32"])
    print(f"{kind}: three steps' update, bf16 vs float32 adapters: relative error {gap:.3f}")
    assert gap < 0.2, gap


# ------------------------------------------------------------------------------------------ critic
def critic_recipe(path: Path) -> Recipe:
    return Recipe.model_validate(
        {
            "name": "t",
            "model": {"path": str(path), "dtype": "bfloat16"},
            "lora": FULL,
            "trainer": {"micro_batch_size": 2, "optim": {"lr": 1e-3}},
            "rollout": {"n": 1},
            "reward": {"fn": "arithmetic"},
            "data": {"train": {"path": "builtin:arithmetic"}, "batch_size": 4},
            "algorithm": {"name": "ppo", "critic": {"lr": 1e-4}},
            "run": {"steps": 6},
            "cluster": {"device": "cpu"},
        }
    )


def test_bf16_critic_has_float32_masters_and_resumes_exactly(model_dirs: dict[str, Path]) -> None:
    path, batch = model_dirs["llama-tied"], ragged_batch()

    def value_loss(values: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        return ((values - 1.0) ** 2 * batch.response_mask[rows]).sum(), {}

    critic = HFCritic(critic_recipe(path), path)
    head = critic.module["value_head"].weight
    assert critic.master.num_copies == len(critic._trainable) - 2  # all but the float32 head (weight, bias)
    assert any(p is head for _, p in critic._trainable)
    start = critic.trainable_state()
    critic.train_step(batch, value_loss, num_micro_batches=2)
    states = list(critic.optimizer.state.values())
    assert all(s["exp_avg"].dtype == torch.float32 for s in states) and len(states) == len(critic._trainable)
    moved = [k for k, v in critic.trainable_state().items() if not torch.equal(v, start[k])]
    assert len(moved) == len(start)  # lr 1e-4 moves every float32 master

    weights, (tensors, meta) = load(save(critic.trainable_state())), critic.optimizer_state()
    expected = critic.train_step(batch, value_loss, num_micro_batches=2)
    again = HFCritic(critic_recipe(path), path)
    again.load_trainable_state(weights)
    again.load_optimizer_state(load(save(tensors)), meta)
    assert again.train_step(batch, value_loss, num_micro_batches=2) == expected
    a, b = critic.trainable_state(), again.trainable_state()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_bf16_output_layer_returns_unrounded_float32_logits(model_dirs: dict[str, Path]) -> None:
    """The output layer of a 16-bit model multiplies its bf16 input and weight in float32 (engines/hf/model.float32_logits),
    and a full fine-tuning reference copy computes with its own (frozen) weight."""
    path, batch = model_dirs["llama-tied"], ragged_batch()
    recipe = make_recipe(
        path, model={"dtype": "bfloat16"}, lora=FULL, algorithm={"name": "grpo", "kl": {"coef": 0.1}}
    )
    e = HFTrainEngine(recipe, path)
    head = e.hf_model.get_output_embeddings()
    hidden = torch.randn(2, 3, head.in_features).bfloat16()
    logits = head(hidden)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(
        logits, hidden.double() @ head.weight.double().T, rtol=1e-6, atol=1e-5, check_dtype=False
    )
    assert not torch.equal(logits, logits.bfloat16().float())  # not rounded to bfloat16
    before = e.logprobs(batch)
    e.train_step(batch, token_sum_loss(batch), num_micro_batches=1)
    assert float((e.logprobs(batch) - before).abs().max()) > 1e-3
    torch.testing.assert_close(e.logprobs(batch, reference=True), before, rtol=0, atol=0)
