"""No query row fully masked in the hf engine's and critic's attention (rlbridge/engines/hf/model.py attend_to_self),
and nothing changed at real positions, on a tiny Llama with LoRA (CPU).

A query row with no allowed key (a left-padding column, a row that is padding throughout) makes the memory-efficient
SDPA kernel's backward give NaN on GPUs (tests/gpu/test_gpu_masked_rows.py shows it there). The CPU kernels give
such rows zeros in both directions (test_cpu_kernels_give_fully_masked_rows_zeros): the failure cannot be reproduced
here, so these tests check the masks SDPA is given, and that the fix changes no real token's numbers:
- every SDPA call of every pass (log-probs, reference log-probs, training passes at their own widths, with rounded
  widths (trainer.pass_width_multiple, both sides as under trainer.cuda_graphs), shared-prompt passes with their
  cache, the critic's) gets a mask with at least one allowed key in every query row, on a batch with left and right
  padding and a row that is padding throughout; transformers' plain sdpa masks (the negative control) do not;
- log-probs and LoRA gradients are bitwise equal to those of plain sdpa masks (float32 and float64): real rows'
  masks are unchanged and padded positions get a zero gradient either way;
- and they match an independent transformers + peft forward of each row alone, without padding: float32 log-probs
  within 2e-5 absolute (measured 6.7e-6, log-probs down to -10) and gradients within 5e-6 relative Frobenius error
  (measured 6.1e-7); float64 within 2e-6 and 1e-6 (measured 9.5e-7 and 1.6e-7: the engine's logits and log-softmax
  are float32 whatever the model's dtype, and so are the reference's).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from rlbridge.batch import SeqBatch
from rlbridge.engines.hf.critic import HFCritic
from rlbridge.engines.hf.engine import HFTrainEngine
from rlbridge.engines.hf.model import SELF_ATTENDING_MATH_SDPA, SELF_ATTENDING_SDPA
from rlbridge.recipe.schema import Recipe
from tests.fixtures.spread import spread_lists
from tests.fixtures.tiny_llama import PAD_ID, build_tiny_llama
from tests.unit.engines.test_padding_free import perturb_lora_b
from tests.unit.engines.test_shared_prompts import grouped_lists

Tensor = torch.Tensor
torch.set_num_threads(2)
NUM_MICRO = 3
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny"))


def recipe(
    model_dir: Path, algorithm: dict[str, Any] | None = None, dtype: str = "float32", **trainer: Any
) -> Recipe:
    return Recipe.model_validate(
        {
            "name": "t",
            "model": {"path": str(model_dir), "dtype": dtype},
            "lora": {"rank": 4, "alpha": 8.0, "targets": ["all-linear"]},
            "trainer": {"logprob_chunk_size": 3, "optim": {"lr": 1e-2}, **trainer},
            "rollout": {"n": 3, "max_response_tokens": 32},
            "reward": {"fn": "arithmetic"},
            "data": {"train": {"path": "builtin:arithmetic"}, "batch_size": 4},
            "algorithm": algorithm or {"name": "grpo", "kl": {"coef": 0.1}},
            "cluster": {"device": "cpu"},
        }
    )


def with_padding_row(batch: SeqBatch) -> SeqBatch:
    """`batch` and one more row that is padding throughout (attention and response mask 0 everywhere)."""
    return SeqBatch(
        input_ids=torch.cat([batch.input_ids, torch.full_like(batch.input_ids[:1], PAD_ID)]),
        attention_mask=torch.cat([batch.attention_mask, torch.zeros_like(batch.attention_mask[:1])]),
        position_ids=torch.cat([batch.position_ids, torch.zeros_like(batch.position_ids[:1])]),
        response_mask=torch.cat([batch.response_mask, torch.zeros_like(batch.response_mask[:1])]),
        prompt_width=batch.prompt_width,
    )


def spread_batch() -> SeqBatch:
    """Prompts of 1-14 tokens (left padding), responses of 1-17 (right padding), and a row of padding only."""
    return with_padding_row(SeqBatch.from_token_lists(*spread_lists(), pad_id=PAD_ID))


@contextmanager
def sdpa_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[Tensor | None, bool, int, int]]]:
    """The (attn_mask, is_causal, query length, key length) of every SDPA call made inside."""
    calls: list[tuple[Tensor | None, bool, int, int]] = []
    sdpa = F.scaled_dot_product_attention

    def spy(query: Tensor, key: Tensor, value: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        mask = kwargs.get("attn_mask", args[0] if args else None)
        calls.append((mask, bool(kwargs.get("is_causal", False)), query.shape[-2], key.shape[-2]))
        return sdpa(query, key, value, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(F, "scaled_dot_product_attention", spy)
        yield calls


def empty_rows(calls: list[tuple[Tensor | None, bool, int, int]]) -> int:
    """How many query rows of these SDPA calls may attend to no key."""
    empty = 0
    for mask, causal, q, kv in calls:
        if mask is None:  # no mask: every key (q == 1) or sdpa's causal mask (key 0 at least) for every row
            assert q == 1 or (causal and q <= kv)
            continue
        allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min
        empty += int((~allowed.expand(-1, -1, q, kv).any(dim=-1)).sum())
    return empty


def weighted_loss(batch: SeqBatch, weights: Tensor) -> Any:
    """sum(weights * log-probs) over real response tokens, as a closure whose passes sum to it."""

    def fn(logp: Tensor, entropy: Tensor, rows: Tensor) -> tuple[Tensor, dict[str, float]]:
        return (weights[rows] * batch.response_mask[rows] * logp).sum() * NUM_MICRO, {}

    return fn


def all_passes(engine: HFTrainEngine, critic: HFCritic | None, batch: SeqBatch) -> None:
    """Log-probs, reference log-probs, a training pass per micro-batch, the critic's values and update."""
    weights = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(3))
    engine.logprobs(batch)
    engine.logprobs(batch, reference=True)
    engine.gradients(batch, weighted_loss(batch, weights), num_micro_batches=NUM_MICRO)
    if critic is not None:
        critic.values(batch)
        critic.gradients(
            batch, lambda v, rows: ((v * weights[rows]).sum() * NUM_MICRO, {}), num_micro_batches=NUM_MICRO
        )


