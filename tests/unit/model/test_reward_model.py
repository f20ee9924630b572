"""A reward model as a reward term: a tiny random sequence-classification Llama built in the test scores prompt +
completion in right-padded batches exactly as one unpadded text at a time does, with TRL's text (a conversation
through the chat template); validation refuses a model without a classification head."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlbridge.data.reward_pool import _batch_fn
from rlbridge.model.reward_model import RewardModel, model_problem
from rlbridge.recipe.schema import RewardCfg, RewardTerm
from tests.fixtures.tiny_models import _common, build_tiny_llama_tied
from tests.fixtures.tiny_tokenizer import build_tiny_tokenizer


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForSequenceClassification

    out = tmp_path_factory.mktemp("rm")
    tokenizer = build_tiny_tokenizer()
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(LlamaConfig(**_common(tokenizer), num_labels=1))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_scores_match_one_text_at_a_time(reward_dir: Path) -> None:
    rm = _batch_fn(f"model:{reward_dir}")  # what a reward worker builds for the term
    assert isinstance(rm, RewardModel)
    rm.batch_size = 2
    conversation = [{"role": "user", "content": "What is 1 + 1 ?"}]
    prompts = ["What is 2 + 2 ?", "What is", conversation]
    completions = [" 4", " 5 + 5 is 10 and 3", [{"role": "assistant", "content": "2"}]]
    got = rm(prompts=prompts, completions=completions, completion_ids=[[], [], []], solution=["4", "10", "2"])
    texts = rm.texts(prompts, completions)
    assert texts[0] == "What is 2 + 2 ? 4" and texts[2] == rm.tokenizer.apply_chat_template(
        [*conversation, {"role": "assistant", "content": "2"}], tokenize=False
    )
    with torch.inference_mode():
        want = [
            float(rm.model(**rm.tokenizer(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0])
            for t in texts
        ]
    assert got == pytest.approx(want, abs=1e-5) and len(set(got)) == 3


def test_validation_wants_a_classification_head(reward_dir: Path, tmp_path: Path) -> None:
    assert model_problem(str(reward_dir)) is None
    causal = build_tiny_llama_tied(tmp_path / "lm")
    assert "not a sequence-classification model (architectures: LlamaForCausalLM)" in str(
        model_problem(str(causal))
    )
    assert "config.json" in str(model_problem(str(tmp_path / "nowhere")))
    cfg = RewardCfg.model_validate(
        {"terms": [{"fn": "arithmetic"}, {"model": str(reward_dir), "weight": 0.1}]}
    )
    assert [t.name for t in cfg.resolved_terms()] == ["arithmetic", f"model:{reward_dir}"]
    with pytest.raises(ValueError, match="either fn .* or model"):
        RewardTerm(fn="arithmetic", model="x")
