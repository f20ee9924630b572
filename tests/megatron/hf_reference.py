"""Independent HF-side references for the megatron engine tests (pytest process; no megatron import)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from rlbridge.batch import SeqBatch


def seq_batch(d: dict[str, Any]) -> SeqBatch:
    return SeqBatch(
        d["input_ids"], d["attention_mask"], d["position_ids"], d["response_mask"], d["prompt_width"]
    )


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def load_hf(
    model_dir: str, dtype: torch.dtype = torch.float32, state: dict[str, torch.Tensor] | None = None
) -> Any:
    """The HF model from model_dir; with `state`, a fresh model of that config loading exactly `state`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if state is None:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype)
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    tied = bool(model.config.tie_word_embeddings)
    assert not unexpected, f"unexpected keys {unexpected}"
    assert set(missing) <= ({"lm_head.weight"} if tied else set()), f"missing keys {missing}"
    if tied:
        model.tie_weights()
    return model.eval()


def load_hf_files(model_dir: str, state: dict[str, torch.Tensor], tmp: Path) -> Any:
    """A checkpoint directory of `state` (model_dir's config) loaded by `from_pretrained`: the way an exported
    HF directory is read, including transformers' on-load conversions (per-expert MoE tensors -> 3D stacks)."""
    import shutil

    tmp.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(model_dir) / "config.json", tmp / "config.json")
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"))
    return load_hf(str(tmp))


@torch.no_grad()
def logits(model: Any, batch: SeqBatch) -> torch.Tensor:
    return model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
    ).logits


@torch.no_grad()
def response_logprobs_f64(model: Any, batch: SeqBatch) -> torch.Tensor:
    """[b, R] float64 log-probs of the response tokens (0 on padding), with positions from the SeqBatch."""
    model = model.double()
    out = logits(model, batch).double()
    p, r = batch.prompt_width, batch.response_width
    logp = torch.log_softmax(out[:, p - 1 : p + r - 1], dim=-1)
    picked = logp.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    return torch.where(batch.response_mask > 0, picked, torch.zeros((), dtype=torch.float64))


def peft_model(model_dir: str, adapter: dict[str, torch.Tensor], config: dict[str, Any], tmp: Path) -> Any:
    """Base model + the exported adapter written as a PEFT directory and loaded by peft itself."""
    from peft import PeftModel

    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "adapter_config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in adapter.items()}, str(tmp / "adapter_model.safetensors"))
    base = load_hf(model_dir)
    return PeftModel.from_pretrained(base, str(tmp)).eval()


@torch.no_grad()
def response_entropy_f64(model: Any, batch: SeqBatch) -> torch.Tensor:
    """[b, R] float64 entropies of the next-token distributions that score the response (0 on padding)."""
    model = model.double()
    out = logits(model, batch).double()
    p, r = batch.prompt_width, batch.response_width
    logp = torch.log_softmax(out[:, p - 1 : p + r - 1], dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return torch.where(batch.response_mask > 0, entropy, torch.zeros((), dtype=torch.float64))
