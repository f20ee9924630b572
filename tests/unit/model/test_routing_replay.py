"""Routing replay (rollout.routing_replay, rlbridge/model/routing.py) on the tiny random Qwen3-MoE (2 layers, 4
experts, top-2), float32.

References: the unreplayed forward itself (replaying the routing it chose changes no logit, rel. 1e-6); a
hand-computed MoE block (softmax over the router logits, gathered at the forced experts, renormalized, summed
expert MLPs) for a forced different routing; the routing a trainer forward chooses for the same tokens, against
what the transformers rollout recorded while generating them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from rlbridge.batch import SeqBatch
from rlbridge.engines.hf.engine import HFTrainEngine
from rlbridge.engines.hf.token_stats import response_logits
from rlbridge.model.info import SHORT_NAMES
from rlbridge.model.random_weights import build_random_model
from rlbridge.model.routing import RoutingRecorder, replay_routing, routers
from rlbridge.recipe.schema import ModelCfg, Recipe, RolloutCfg
from rlbridge.rollout.base import SamplingCfg
from rlbridge.rollout.hf import HFRollout

torch.set_num_threads(2)
EXPERTS, TOP_K = 4, 2


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_model(SHORT_NAMES["tiny-qwen3-moe-smoke"], tmp_path_factory.mktemp("moe") / "m")


@pytest.fixture(scope="module")
def model(moe_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()


def batch() -> SeqBatch:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 3, 7, 4)]
    responses = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (6, 4, 2, 5)]
    return SeqBatch.from_token_lists(prompts, responses, pad_id=256)


def own_routing(model: Any, b: SeqBatch) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad(), RoutingRecorder(model) as rec:
        logits = response_logits(model, b)
    return logits, rec.take(b.size)


def forced(routing: torch.Tensor) -> torch.Tensor:
    """Every token's experts shifted by one: a different routing for every token."""
    return (routing.long() + 1) % EXPERTS


def test_replaying_the_own_routing_changes_nothing(model: Any) -> None:
    b = batch()
    logits, routing = own_routing(model, b)
    assert routing.shape == (b.size, b.input_ids.shape[1], 2, TOP_K)
    with torch.no_grad(), replay_routing(model, routing):
        replayed = response_logits(model, b)
    rel = ((replayed - logits).abs().max() / logits.abs().max()).item()
    assert rel < 1e-6, rel


def test_forced_routing_equals_a_hand_computed_moe_block(model: Any) -> None:
    b = batch()
    logits, routing = own_routing(model, b)
    want = forced(routing)
    mlp = model.model.layers[0].mlp
    seen: dict[str, Any] = {}
    with torch.no_grad(), replay_routing(model, want):  # hooks after the replay's: they see its output
        hooks = [
            mlp.register_forward_hook(lambda m, a, out: seen.update(x=a[0], out=out)),
            mlp.gate.register_forward_hook(lambda m, a, out: seen.update(indices=out[2])),
        ]
        try:
            replayed = response_logits(model, b)
        finally:
            for h in hooks:
                h.remove()
    assert torch.equal(seen["indices"].reshape(b.size, -1, TOP_K), want[:, :, 0])
    # layer 0's MoE block by hand, in float64: softmax of the router logits at the forced experts, renormalized
    x = seen["x"].reshape(-1, seen["x"].shape[-1]).double()
    probs = torch.softmax(x @ mlp.gate.weight.double().T, dim=-1)
    chosen = want[:, :, 0].reshape(-1, TOP_K)
    w = probs.gather(-1, chosen)
    w = w / w.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    gate_up, down = mlp.experts.gate_up_proj.double(), mlp.experts.down_proj.double()
    for t in range(x.shape[0]):
        for j in range(TOP_K):
            e = int(chosen[t, j])
            gate, up = F.linear(x[t], gate_up[e]).chunk(2)
            out[t] += w[t, j] * F.linear(F.silu(gate) * up, down[e])
    got = seen["out"].reshape(out.shape).double()
    assert ((got - out).abs().max() / out.abs().max()).item() < 1e-5
    assert (replayed - logits).abs().max().item() > 1e-2  # the forced routing changed the logits


