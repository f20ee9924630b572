"""The hf engine's weights as the rollout and export-hf take them (as engines/megatron/export.py for megatron).

'merged': every weight under the HF checkpoint's own names, adapters folded into a float32 copy of each adapted
weight (the live model is never merged) and cast to model.dtype. 'adapter': exactly what peft's save_pretrained
writes, lora_A / lora_B tensors and adapter_config.json content.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from rlbridge.engines.hf import moe as hf_moe
from rlbridge.engines.hf.model import ADAPTER
from rlbridge.errors import RlbridgeError
from rlbridge.model.hf import (
    LoraLayer,
    LoraLinear,
    PeftModel,
    PreTrainedModel,
    get_peft_model_state_dict,
    remove_tied_weights_from_state_dict,
    revert_weight_conversion,
)
from rlbridge.weights import WeightExport, WeightSync
from rlbridge.weights.hf_files import host_copies, merge_lora


def _weight(module: nn.Module) -> Tensor:
    weight = module.weight
    assert isinstance(weight, Tensor)
    return weight


class HfWeights:
    """Exports of one live model: `hf_model` (peft's layers injected under LoRA) and its PeftModel, or None."""

    def __init__(self, hf_model: PreTrainedModel, peft: PeftModel | None, model_dir: Path) -> None:
        self.hf_model = hf_model
        self.peft = peft
        self.model_dir = model_dir
        self._adapter_index: list[tuple[str, nn.Parameter]] | None = None
        """The adapter export's (name, live parameter) pairs, built by its first call (adapter_tensors)."""

    def export(self, kind: WeightSync) -> WeightExport:
        """'merged': every weight under the HF model's own names (as save_pretrained writes them; a tied
        lm_head is left out), adapters folded in float32 and cast to model.dtype. Unchanged tensors share
        storage with the live model: write them out before the next train_step. 'adapter': peft's
        lora_A / lora_B tensors (copies on the host) and adapter_config.json content."""
        if kind == WeightSync.MERGED:
            return WeightExport(WeightSync.MERGED, self.merged_state())
        if kind == WeightSync.ADAPTER:
            if self.peft is None:
                raise RlbridgeError(
                    "adapter export needs LoRA (lora.rank > 0); use merged weights for full fine-tuning"
                )
            # host copies in one transfer per dtype, not one synchronizing copy per tensor (420 for SmolLM2)
            return WeightExport(
                WeightSync.ADAPTER, host_copies(self.adapter_tensors()), self.adapter_config()
            )
        raise ValueError(f"unknown export kind {kind!r} (expected 'merged' or 'adapter')")

    def adapter_tensors(self) -> dict[str, Tensor]:
        """peft's adapter state dict (get_peft_model_state_dict: names without the adapter's, detached tensors of
        the live parameters). peft walks the whole model's state_dict for it (~35 ms for SmolLM2 on a CPU, every
        weight sync), so the first call also records which parameter each name reads, and later calls read
        those (the Parameter objects stay; their data may be swapped, .detach() reads it). If a name is not a
        parameter's own tensor, peft is asked every time."""
        assert self.peft is not None
        if self._adapter_index is None:
            tensors = get_peft_model_state_dict(self.peft, adapter_name=ADAPTER)
            owner = {(p.data_ptr(), p.shape): p for p in self.peft.parameters()}
            pairs = [(name, owner.get((t.data_ptr(), t.shape))) for name, t in tensors.items()]
            self._adapter_index = (
                [(n, p) for n, p in pairs if p is not None] if all(p is not None for _, p in pairs) else []
            )
            return tensors
        if not self._adapter_index:
            return get_peft_model_state_dict(self.peft, adapter_name=ADAPTER)
        return {name: p.detach() for name, p in self._adapter_index}

    def merged_state(self, *, drop_tied: bool = True) -> dict[str, Tensor]:
        """Every weight under the HF checkpoint's names, adapters folded in (float32 merge, cast to
        model.dtype). drop_tied: leave out output embeddings the config ties to the input ones, as
        save_pretrained does; False keeps them, so that export-hf can check they still agree."""
        merged = self._merged_lora_weights() if self.peft is not None else {}
        state: dict[str, Tensor] = {}
        for key, tensor in self.hf_model.state_dict().items():
            if ".lora_" in key:  # lora_A / lora_B / lora_magnitude_vector / lora_embedding_*
                continue
            name = hf_moe.clean_param_name(key)
            state[name] = merged.get(name, tensor)
        if set(merged) - set(state):
            raise RlbridgeError(
                f"merged LoRA weights without a model weight: {sorted(set(merged) - set(state))[:3]}"
            )
        if drop_tied:
            state = remove_tied_weights_from_state_dict(state, self.hf_model)
        state = revert_weight_conversion(self.hf_model, state)
        # stacked MoE experts come back as per-expert views of one tensor: safetensors refuses shared storage
        return {k: v.clone() if v._base is not None else v for k, v in state.items()}

    def _merged_lora_weights(self) -> dict[str, Tensor]:
        out: dict[str, Tensor] = hf_moe.merged_expert_weights(self.hf_model, ADAPTER)
        for name, module in self.hf_model.named_modules():
            if not isinstance(module, LoraLayer) or ADAPTER not in module.lora_A:
                continue
            if isinstance(module, hf_moe.LoraParamWrapper):  # stacked expert weights, merged above
                continue
            base = module.get_base_layer()
            if not isinstance(module, LoraLinear) or not isinstance(base, nn.Linear) or module.fan_in_fan_out:
                raise RlbridgeError(
                    f"merged export supports LoRA on nn.Linear layers only; {name} is {type(base).__name__}"
                )
            dora = module.use_dora[ADAPTER]
            out[f"{name}.weight"] = merge_lora(
                base.weight,
                _weight(module.lora_A[ADAPTER]),
                _weight(module.lora_B[ADAPTER]),
                module.scaling[ADAPTER],
                _weight(module.lora_magnitude_vector[ADAPTER]) if dora else None,
            )
        return out

    def adapter_config(self) -> dict[str, Any]:
        """adapter_config.json as peft's save_pretrained writes it (inference_mode true, sets as lists)."""
        assert self.peft is not None
        config = copy.deepcopy(self.peft.peft_config[ADAPTER])
        config.inference_mode = True
        config.base_model_name_or_path = str(self.model_dir)
        raw = {k: sorted(v) if isinstance(v, set) else v for k, v in config.to_dict().items()}
        return dict(json.loads(json.dumps(raw)))