@pytest.mark.parametrize(
    ("layout", "trainer"),
    [
        ("plain", {}),
        ("rounded widths", {"pass_width_multiple": 8}),
        ("both sides rounded", {"pass_width_multiple": 8}),
        ("shared prompts", {"shared_prompts": "always"}),
    ],
)
def test_every_query_row_may_attend_to_a_key(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, layout: str, trainer: dict[str, Any]
) -> None:
    shared = layout == "shared prompts"
    ppo = None if shared else {"name": "ppo", "critic": {"lr": 1e-2}}
    r = recipe(model_dir, ppo, **trainer)
    engine = HFTrainEngine(r, model_dir)
    engine.sides = layout == "both sides rounded"  # the trainer.cuda_graphs layout (exact on a CPU too)
    critic = None if shared else HFCritic(r, model_dir)
    batch = (
        with_padding_row(SeqBatch.from_token_lists(*grouped_lists(), pad_id=PAD_ID))
        if shared
        else spread_batch()
    )
    with sdpa_calls(monkeypatch) as calls:
        all_passes(engine, critic, batch)
    assert len(calls) > 20 and sum(mask is not None for mask, *_ in calls) > 10
    if shared:  # the prompt passes and the response passes over their cache
        assert {q < kv for _, _, q, kv in calls} == {False, True}
    assert empty_rows(calls) == 0
    # negative control: transformers' own sdpa masks leave the padding columns' rows empty
    engine.hf_model.set_attn_implementation("sdpa")
    if critic is not None:
        critic.module["backbone"].get_base_model().set_attn_implementation("sdpa")
    with sdpa_calls(monkeypatch) as calls:
        all_passes(engine, critic, batch)
    assert empty_rows(calls) > 0


def test_every_model_the_engine_builds_attends_to_itself(model_dir: Path) -> None:
    """The policy (and its reference copy under full fine-tuning) and the critic's backbone."""
    full = recipe(model_dir, {"name": "ppo", "critic": {"lr": 1e-2}, "kl": {"coef": 0.1}})
    full = full.model_copy(update={"lora": full.lora.model_copy(update={"rank": 0})})
    engine, critic = HFTrainEngine(full, model_dir), HFCritic(full, model_dir)
    assert engine._reference is not None
    for model in (engine.hf_model, engine._reference, critic.module["backbone"]):
        assert model.config._attn_implementation == SELF_ATTENDING_SDPA


