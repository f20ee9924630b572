"""The hf engine on the tiny random Qwen3-MoE (`tiny-qwen3-moe-smoke`: 2 layers, 4 routed experts, top-2), float32,
LoRA on attention and on the stacked expert weights (rlbridge/engines/hf/moe.py, docs/moe.md).

References: a float64 transformers forward (log-probs, atol 1e-5), transformers' `from_pretrained` of the merged
export and peft's `PeftModel.from_pretrained` of the adapter export (logits vs the trainer's, rel. error < 1e-5).
One engine is trained for two steps and shared by the assertions (module fixture).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rlbridge.batch import SeqBatch
from rlbridge.engines.hf.engine import HFTrainEngine
from rlbridge.engines.hf.token_stats import response_logits
from rlbridge.engines.micro import micro_batch_rows
from rlbridge.engines.moe import RoutedTokens, expert_report
from rlbridge.model.info import SHORT_NAMES
from rlbridge.model.random_weights import build_random_model
from rlbridge.recipe.schema import Recipe
from rlbridge.weights.hf_files import save_hf

torch.set_num_threads(2)
LAYERS, EXPERTS = 2, 4


def batch() -> SeqBatch:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 3, 7, 4)]
    responses = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (6, 4, 2, 5)]
    return SeqBatch.from_token_lists(prompts, responses, pad_id=256)


def logp_loss(b: SeqBatch) -> Any:
    def loss_fn(logp: torch.Tensor, entropy: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, dict]:
        mask = b.response_mask[rows]
        return -(logp * mask).sum() / mask.sum(), {}

    return loss_fn


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_model(SHORT_NAMES["tiny-qwen3-moe-smoke"], tmp_path_factory.mktemp("moe") / "m")


def recipe(model_dir: Path, targets: list[str]) -> Recipe:
    return Recipe.model_validate(
        {
            "name": "t",
            "model": {"path": str(model_dir), "dtype": "float32"},
            "lora": {"rank": 4, "alpha": 8.0, "targets": targets},
            "reward": {"fn": "arithmetic"},
            "data": {"train": {"path": "builtin:arithmetic"}},
            "trainer": {"optim": {"lr": 1e-2, "clip_grad": None}},
        }
    )


def two_steps(engine: HFTrainEngine, b: SeqBatch) -> dict[str, Any]:
    assert engine.moe is not None
    before = engine.trainable_state()
    frozen = engine.frozen_fingerprint()
    engine.moe.routed_tokens()
    engine.logprobs(b)  # no gradients: not counted
    steps = [engine.train_step(b, logp_loss(b), num_micro_batches=2) for _ in range(2)]
    after = engine.trainable_state()
    routed = engine.moe.routed_tokens()
    report = expert_report(engine.moe.expert_views(before), engine.moe.expert_views(after), routed)
    return {
        "steps": steps,
        "before": before,
        "after": after,
        "routed": routed,
        "report": report,
        "frozen": frozen,
    }


@pytest.fixture(scope="module")
def trained(moe_dir: Path) -> dict[str, Any]:
    engine = HFTrainEngine(
        recipe(moe_dir, ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]), moe_dir
    )
    b = batch()
    res: dict[str, Any] = {"engine": engine, "batch": b, "logp_init": engine.logprobs(b)}
    res.update(two_steps(engine, b))
    with torch.no_grad():
        engine.model.eval()
        res["logits"] = response_logits(engine.model, b)
    return res


def reference_logp(model_dir: Path, b: SeqBatch) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    # float64: the eager expert loop (torch._grouped_mm, the default, has no float64 kernel)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float64, experts_implementation="eager"
    )
    model.eval()
    out = torch.zeros(b.size, b.response_width, dtype=torch.float64)
    with torch.no_grad():
        for i in range(b.size):
            p = int(b.attention_mask[i, : b.prompt_width].sum())
            r = int(b.response_mask[i].sum())
            ids = torch.cat([b.input_ids[i, b.prompt_width - p : b.prompt_width], b.response_ids[i, :r]])
            logp = torch.log_softmax(model(ids[None]).logits[0], -1)
            out[i, :r] = logp[p - 1 : p + r - 1].gather(-1, ids[p:, None])[:, 0]
    return out


def test_logprobs_match_float64_transformers(trained: dict[str, Any], moe_dir: Path) -> None:
    ref = reference_logp(moe_dir, trained["batch"])
    assert float((trained["logp_init"].double() - ref).abs().max()) < 1e-5


def test_lora_on_attention_and_on_every_expert(trained: dict[str, Any]) -> None:
    names = list(trained["before"])
    for layer in range(LAYERS):
        experts = [n for n in names if f"layers.{layer}.mlp.experts." in n]
        assert len(experts) == 4, (
            experts
        )  # (A, B) for gate_up_proj and for down_proj, packed over the experts
        assert sum(f"layers.{layer}.self_attn." in n for n in names) == 8
    assert not any("mlp.gate" in n for n in names)  # the router is not adapted


def test_every_routed_expert_trains_and_the_router_stays_frozen(trained: dict[str, Any]) -> None:
    assert all(s["skipped"] == 0.0 and s["grad_norm"] > 0 for s in trained["steps"])
    routed = trained["routed"]
    # 2 steps x 2 layers x top-2 x the real tokens: padding goes through the router too (the micro-batches' own
    # widths, engines/micro.py) but is not counted; the log-prob forward is not counted either
    batch = trained["batch"]
    positions = sum(batch.select(rows).trimmed().input_ids.numel() for rows in micro_batch_rows(batch, 2))
    assert int(batch.attention_mask.sum()) < positions  # the trimmed micro-batches still hold some padding
    assert sum(routed.values()) == 2 * LAYERS * 2 * int(batch.attention_mask.sum()), routed
    report = trained["report"]
    assert report.dead == [] and report.unrouted == []
    assert report.trained == [(layer, e) for layer in range(LAYERS) for e in range(EXPERTS)]
    engine = trained["engine"]
    frozen_now = engine.frozen_fingerprint()
    assert [n for n, v in trained["frozen"].items() if frozen_now[n] != v] == []
    assert sum(".mlp.gate." in n for n in frozen_now) == LAYERS


def test_merged_export_holds_every_expert_delta(
    trained: dict[str, Any], moe_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    export = trained["engine"].export_weights("merged")
    expert_names = [k for k in export.tensors if ".mlp.experts." in k]
    assert len(expert_names) == LAYERS * EXPERTS * 3  # per-expert checkpoint names (what vLLM loads)
    out = save_hf(tmp_path / "merged", export, base_dir=moe_dir)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        got = response_logits(model, trained["batch"])
    ref = trained["logits"]
    assert float((got - ref).norm() / ref.norm()) < 1e-5
    base = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        untrained = response_logits(base, trained["batch"])
    assert float((untrained - ref).norm() / ref.norm()) > 1e-3  # the deltas are there


def test_adapter_export_loads_in_peft(trained: dict[str, Any], moe_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    export = trained["engine"].export_weights("adapter")
    assert export.adapter_config is not None
    assert {"mlp.experts.down_proj", "mlp.experts.gate_up_proj"} <= set(
        export.adapter_config["target_parameters"]
    )
    out = save_hf(tmp_path / "adapter", export)
    base = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(out)).eval()
    with torch.no_grad():
        got = response_logits(model, trained["batch"])
    ref = trained["logits"]
    assert float((got - ref).norm() / ref.norm()) < 1e-5


def test_a_dead_expert_is_named_and_unrouted_experts_are_excused(moe_dir: Path) -> None:
    """Negative control: layer 1 expert 2's rows of the packed gate_up A get their gradient zeroed (an adapter
    detached from autograd, as in Megatron-Bridge #5635); the report names exactly that expert."""
    engine = HFTrainEngine(recipe(moe_dir, ["linear_fc1"]), moe_dir)
    name = next(n for n, _ in engine._trainable if "layers.1.mlp.experts." in n and ".lora_A." in n)
    param = dict(engine._trainable)[name]
    rows = param.shape[0] // EXPERTS

    def cut(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad[2 * rows : 3 * rows] = 0
        return grad

    param.register_hook(cut)
    res = two_steps(engine, batch())
    assert res["report"].dead == [(1, 2)]
    assert res["report"].describe(res["report"].dead) == "layer 1 expert 2"
    # an expert no token reached has no gradient to show: reported, not failed
    routed = {k: (0 if k == (0, 3) else v) for k, v in res["routed"].items()}
    report = expert_report(
        engine.moe.expert_views(res["before"]), engine.moe.expert_views(res["after"]), routed
    )  # type: ignore[union-attr]
    assert report.unrouted == [(0, 3)]


def moe_role(model_dir: Path) -> Any:
    from rlbridge.trainer.role import TrainerRole

    r = Recipe.model_validate(
        {
            "name": "t",
            "model": {"path": str(model_dir), "dtype": "float32"},
            "lora": {"rank": 4, "targets": ["linear_fc1", "linear_fc2"]},
            "trainer": {"micro_batch_size": 2, "optim": {"lr": 1e-2}},
            "rollout": {"n": 2},
            "reward": {"fn": "arithmetic"},
            "data": {"train": {"path": "builtin:arithmetic"}, "batch_size": 2},
            "cluster": {"device": "cpu"},
        }
    )
    return TrainerRole(r, str(model_dir))


def role_batch() -> tuple[SeqBatch, torch.Tensor]:
    b = batch()
    adv = torch.tensor([[1.0], [-1.0], [0.5], [-0.5]]).expand(4, b.response_width) * b.response_mask
    return b, adv


def test_first_step_gate_passes_per_expert(moe_dir: Path) -> None:
    t = moe_role(moe_dir)
    b, adv = role_batch()
    for _ in range(2):
        t.update(b, adv, t.logprobs(b), None)
    assert t.gate.done
    assert len(t.gate.routed) == LAYERS * EXPERTS and all(v > 0 for v in t.gate.routed.values())


def test_first_step_gate_names_a_dead_expert(moe_dir: Path) -> None:
    from rlbridge.trainer.gate import HealthError

    t = moe_role(moe_dir)
    name, param = next(
        (n, p) for n, p in t.engine._trainable if "layers.0.mlp.experts." in n and ".lora_B." in n
    )
    # a packed B [out, r' x experts]: expert 3's columns get no gradient
    param.register_hook(lambda g: g * (torch.arange(g.shape[1]) % EXPERTS != 3).to(g.dtype))
    b, adv = role_batch()
    t.update(b, adv, t.logprobs(b), None)
    with pytest.raises(HealthError, match="layer 0 expert 3"):
        t.update(b, adv, t.logprobs(b), None)


def test_routed_tokens_count_the_masked_positions_only() -> None:
    counter = RoutedTokens()
    indices = torch.tensor([[0, 1], [1, 2], [3, 3], [0, 2]])  # 4 positions, top-2
    real = torch.tensor([True, False, True, True])
    with torch.enable_grad():
        counter.add(0, indices, EXPERTS, real)
        counter.add(0, indices, EXPERTS)  # no mask: every position
        counter.add(1, torch.nn.functional.one_hot(indices, EXPERTS).sum(1).bool(), EXPERTS, real)
        counter.add(1, torch.tensor([[0, 9]]), EXPERTS)  # an index outside the experts counts for none
    assert counter.take() == {
        (0, 0): 2 + 2, (0, 1): 1 + 2, (0, 2): 1 + 2, (0, 3): 2 + 2,
        (1, 0): 2 + 1, (1, 1): 1, (1, 2): 1, (1, 3): 1,
    }  # fmt: skip
    assert counter.take() == {}


def test_packed_passes_match_the_padded_ones_and_count_the_same_routed_tokens(moe_dir: Path) -> None:
    """Packed passes (engines/hf/varlen.py) on the MoE: log-probs and gradients as the padded passes' (measured
    3.3e-6 and 1.1e-6 relative,
    to B's gradients; A's are 0 before B moves), and the router hooks count each real token once per layer and chosen expert in
    both layouts (the padded forward's padding positions are routed too, and not counted)."""
    b = batch()
    out = {}
    for packed in (False, True):
        r = recipe(moe_dir, ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
        r = r.model_copy(update={"trainer": r.trainer.model_copy(update={"packed_passes": packed})})
        engine = HFTrainEngine(r, moe_dir)
        assert engine.moe is not None and engine.packed == packed
        logp = engine.logprobs(b)
        engine.moe.routed_tokens()
        grads = engine.gradients(b, logp_loss(b), num_micro_batches=1)
        out[packed] = logp, grads, engine.moe.routed_tokens()
    (logp0, g0, routed0), (logp1, g1, routed1) = out[False], out[True]
    assert float((logp0 - logp1).abs().max()) < 2e-5
    for name, grad in g0.items():
        assert float((grad - g1[name]).norm()) <= 2e-5 * float(grad.norm()), name  # LoRA A's are 0 at step 0
    assert routed0 == routed1
    top_k = 2
    assert sum(routed1.values()) == int(b.attention_mask.sum()) * LAYERS * top_k
