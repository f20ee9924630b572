"""PPO's critic on the hf engine (tiny Llama): token values at the right positions, zero on padding; the
critic's update trains the adapter and the head but nothing of the policy; its state (weights, AdamW,
step) round-trips through a checkpoint bit for bit; the plan counts it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from rlbridge.algo.objective import make_value_loss_fn
from rlbridge.batch import SeqBatch
from rlbridge.engines.hf.critic import HFCritic
from rlbridge.model.info import ModelInfo
from rlbridge.plan import make_plan
from rlbridge.recipe.schema import Recipe
from rlbridge.run.directory import resolved_yaml
from rlbridge.trainer.role import UPDATE_SECONDS, TrainerRole
from tests.fixtures.tiny_llama import build_tiny_llama

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
RESPONSES = [[11, 12], [13, 14, 15], [16], [17, 18, 19, 20]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny"))


def ppo_recipe(model_dir: Path, rank: int = 4, **algorithm: Any) -> Recipe:
    return Recipe.model_validate(
        {
            "name": "t",
            "model": {"path": str(model_dir), "dtype": "float32"},
            "lora": {"rank": rank, "targets": ["all-linear"]},
            "trainer": {"micro_batch_size": 2, "logprob_chunk_size": 3, "optim": {"lr": 1e-2}},
            "rollout": {"n": 1},
            "reward": {"fn": "arithmetic"},
            "data": {"train": {"path": "builtin:arithmetic"}, "batch_size": 4},
            "algorithm": {"name": "ppo", "critic": {"lr": 1e-2}, **algorithm},
            "run": {"steps": 6},
            "cluster": {"device": "cpu"},
        }
    )


def ragged() -> SeqBatch:
    return SeqBatch.from_token_lists(PROMPTS, RESPONSES, pad_id=256)


@pytest.mark.parametrize("rank", [4, 0])
def test_values_are_read_before_each_response_token_and_zero_on_padding(model_dir: Path, rank: int) -> None:
    critic = HFCritic(ppo_recipe(model_dir, rank=rank), model_dir)
    batch = ragged()
    values = critic.values(batch)
    assert values.shape == (4, batch.response_width) and values.dtype == torch.float32
    assert (values[batch.response_mask == 0] == 0).all()
    head = critic.module["value_head"]
    for i, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        with torch.no_grad():  # one unpadded row: V(s_t) comes from the position that predicts token t
            hidden = critic.module["backbone"](input_ids=torch.tensor([prompt + response])).last_hidden_state[
                0
            ]
            want = head(hidden[len(prompt) - 1 : len(prompt) + len(response) - 1].double().float()).squeeze(
                -1
            )
        torch.testing.assert_close(values[i, : len(response)], want, atol=1e-5, rtol=1e-5)


def test_critic_update_trains_adapter_and_head_only(model_dir: Path) -> None:
    critic = HFCritic(ppo_recipe(model_dir), model_dir)
    batch = ragged()
    names = set(critic.trainable_state())
    assert {"value_head.weight", "value_head.bias"} <= names
    assert all(".lora_" in n for n in names - {"value_head.weight", "value_head.bias"})
    frozen = {n: p.detach().clone() for n, p in critic.module.named_parameters() if not p.requires_grad}
    first = critic.values(batch)
    returns = torch.where(batch.response_mask > 0, 1.0, 0.0)
    before = critic.trainable_state()
    for _ in range(3):  # LoRA B starts at zero: A moves from the second step on
        fn = make_value_loss_fn(
            ppo_recipe(model_dir).algorithm.critic,
            critic.values(batch),
            returns,  # type: ignore[union-attr]
            batch.response_mask,
            micro_scale=2.0,
        )  # new old values each step, as in training
        m = critic.train_step(batch, fn, num_micro_batches=2)
        assert m["critic_skipped"] == 0.0 and m["critic_grad_norm"] > 0
    after = critic.trainable_state()
    assert all(not torch.equal(before[n], after[n]) for n in names)
    assert all(torch.equal(p, frozen[n]) for n, p in critic.module.named_parameters() if not p.requires_grad)
    assert float((critic.values(batch) - returns).abs()[batch.response_mask > 0].mean()) < float(
        (first - returns).abs()[batch.response_mask > 0].mean()
    )


def test_value_loss_micro_batch_shares_sum_to_the_mini_batch_loss() -> None:
    from rlbridge.algo import losses as L
    from rlbridge.recipe.schema import CriticCfg

    g = torch.Generator().manual_seed(0)
    mask = (torch.arange(6)[None, :] < torch.tensor([[1], [6], [3], [4]])).double()
    values, old, returns = (torch.randn(4, 6, generator=g, dtype=torch.float64) for _ in range(3))
    cfg = CriticCfg(value_clip=0.1, loss_coef=0.25)
    fn = make_value_loss_fn(cfg, old, returns, mask)
    total = sum(fn(values[r], r)[0] for r in torch.arange(4).tensor_split(3))
    want = 0.25 * L.value_loss(values, old, returns, mask, clip=0.1)[0]
    torch.testing.assert_close(total, want, rtol=1e-12, atol=0)


def _ppo_update(t: TrainerRole, scale: float) -> dict[str, Any]:
    batch = ragged()
    old_values = t.values(batch)
    returns = torch.where(batch.response_mask > 0, scale, 0.0)
    adv = (returns - old_values) * batch.response_mask
    m = t.update(batch, adv, t.logprobs(batch), None, old_values, returns)
    return {k: v for k, v in m.items() if k not in UPDATE_SECONDS}  # the rest must repeat exactly


def test_critic_state_round_trips_through_a_checkpoint_bit_for_bit(model_dir: Path, tmp_path: Path) -> None:
    a = TrainerRole(ppo_recipe(model_dir), str(model_dir))
    for scale in (1.0, -0.5):
        _ppo_update(a, scale)
    assert a.critic is not None
    info = a.save_checkpoint(
        str(tmp_path), 2, {"step": 2, "weight_version": 2}, resolved_yaml(a.recipe), keep=2
    )
    path = Path(info.path)
    critic_file = load_file(str(path / "critic.safetensors"))
    saved_optim = load_file(str(path / "critic_optimizer.safetensors"))
    assert set(critic_file) == set(a.critic.trainable_state())
    assert {k.rsplit(":", 1)[0] for k in saved_optim} == set(critic_file)
    state = json.loads((path / "state.json").read_text())
    assert state["trainer"]["critic_optimizer"]["scheduler"] == {"step": 2}

    b = TrainerRole(ppo_recipe(model_dir), str(model_dir))
    b.load_checkpoint(str(path))
    assert b.critic is not None
    sa, sb = a.critic.trainable_state(), b.critic.trainable_state()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    oa, ob = a.critic.optimizer_state()[0], b.critic.optimizer_state()[0]
    assert oa.keys() == ob.keys() and all(torch.equal(oa[k], ob[k]) for k in oa)
    expected = [_ppo_update(a, s) for s in (2.0, 0.7)]
    got = [_ppo_update(b, s) for s in (2.0, 0.7)]
    assert got == expected  # policy and critic losses, grad norms: exact
    assert torch.equal(a.values(ragged()), b.values(ragged()))


def test_a_checkpoint_without_a_critic_is_refused(model_dir: Path, tmp_path: Path) -> None:
    grpo = ppo_recipe(model_dir).model_copy(
        update={
            "algorithm": Recipe.model_validate(
                {
                    "name": "t",
                    "model": {"path": "x"},
                    "reward": {"fn": "arithmetic"},
                    "data": {"train": {"path": "builtin:arithmetic"}},
                }
            ).algorithm
        }
    )
    info = TrainerRole(grpo, str(model_dir)).save_checkpoint(
        str(tmp_path), 1, {"step": 1}, resolved_yaml(grpo), keep=1
    )
    # refused by the recipe comparison (the algorithm differs) before the missing critic.safetensors
    with pytest.raises(Exception, match="algorithm.name changed from"):
        TrainerRole(ppo_recipe(model_dir), str(model_dir)).load_checkpoint(info.path)


def test_plan_counts_the_critic() -> None:
    info = ModelInfo(
        architecture="LlamaForCausalLM",
        model_type="llama",
        hidden=576,
        intermediate=1536,
        layers=30,
        heads=9,
        kv_heads=3,
        head_dim=64,
        vocab=49152,
        max_positions=8192,
        tied_embeddings=True,
    )
    raw: dict[str, Any] = {
        "name": "t",
        "model": {"path": "x", "dtype": "float32"},
        "lora": {"rank": 16},
        "trainer": {"engine": "hf"},
        "rollout": {"n": 1},
        "reward": {"fn": "arithmetic"},
        "data": {"train": {"path": "builtin:arithmetic"}},
        "cluster": {"device": "cpu"},
    }
    grpo = make_plan(Recipe.model_validate({**raw, "algorithm": {"name": "reinforce_pp"}}), info).memory
    ppo = make_plan(Recipe.model_validate({**raw, "algorithm": {"name": "ppo"}}), info).memory
    full = make_plan(
        Recipe.model_validate({**raw, "lora": {"rank": 0}, "algorithm": {"name": "ppo"}}), info
    ).memory
    assert grpo is not None and ppo is not None and full is not None
    backbone_gib = info.total_params() * 4 / 1024**3  # tied: the backbone holds every weight
    assert grpo.critic == 0.0
    assert backbone_gib <= ppo.critic < 1.1 * backbone_gib  # a second frozen base + a small adapter
    assert ppo.trainer_total == pytest.approx(grpo.trainer_total + ppo.critic, abs=2e-3)
    # full fine-tuning: weights (4 B) + fp32 grads (4 B) + AdamW m, v (8 B) per parameter
    assert full.critic == pytest.approx(4 * backbone_gib, rel=1e-3)
