"""rlbridge.model.random_weights: a random model that keeps its config's vocabulary (full-size short names such as
qwen2.5-7b-random) gets a byte tokenizer padded to that vocabulary, so that every id the model can sample
decodes; the plain build keeps the 260-id byte vocabulary."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlbridge.model.info import FULL_SIZE_SHORT_NAMES, SHORT_NAMES, ModelInfo
from rlbridge.model.random_weights import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, build_random_model

WIDE = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 70_000,  # past 256**2 + 260: the fillers reach three bytes
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1e6,
}


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_model(WIDE, tmp_path_factory.mktemp("wide") / "m", keep_vocab=True)


def test_kept_vocabulary_decodes_every_id(wide_model: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(wide_model)
    model = AutoModelForCausalLM.from_pretrained(wide_model)
    assert model.config.vocab_size == WIDE["vocab_size"] and model.dtype == torch.bfloat16
    assert model.get_output_embeddings().weight.shape[0] == WIDE["vocab_size"]
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    vocab = tok.get_vocab()
    ids = sorted(i for i in vocab.values() if i < WIDE["vocab_size"])
    assert ids == list(range(WIDE["vocab_size"]))  # no hole: every sampleable id has a token
    # the fillers are distinct 2- and 3-byte tokens that decode to their bytes; text still encodes byte by byte
    assert len(tok.decode([VOCAB_SIZE]).encode("latin-1", "replace")) >= 1
    assert tok.convert_ids_to_tokens(WIDE["vocab_size"] - 1) != tok.convert_ids_to_tokens(VOCAB_SIZE)
    assert tok.encode("hi", add_special_tokens=False) == [ord("h"), ord("i")]


def test_plain_build_keeps_the_byte_vocabulary(tmp_path: Path) -> None:
    from transformers import AutoConfig

    build_random_model(WIDE, tmp_path / "m")
    assert AutoConfig.from_pretrained(tmp_path / "m").vocab_size == VOCAB_SIZE


def test_qwen7b_short_name_is_the_published_architecture() -> None:
    cfg = SHORT_NAMES["qwen2.5-7b-random"]
    assert "qwen2.5-7b-random" in FULL_SIZE_SHORT_NAMES
    published = (
        Path(__file__).resolve().parents[2] / "fixtures" / "configs" / "qwen2.5-7b-instruct" / "config.json"
    )
    import json

    ref = json.loads(published.read_text())
    assert {k: cfg[k] for k in ref if k != "torch_dtype"} == {
        k: v for k, v in ref.items() if k != "torch_dtype"
    }
    info = ModelInfo.from_config(cfg)
    assert 7.0e9 < info.total_params() < 8.0e9