def flash_kernel_calls(engine: HFTrainEngine, critic: HFCritic, batch: SeqBatch) -> int:
    """How many CPU flash-attention kernel calls (forward or backward) all_passes makes."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        all_passes(engine, critic, batch)
    return sum(e.count for e in prof.key_averages() if "flash_attention" in e.key)


def test_a_16_bit_model_on_a_cpu_attends_on_the_math_kernel(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bfloat16 on a CPU: the policy and the critic's backbone get the self-attending masks on PyTorch's math SDPA
    kernel (the CPU flash kernel's bfloat16 backward is the slow one), every query row still has a key, and the
    log-probs are as close to the float32 model's as the flash kernel's: mean |diff| at most 1.2x, max at most 1.5x
    (measured: math 0.035 / 0.135, flash 0.042 / 0.127; bfloat16 rounding on this tiny random model)."""
    r = recipe(model_dir, {"name": "ppo", "critic": {"lr": 1e-2}}, dtype="bfloat16")
    engine, critic = HFTrainEngine(r, model_dir), HFCritic(r, model_dir)
    models = (engine.hf_model, critic.module["backbone"].get_base_model())
    assert {m.config._attn_implementation for m in models} == {SELF_ATTENDING_MATH_SDPA}
    batch = spread_batch()
    with sdpa_calls(monkeypatch) as calls:
        all_passes(engine, critic, batch)
    assert len(calls) > 20 and empty_rows(calls) == 0
    assert flash_kernel_calls(engine, critic, batch) == 0
    math_logp = engine.logprobs(batch)
    # negative control: transformers' sdpa (same masks at real positions) runs the flash kernel
    for m in models:
        m.set_attn_implementation("sdpa")
    assert flash_kernel_calls(engine, critic, batch) > 0
    flash_logp = engine.logprobs(batch)
    exact = HFTrainEngine(recipe(model_dir, dtype="float32"), model_dir).logprobs(batch)
    real = batch.response_mask > 0
    err = {k: (v - exact)[real].abs() for k, v in {"math": math_logp, "flash": flash_logp}.items()}
    stats = {k: (float(e.mean()), float(e.max())) for k, e in err.items()}
    assert stats["math"][0] <= 1.2 * stats["flash"][0] and stats["math"][1] <= 1.5 * stats["flash"][1], stats


def reference_pass(
    model_dir: Path, trainable: dict[str, Tensor], weights: Tensor, dtype: torch.dtype
) -> tuple[list[Tensor], dict[str, Tensor]]:
    """Independent of rlbridge: transformers + peft, each row of spread_lists alone (no padding, no mask), the
    engine's adapter weights. Returns each row's response log-probs and the gradient of sum(weights * log-probs)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    )
    params = dict(model.named_parameters())
    assert {n for n, p in params.items() if p.requires_grad} == set(trainable)
    with torch.no_grad():
        for name, tensor in trainable.items():
            params[name].copy_(tensor)
    model.to(dtype)
    rows = []
    for i, (prompt, response) in enumerate(zip(*spread_lists(), strict=True)):
        ids = torch.tensor([prompt + response])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        logp = logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None])[:, 0]
        (weights[i, : len(response)] * logp).sum().backward()
        rows.append(logp.detach())
    return rows, {n: params[n].grad.clone() for n in trainable}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_real_positions_are_unchanged(model_dir: Path, dtype: torch.dtype) -> None:
    engine = HFTrainEngine(recipe(model_dir, max_tokens_per_micro_batch=48), model_dir)
    perturb_lora_b(engine.trainable_state(), engine.load_trainable_state)
    trainable = engine.trainable_state()
    engine.model.to(dtype)
    batch = spread_batch()
    weights = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(3))
    fn = weighted_loss(batch, weights)
    logp = engine.logprobs(batch)
    grads = engine.gradients(batch, fn, num_micro_batches=NUM_MICRO)
    assert all(bool(g.isfinite().all()) and float(g.abs().max()) > 0 for g in grads.values())

    engine.hf_model.set_attn_implementation("sdpa")  # transformers' own masks: padding rows fully masked
    assert torch.equal(engine.logprobs(batch), logp)
    plain = engine.gradients(batch, fn, num_micro_batches=NUM_MICRO)
    assert all(torch.equal(grads[n], plain[n]) for n in grads)

    want_rows, want_grads = reference_pass(model_dir, trainable, weights, dtype)
    tol = 2e-5 if dtype == torch.float32 else 2e-6
    for i, want in enumerate(want_rows):
        torch.testing.assert_close(logp[i, : len(want)], want.float(), atol=tol, rtol=0)
    assert float(logp[-1].abs().max()) == 0.0  # the padding row
    for name, want in want_grads.items():
        err = float((grads[name].double() - want.double()).norm() / want.double().norm())
        assert err < (5e-6 if dtype == torch.float32 else 1e-6), (name, err)


@pytest.mark.parametrize("backend", ["MATH", "FLASH_ATTENTION"])
def test_cpu_kernels_give_fully_masked_rows_zeros(backend: str) -> None:
    """Why the CPU never showed the NaN: its SDPA kernels return zeros for a fully masked query row and give it a
    finite (zero) gradient, in float32 and bfloat16 (the GPU's memory-efficient kernel does not:
    tests/gpu/test_gpu_masked_rows.py)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    pad = torch.tensor([[False, False, True, True], [True, True, True, True]])
    mask = (torch.ones(4, 4, dtype=torch.bool).tril()[None] & pad[:, None, :])[:, None]
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(2, 2, 4, 8, dtype=dtype, requires_grad=True) for _ in range(3))
        with sdpa_kernel(getattr(SDPBackend, backend)):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out.sum().backward()
        assert float(out.detach()[0, :, :2].abs().max()) == 0.0
        assert all(bool(t.grad.isfinite().all()) for t in (q, k, v))
