"""No compute on padding (rlbridge/engines/micro.py): micro-batches of rows grouped by length, each forward at
its rows' own widths, against the former full-width index-order micro-batches, on a tiny Llama (CPU, float32).

The batch has very different prompt (1..14) and response (1..17) lengths, so trimming drops most columns of
most micro-batches. Only float summation order differs (other matmul shapes). float32: losses within 1e-6
(relative or absolute: the GRPO losses here are ~0.02, sums of terms ~1), gradients of every trainable
tensor within 1e-5 relative Frobenius error and 1e-5 of the tensor's largest entry elementwise (measured:
~8e-7 for token-mean, up to 4e-6 with seq-mean + KL, whose terms cancel), log-probs and values atol 1e-5.
With the model cast to float64 the gradients agree within 1e-6 (measured ~6e-16, or ~6e-8 with an entropy
term: logits, entropies and losses stay float32): the float32 differences are rounding, not a changed loss.
A token budget (trainer.max_tokens_per_micro_batch: 5 passes here against 3 nominal) is held to the same
tolerances (the PPO test). The negative control shows that the same comparison fails for a closure that is not a share of the
mini-batch loss (a per-micro-batch mean), so the grouping really changes which rows share a micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from rlbridge.algo.objective import LossInputs, make_loss_fn, make_value_loss_fn
from rlbridge.batch import SeqBatch, pad_columns
from rlbridge.engines.hf.critic import HFCritic
from rlbridge.engines.hf.engine import HFTrainEngine
from rlbridge.engines.micro import budget_rows, chunk_rows, micro_batch_rows, scoring_passes, scoring_rows
from rlbridge.model.info import ModelInfo
from rlbridge.plan import make_plan
from rlbridge.recipe.schema import AUTO_WIDTH_MULTIPLE, MAX_GRAPHS, MAX_PASS_TOKENS, Recipe
from tests.fixtures.spread import spread_lists
from tests.fixtures.tiny_llama import build_tiny_llama

torch.set_num_threads(2)
NUM_MICRO = 3


def spread_batch() -> SeqBatch:
    return SeqBatch.from_token_lists(*spread_lists(), pad_id=256)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny"))


def recipe(
    model_dir: Path,
    algorithm: dict[str, Any],
    max_tokens: int | None = None,
    chunk: int | None = 3,
    micro: int = 1,
    width_multiple: int | None = 1,
) -> Recipe:
    return Recipe.model_validate(
        {
            "name": "t",
            "model": {"path": str(model_dir), "dtype": "float32"},
            "lora": {"rank": 4, "alpha": 8.0, "targets": ["all-linear"]},
            "trainer": {
                "logprob_chunk_size": chunk,
                "micro_batch_size": micro,
                "optim": {"lr": 1e-2},
                "max_tokens_per_micro_batch": max_tokens,
                "pass_width_multiple": width_multiple,
            },
            "rollout": {"n": 2, "max_response_tokens": 32},
            "reward": {"fn": "arithmetic"},
            "data": {"train": {"path": "builtin:arithmetic"}, "batch_size": 4},
            "algorithm": algorithm,
            "cluster": {"device": "cpu"},
        }
    )


def perturb_lora_b(
    trainable: dict[str, torch.Tensor], load: Callable[[dict[str, torch.Tensor]], None]
) -> None:
    gen = torch.Generator().manual_seed(1)
    load({n: torch.randn(t.shape, generator=gen) * 0.2 if "lora_B" in n else t for n, t in trainable.items()})


@contextmanager
def padded(obj: HFTrainEngine | HFCritic) -> Iterator[None]:
    """The former layout: index-order micro-batches at the full batch width."""
    obj.padding_free = False
    try:
        yield
    finally:
        obj.padding_free = True


def summed(fn: Callable[..., tuple[torch.Tensor, dict[str, float]]], total: list[float]) -> Any:
    """fn, also adding loss / NUM_MICRO (what the engine backpropagates) to total[0]."""

    def wrapped(*args: Any) -> tuple[torch.Tensor, dict[str, float]]:
        loss, metrics = fn(*args)
        total[0] += float(loss.detach()) / NUM_MICRO
        return loss, metrics

    return wrapped


def assert_grads_close(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float = 1e-5
) -> None:
    assert got.keys() == want.keys()
    for name, g in got.items():
        w = want[name].double()
        err = float((g.double() - w).norm() / w.norm())
        worst = float((g.double() - w).abs().max() / w.abs().max())
        assert err < tol and worst < tol, (name, err, worst)
    assert all(float(g.abs().max()) > 0 for g in got.values())


def policy_inputs(batch: SeqBatch, old: torch.Tensor, ref: torch.Tensor) -> LossInputs:
    """Loss inputs with random per-row advantages and old log-probs 0.05-noisy around `old` (seeded)."""
    gen = torch.Generator().manual_seed(2)
    adv = torch.randn(batch.size, 1, generator=gen).expand(-1, batch.response_width) * batch.response_mask
    noisy = old + 0.05 * torch.randn(old.shape, generator=gen) * batch.response_mask
    return LossInputs(
        adv_bt=adv, mask_bt=batch.response_mask, old_logp_bt=noisy, ref_logp_bt=ref, rollout_logp_bt=old
    )


def test_a_trimmed_sub_batch_is_the_sub_batch_built_alone() -> None:
    prompts, responses = spread_lists()
    batch = spread_batch()
    for rows in ([0, 3, 5], [1], [2, 6], list(range(8))):
        alone = SeqBatch.from_token_lists(
            [prompts[i] for i in rows], [responses[i] for i in rows], pad_id=256
        )
        got = batch.select(torch.tensor(rows)).trimmed()
        assert got.prompt_width == alone.prompt_width and got.response_width == alone.response_width
        for field in ("input_ids", "attention_mask", "position_ids", "response_mask"):
            assert torch.equal(getattr(got, field), getattr(alone, field)), (rows, field)
    x = torch.ones(2, 3, requires_grad=True)
    assert pad_columns(x, 5).shape == (2, 5) and pad_columns(x, 3) is x


def test_micro_batches_group_rows_by_length_with_the_former_sizes() -> None:
    batch = spread_batch()
    groups = micro_batch_rows(batch, NUM_MICRO)
    former = list(torch.arange(batch.size).tensor_split(NUM_MICRO))
    assert [len(g) for g in groups] == [len(g) for g in former]
    assert sorted(torch.cat(groups).tolist()) == list(range(batch.size))
    responses = batch.attention_mask[:, batch.prompt_width :].sum(dim=1)
    assert all(responses[a].max() <= responses[b].min() for a, b in zip(groups, groups[1:], strict=False))
    full = batch.size * batch.input_ids.shape[1]
    trimmed = sum(len(g) * batch.select(g).trimmed().input_ids.shape[1] for g in groups)
    assert trimmed < 0.7 * full  # the point of it: 154 of 248 token positions here


@pytest.mark.parametrize(
    "algorithm",
    [
        {"name": "grpo", "loss_agg": "token-mean", "entropy_coef": 0.01},
        {"name": "grpo", "loss_agg": "seq-mean-token-mean", "kl": {"coef": 0.1}},
        {"name": "dr_grpo"},  # seq-mean-token-sum-norm: the closure reads the padded width R
    ],
    ids=["token-mean+entropy", "seq-mean+kl", "dr_grpo"],
)
def test_policy_loss_and_gradients_match_the_padded_micro_batches(
    model_dir: Path, algorithm: dict[str, Any]
) -> None:
    r = recipe(model_dir, algorithm)
    engine = HFTrainEngine(r, model_dir)
    perturb_lora_b(engine.trainable_state(), engine.load_trainable_state)
    batch = spread_batch()
    with padded(engine):
        old_padded = engine.logprobs(batch)
        ref_padded = engine.logprobs(batch, reference=True)
    old, ref = engine.logprobs(batch), engine.logprobs(batch, reference=True)
    torch.testing.assert_close(old, old_padded, atol=1e-5, rtol=0)
    torch.testing.assert_close(ref, ref_padded, atol=1e-5, rtol=0)
    fn = make_loss_fn(r.algorithm, policy_inputs(batch, old_padded, ref_padded), norm_constant=32.0,
                      micro_scale=float(NUM_MICRO))  # fmt: skip
    for tol in (1e-5, 1e-6):  # float32, then the model cast to float64
        if tol < 1e-5:
            engine.model.double()
        losses = [[0.0], [0.0]]
        with padded(engine):
            want = engine.gradients(batch, summed(fn, losses[0]), num_micro_batches=NUM_MICRO)
        got = engine.gradients(batch, summed(fn, losses[1]), num_micro_batches=NUM_MICRO)
        assert losses[1][0] == pytest.approx(losses[0][0], rel=1e-6, abs=1e-6) and losses[0][0] != 0.0
        assert_grads_close(got, want, tol)


def test_a_per_micro_batch_mean_is_not_grouping_invariant(model_dir: Path) -> None:
    """Negative control: a closure that is not a share of the mini-batch loss sees the regrouping."""
    engine = HFTrainEngine(recipe(model_dir, {"name": "grpo"}), model_dir)
    perturb_lora_b(engine.trainable_state(), engine.load_trainable_state)
    batch = spread_batch()

    def micro_mean(logp: torch.Tensor, entropy: torch.Tensor, rows: torch.Tensor) -> Any:
        mask = batch.response_mask[rows]
        return -(logp * mask).sum() / mask.sum(), {}

    with padded(engine):
        want = engine.gradients(batch, micro_mean, num_micro_batches=NUM_MICRO)
    got = engine.gradients(batch, micro_mean, num_micro_batches=NUM_MICRO)
    with pytest.raises(AssertionError):
        assert_grads_close(got, want)


def test_token_budget_groups_fit_the_budget() -> None:
    batch = spread_batch()
    for budget in (1, 24, 48, 1000):
        groups = budget_rows(batch, budget)
        assert sorted(torch.cat(groups).tolist()) == list(range(batch.size))
        sizes = [batch.select(g).trimmed().input_ids.numel() for g in groups]
        assert all(size <= budget or len(g) == 1 for size, g in zip(sizes, groups, strict=True)), sizes
    assert len(budget_rows(batch, 1)) == batch.size and len(budget_rows(batch, 1000)) == 1


@pytest.mark.parametrize("max_tokens", [None, 48], ids=["micro_batch_size", "token-budget"])
def test_scoring_passes_follow_the_training_passes_unless_chunked(
    model_dir: Path, max_tokens: int | None
) -> None:
    """trainer.logprob_chunk_size null (the default): the no-gradient passes (log-probs, values) are grouped as a
    training pass of the same rows (micro_batch_size rows, or the token budget); a number keeps its own chunks.
    The log-probs and values do not depend on the grouping (atol 1e-5 against chunks of 3 at the full width)."""
    batch = spread_batch()
    ppo = {"name": "ppo", "critic": {"lr": 1e-2}}
    r = recipe(model_dir, ppo, max_tokens=max_tokens, chunk=None, micro=2)
    want = budget_rows(batch, 48) if max_tokens else micro_batch_rows(batch, -(-batch.size // 2))
    assert [g.tolist() for g in scoring_rows(batch, r.trainer)] == [g.tolist() for g in want]
    assert scoring_passes(batch.size, None, 2) == (-(-batch.size // 2), True)
    chunked = recipe(model_dir, ppo, max_tokens=max_tokens, chunk=3, micro=2)
    assert [g.tolist() for g in scoring_rows(batch, chunked.trainer)] == [
        g.tolist() for g in chunk_rows(batch, 3)
    ]
    assert scoring_passes(batch.size, 3, 2) == (-(-batch.size // 3), False)

    engine, critic = HFTrainEngine(r, model_dir), HFCritic(r, model_dir)
    perturb_lora_b(engine.trainable_state(), engine.load_trainable_state)
    perturb_lora_b(critic.trainable_state(), critic.load_trainable_state)
    got = engine.logprobs(batch), engine.logprobs(batch, reference=True), critic.values(batch)
    engine.recipe = critic.recipe = recipe(model_dir, ppo, chunk=3)
    with padded(engine), padded(critic):
        want_lp = engine.logprobs(batch), engine.logprobs(batch, reference=True), critic.values(batch)
    for g, w in zip(got, want_lp, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
        assert float(w.abs().max()) > 0


def pass_widths(obj: HFTrainEngine | HFCritic) -> tuple[list[int], Any]:
    """The widths of the forward passes `obj` runs from now on (a hook on its input embedding), and the hook."""
    widths: list[int] = []
    model = obj.hf_model if isinstance(obj, HFTrainEngine) else obj.module["backbone"]
    hook = model.get_input_embeddings().register_forward_hook(
        lambda _m, args, _o: widths.append(int(args[0].shape[1]))
    )
    return widths, hook


@pytest.mark.parametrize(
    ("max_tokens", "width_multiple"),
    [(None, 1), (48, 1), (48, 16)],
    ids=["micro_batch_size", "token-budget", "token-budget+width-multiple"],
)
def test_ppo_policy_and_critic_match_the_padded_micro_batches(
    model_dir: Path, max_tokens: int | None, width_multiple: int
) -> None:
    """With a token budget the passes differ in number too (5 here, against 3 nominal): still exact. With
    trainer.pass_width_multiple 16 every pass of both models is widened to 16 or 32 columns with masked prompt
    columns (SeqBatch.width_rounded): the same tolerances."""
    r = recipe(
        model_dir,
        {"name": "ppo", "critic": {"lr": 1e-2, "value_clip": 0.2}, "entropy_coef": 0.01},
        max_tokens=max_tokens,
        width_multiple=width_multiple,
    )
    engine, critic = HFTrainEngine(r, model_dir), HFCritic(r, model_dir)
    (policy_widths, policy_hook), (critic_widths, critic_hook) = pass_widths(engine), pass_widths(critic)
    perturb_lora_b(engine.trainable_state(), engine.load_trainable_state)
    perturb_lora_b(critic.trainable_state(), critic.load_trainable_state)
    batch = spread_batch()
    with padded(critic):
        values_padded = critic.values(batch)
    values = critic.values(batch)
    torch.testing.assert_close(values, values_padded, atol=1e-5, rtol=0)
    gen = torch.Generator().manual_seed(3)
    returns = (values_padded + torch.randn(values.shape, generator=gen)) * batch.response_mask
    adv = torch.randn(values.shape, generator=gen) * batch.response_mask
    with padded(engine):
        old = engine.logprobs(batch)
    inputs = LossInputs(adv, batch.response_mask, old - 0.05 * batch.response_mask, None, old)
    policy_fn = make_loss_fn(r.algorithm, inputs, norm_constant=32.0, micro_scale=float(NUM_MICRO))
    value_fn = make_value_loss_fn(
        r.algorithm.critic,  # type: ignore[union-attr]  # a PpoCfg
        values_padded,
        returns,
        batch.response_mask,
        micro_scale=float(NUM_MICRO),
    )
    for tol in (1e-5, 1e-6):  # float32, then the models cast to float64
        if tol < 1e-5:
            engine.model.double()
            critic.module["backbone"].double()  # the head reads hidden.float()
        losses = [[0.0], [0.0], [0.0], [0.0]]
        with padded(engine), padded(critic):
            want_policy = engine.gradients(batch, summed(policy_fn, losses[0]), num_micro_batches=NUM_MICRO)
            want_critic = critic.gradients(batch, summed(value_fn, losses[2]), num_micro_batches=NUM_MICRO)
        got_policy = engine.gradients(batch, summed(policy_fn, losses[1]), num_micro_batches=NUM_MICRO)
        got_critic = critic.gradients(batch, summed(value_fn, losses[3]), num_micro_batches=NUM_MICRO)
        for i in (0, 2):
            assert losses[i + 1][0] == pytest.approx(losses[i][0], rel=1e-6, abs=1e-6)
            assert losses[i][0] != 0.0
        assert_grads_close(got_policy, want_policy, tol)
        assert_grads_close(got_critic, want_critic, tol)
    policy_hook.remove()
    critic_hook.remove()
    full = batch.input_ids.shape[1]  # 31: the padded layout's passes
    for widths in (policy_widths, critic_widths):
        rounded = {w for w in widths if w != full}
        assert rounded and (width_multiple == 1 or rounded <= {16, 32}), sorted(set(widths))


@pytest.mark.parametrize("engine", ["hf", "megatron"])
def test_plan_bounds_activations_by_the_token_budget(engine: str) -> None:
    info = ModelInfo(
        architecture="LlamaForCausalLM", model_type="llama", hidden=576, intermediate=1536, layers=30, heads=9,
        kv_heads=3, head_dim=64, vocab=49152, max_positions=8192, tied_embeddings=True,
    )  # fmt: skip
    rollout = {"n": 2, "max_prompt_tokens": 256, "max_response_tokens": 768}  # sequences of up to 1024 tokens

    def activations(**trainer: Any) -> float:
        raw = {
            "name": "t",
            "model": {"path": "x", "dtype": "float32"},
            "trainer": {"engine": engine, **trainer},
            "rollout": rollout,
            "reward": {"fn": "arithmetic"},
            "data": {"train": {"path": "builtin:arithmetic"}, "batch_size": 4},
            "cluster": {"device": "cpu"},
        }
        memory = make_plan(Recipe.model_validate(raw), info).memory
        assert memory is not None
        return memory.activations

    assert activations(max_tokens_per_micro_batch=4096) == pytest.approx(activations(micro_batch_size=4))
    assert activations(max_tokens_per_micro_batch=100) == pytest.approx(activations(micro_batch_size=1))


def test_a_rounded_width_adds_masked_prompt_columns_only() -> None:
    """SeqBatch.width_rounded: P + R up to a multiple with columns on the left that no token attends (id 0,
    mask 0, position 0); the original columns, the response columns and R unchanged; routed experts follow."""
    full = spread_batch()
    routed = full.input_ids.to(torch.int16)[:, :, None, None].expand(-1, -1, 2, 2).clone()
    for rows in ([0, 3, 5], [1], [2, 6], list(range(8))):
        sub = SeqBatch(full.input_ids, full.attention_mask, full.position_ids, full.response_mask,
                       full.prompt_width, routed_experts=routed).select(torch.tensor(rows)).trimmed()  # fmt: skip
        for multiple in (1, 8, 16, 32):
            got = sub.width_rounded(multiple)
            width, extra = got.input_ids.shape[1], got.input_ids.shape[1] - sub.input_ids.shape[1]
            assert (
                width % multiple == 0
                and 0 <= extra < multiple
                and got.prompt_width == sub.prompt_width + extra
            )
            assert got.response_width == sub.response_width and torch.equal(
                got.response_mask, sub.response_mask
            )
            for field in ("input_ids", "attention_mask", "position_ids"):
                assert torch.equal(getattr(got, field)[:, extra:], getattr(sub, field)), field
                assert not bool(getattr(got, field)[:, :extra].any()), field
            assert got.routed_experts is not None
            assert torch.equal(got.routed_experts[:, extra:], sub.routed_experts)  # type: ignore[arg-type]
            assert torch.equal(
                got.routed_experts[:, :extra],
                sub.routed_experts[:, :1].expand_as(got.routed_experts[:, :extra]),
            )  # type: ignore[index]
            assert (got is sub) == (extra == 0)


def test_the_default_width_multiple_is_16_for_the_hf_engine_on_a_gpu_only(model_dir: Path) -> None:
    """trainer.pass_width_multiple null: AUTO_WIDTH_MULTIPLE for the hf engine on a CUDA device, 1 on a CPU and for
    the megatron engine; a set value everywhere."""
    auto = recipe(model_dir, {"name": "grpo"}, width_multiple=None).trainer
    megatron = auto.model_copy(update={"engine": "megatron"})
    assert auto.pass_width_multiple is None and AUTO_WIDTH_MULTIPLE == 16
    assert (auto.width_multiple("cpu"), auto.width_multiple("cuda")) == (1, 16)
    assert (megatron.width_multiple("cpu"), megatron.width_multiple("cuda")) == (1, 1)
    eight = recipe(model_dir, {"name": "grpo"}, width_multiple=8).trainer
    assert (
        eight.width_multiple("cpu")
        == eight.model_copy(update={"engine": "megatron"}).width_multiple("cuda")
        == 8
    )


def test_a_token_budget_counts_the_rounded_widths() -> None:
    """With pass_width_multiple, budget_rows keeps rows x (rounded width) within the budget, so the rounding does not
    take a pass past the memory the plan bounds it by."""
    batch = spread_batch()
    for budget, multiple in ((48, 16), (64, 16), (100, 32), (48, 1)):
        groups = budget_rows(batch, budget, multiple)
        assert sorted(torch.cat(groups).tolist()) == list(range(batch.size))
        for g in groups:
            width = batch.select(g).trimmed().width_rounded(multiple).input_ids.shape[1]
            assert width % multiple == 0 and (len(g) * width <= budget or len(g) == 1), (budget, multiple, g)
    # the rounding really counted (4 passes against 3)
    assert len(budget_rows(batch, 64, 16)) > len(budget_rows(batch, 64))


def test_trimming_keeps_replayed_experts_on_their_columns() -> None:
    """rollout.routing_replay: the experts of each (row, column) travel with the column when a sub-batch is cut
    and trimmed (here each column's 'expert' is its token id, so they must still agree afterwards)."""
    full = spread_batch()
    ids = full.input_ids.to(torch.int16)
    routed = ids[:, :, None, None].expand(-1, -1, 2, 2).clone()  # [b, P+R, layers, k]
    batch = SeqBatch(full.input_ids, full.attention_mask, full.position_ids, full.response_mask,
                     full.prompt_width, routed_experts=routed)  # fmt: skip
    for rows in micro_batch_rows(batch, 4):
        sub = batch.select(rows).trimmed()
        assert sub.routed_experts is not None and sub.input_ids.shape[1] < batch.input_ids.shape[1]
        assert torch.equal(sub.routed_experts[:, :, 1, 0], sub.input_ids.to(torch.int16))


def test_rounded_sides_add_masked_columns_on_both_sides() -> None:
    """SeqBatch.sides_rounded (trainer.cuda_graphs' pass shapes): P and R each up to a multiple, masked columns left of
    the prompts (as width_rounded) and right of the responses (id 0, mask 0, the row's last position, response mask
    0); the original columns unchanged."""
    full = spread_batch()
    for rows in ([0, 3, 5], [1], [2, 6], list(range(8))):
        sub = full.select(torch.tensor(rows)).trimmed()
        for multiple in (1, 8, 16):
            got = sub.sides_rounded(multiple)
            left = got.prompt_width - sub.prompt_width
            right = got.response_width - sub.response_width
            assert got.prompt_width % multiple == 0 and got.response_width % multiple == 0
            assert 0 <= left < multiple and 0 <= right < multiple
            end = got.input_ids.shape[1] - right
            for field in ("input_ids", "attention_mask", "position_ids"):
                assert torch.equal(getattr(got, field)[:, left:end], getattr(sub, field)), field
            assert not bool(got.attention_mask[:, :left].any()) and not bool(
                got.attention_mask[:, end:].any()
            )
            assert torch.equal(got.position_ids[:, end:], sub.position_ids[:, -1:].expand(-1, right))
            assert torch.equal(got.response_mask[:, : sub.response_width], sub.response_mask)
            assert not bool(got.response_mask[:, sub.response_width :].any())
            assert (got is sub) == (left == right == 0)


def test_rounded_sides_give_the_padded_gradient(model_dir: Path) -> None:
    """The engine's training passes with both sides rounded to 16 (the layout trainer.cuda_graphs records; set here
    on a CPU without the graphs): GRPO's loss and gradient as the padded index-order layout, float32 then
    float64 (the tolerances of the test above); every pass's P and R multiples of 16; the budget counts the
    rounded sides."""
    r = recipe(model_dir, {"name": "grpo", "entropy_coef": 0.01}, max_tokens=64, width_multiple=16)
    engine = HFTrainEngine(r, model_dir)
    engine.sides = True
    perturb_lora_b(engine.trainable_state(), engine.load_trainable_state)
    batch = spread_batch()
    shapes: list[tuple[int, int, int]] = []
    stats = engine._token_stats

    def spy(model: Any, sub: SeqBatch, shared: bool) -> tuple[torch.Tensor, torch.Tensor]:
        shapes.append((sub.size, sub.prompt_width, sub.response_width))
        return stats(model, sub, shared)

    engine._token_stats = spy  # type: ignore[method-assign]  # records the passes' shapes
    sided = engine.logprobs(
        batch
    )  # the no-gradient passes in the same layout (old log-probs = the training forward's)
    assert shapes and all(p % 16 == 0 and w % 16 == 0 for _, p, w in shapes), shapes
    with padded(engine):
        engine.sides = False
        torch.testing.assert_close(sided, engine.logprobs(batch), atol=1e-5, rtol=0)
        engine.sides = True
    gen = torch.Generator().manual_seed(3)
    adv = torch.randn(batch.response_mask.shape, generator=gen) * batch.response_mask
    fn = make_loss_fn(r.algorithm, LossInputs(adv, batch.response_mask, None, None, None), norm_constant=32.0,
                      micro_scale=float(NUM_MICRO))  # fmt: skip
    for tol in (1e-5, 1e-6):
        if tol < 1e-5:
            engine.model.double()
        losses = [[0.0], [0.0]]
        with padded(engine):
            engine.sides = False
            want = engine.gradients(batch, summed(fn, losses[0]), num_micro_batches=NUM_MICRO)
            engine.sides = True
        shapes.clear()
        got = engine.gradients(batch, summed(fn, losses[1]), num_micro_batches=NUM_MICRO)
        assert losses[1][0] == pytest.approx(losses[0][0], rel=1e-6, abs=1e-6) and losses[0][0] != 0.0
        assert_grads_close(got, want, tol)
        assert shapes and all(p % 16 == 0 and w % 16 == 0 for _, p, w in shapes), shapes
        assert all(b * (p + w) <= 64 or b == 1 for b, p, w in shapes), shapes


def test_plan_counts_the_recorded_passes_memory() -> None:
    """trainer.cuda_graphs: one more pass of at most MAX_PASS_TOKENS positions (the graphs' pool) and MAX_GRAPHS sets of
    float32 gradients of the trainable parameters."""
    info = ModelInfo(
        architecture="LlamaForCausalLM", model_type="llama", hidden=576, intermediate=1536, layers=30, heads=9,
        kv_heads=3, head_dim=64, vocab=49152, max_positions=8192, tied_embeddings=True,
    )  # fmt: skip

    def memory(graphs: bool, budget: int) -> Any:
        raw = {
            "name": "t",
            "model": {"path": "x", "dtype": "bfloat16"},
            "lora": {"rank": 16, "alpha": 32, "targets": ["all-linear"]},
            "trainer": {"engine": "hf", "max_tokens_per_micro_batch": budget, "cuda_graphs": graphs},
            "rollout": {"n": 4, "max_prompt_tokens": 128, "max_response_tokens": 48},
            "reward": {"fn": "arithmetic"},
            "data": {"train": {"path": "builtin:arithmetic"}, "batch_size": 64},
            "cluster": {"device": "cuda", "gpus_per_node": 1, "gpu_memory_gib": 139},
        }
        mem = make_plan(Recipe.model_validate(raw), info).memory
        assert mem is not None
        return mem

    small, large = memory(False, 4096), memory(False, 32768)
    grads = MAX_GRAPHS * 4 * small.trainable_params / 2**30
    assert memory(True, 4096).activations == pytest.approx(2 * small.activations + grads, abs=2e-3)
    capped = memory(False, MAX_PASS_TOKENS).activations  # the pool holds a pass of at most MAX_PASS_TOKENS
    assert memory(True, 32768).activations == pytest.approx(large.activations + capped + grads, abs=2e-3)