def test_replayed_weights_stay_differentiable_in_the_router(model: Any) -> None:
    b = batch()
    _, routing = own_routing(model, b)
    grads = []
    for replay in (None, routing):
        model.zero_grad(set_to_none=True)
        with replay_routing(model, replay):
            response_logits(model, b).logsumexp(-1).sum().backward()
        grads.append(routers(model)[0].weight.grad.clone())
    model.zero_grad(set_to_none=True)
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)


def test_hf_rollout_records_the_routing_the_trainer_replays(moe_dir: Path, model: Any) -> None:
    cfg = RolloutCfg(engine="hf", n=2, max_prompt_tokens=16, max_response_tokens=6, routing_replay=True)
    rollout = HFRollout(moe_dir, cfg, ModelCfg(path=str(moe_dir), dtype="float32"), seed=0)
    prompts = [[5, 17, 3, 99, 42], [7, 8]]
    ro = rollout.generate(
        prompts,
        SamplingCfg(n=2, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=6),
        expect_version=0,
        seed=3,
    )
    assert len(ro.routed_experts) == 4
    b = SeqBatch.from_token_lists(ro.prompt_ids, ro.response_ids, 256, ro.routed_experts)
    _, trainer_routing = own_routing(model, b)
    for i, (p, r) in enumerate(zip(ro.prompt_ids, ro.response_ids, strict=True)):
        assert ro.routed_experts[i].shape == (len(p) + len(r), 2, TOP_K)
        cols = slice(b.prompt_width - len(p), b.prompt_width + len(r) - 1)  # the last token never ran
        rec = b.routed_experts[i, cols].long().sort(-1).values
        assert torch.equal(rec, trainer_routing[i, cols].long().sort(-1).values), i


def test_hf_engine_replays_in_logprobs(moe_dir: Path, model: Any) -> None:
    r = Recipe.model_validate(
        {
            "name": "t",
            "model": {"path": str(moe_dir), "dtype": "float32"},
            "lora": {"rank": 4, "alpha": 8.0, "targets": ["linear_qkv"]},
            "reward": {"fn": "arithmetic"},
            "data": {"train": {"path": "builtin:arithmetic"}},
        }
    )
    engine = HFTrainEngine(r, moe_dir)
    b = batch()
    plain = engine.logprobs(b)
    _, routing = own_routing(model, b)
    b.routed_experts = routing
    torch.testing.assert_close(engine.logprobs(b), plain, rtol=0, atol=1e-6)
    b.routed_experts = forced(routing)
    assert (engine.logprobs(b) - plain).abs().max() > 1e-2
    losses = []
    for routed in (routing, forced(routing)):
        b.routed_experts = routed
        grads = engine.gradients(b, _loss(b), num_micro_batches=2)
        losses.append(sum(g.abs().sum() for g in grads.values()))
    assert abs(float(losses[0] - losses[1])) > 0


def _loss(b: SeqBatch) -> Any:
    def loss_fn(logp: torch.Tensor, entropy: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, dict]:
        mask = b.response_mask[rows]
        return -(logp * mask).sum() / mask.sum(), {}

    return loss_fn


def test_rollouts_with_routing_survive_a_checkpoint_as_json() -> None:
    """An async run's checkpoint keeps in-flight rollouts in state.json (rlbridge/pipeline.py)."""
    import json

    from rlbridge.batch import Rollouts

    routed = [
        torch.randint(0, EXPERTS, (5, 2, TOP_K), dtype=torch.int16),
        torch.zeros(3, 2, TOP_K, dtype=torch.int16),
    ]
    ro = Rollouts(
        [[1, 2], [3]], [[4, 5, 6], [7, 8]], [[-1.0] * 3, [-2.0] * 2], ["stop", "length"], 2, [], routed
    )
    back = Rollouts.from_json(json.loads(json.dumps(ro.to_json())))
    assert back.response_ids == ro.response_ids and back.weight_version == 2
    assert all(
        torch.equal(a, b) and b.dtype == torch.int16 for a, b in zip(back.routed_experts, routed, strict=True)
    )
    assert Rollouts.from_json({**ro.to_json(), "routed_experts": []}).routed_experts == []
