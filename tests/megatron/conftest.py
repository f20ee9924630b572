"""Fixtures for the megatron engine tests: tiny random HF checkpoints and a multi-rank gloo runner.

Everything that imports megatron runs in a launcher subprocess (tests/megatron/launcher.py), so the
pytest process never activates the megatron compatibility layer, and N ranks share one ~10 s import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _save_tiny(path: Path, arch: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,
    )
    torch.manual_seed(0)
    if arch == "qwen2":  # untied, q/k/v biases
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=False, **common))
        with torch.no_grad():
            for layer in model.model.layers:  # random biases (HF initializes them to 0)
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
    else:  # llama, tied embeddings
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, **common))
    model.save_pretrained(path)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("megatron_models")
    out = {}
    for arch in ("qwen2", "llama"):
        path = base / arch
        _save_tiny(path, arch)
        out[arch] = str(path)
    return out


def _run_workers(fn: str, world: int, *, timeout: float = 120.0, **kwargs: Any) -> list[Any]:
    """Run megatron_workers.<fn>(**kwargs) on `world` gloo ranks; returns each rank's result."""
    import tempfile

    out_dir = tempfile.mkdtemp(prefix=f"mt_{fn}_")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    start = time.time()
    proc = subprocess.run(
        [sys.executable, str(HERE / "launcher.py"), fn, str(world), out_dir, json.dumps(kwargs)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    elapsed = time.time() - start
    if proc.returncode != 0:
        pytest.fail(
            f"{fn} on {world} ranks failed after {elapsed:.1f}s:\n{(proc.stdout + proc.stderr)[-6000:]}"
        )
    results = [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=True) for r in range(world)]
    print(f"{fn} on {world} ranks: {elapsed:.1f}s")
    return results


@pytest.fixture(scope="session")
def run_workers() -> Any:
    """The multi-rank runner: run_workers(fn, world, timeout=..., **kwargs) -> [rank results]."""
    return _run_workers


@pytest.fixture(scope="session")
def tp1(tiny_dirs: dict[str, str], run_workers: Any) -> dict[str, Any]:
    """The TP1/PP1 LoRA run (megatron_workers.tp1_lora_suite): also the baseline of the layout tests."""
    return run_workers("tp1_lora_suite", 1, qwen=tiny_dirs["qwen2"])[0]
