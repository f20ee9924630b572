"""transformers and peft: the one module of rlbridge that imports them (ruff's TID251 rule enforces it).

The hf engine and critic, the hf rollout, the model cache, random weights, the tokenizer and export-hf take these
names from here. Modules on the CLI's fast path (validate-recipe, report) import this inside the functions that
need it: importing it costs transformers' import time (~2.5 s; peft adds ~0.2 s on top).
"""

from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer
from peft.tuners.lora.layer import ParamWrapper as LoraParamWrapper
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GenerationConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.core_model_loading import revert_weight_conversion
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask, sdpa_mask
from transformers.modeling_utils import (
    ALL_ATTENTION_FUNCTIONS,
    AttentionInterface,
    remove_tied_weights_from_state_dict,
)
from transformers.utils import logging as hf_logging

__all__ = [
    "ALL_ATTENTION_FUNCTIONS",
    "AutoConfig",
    "AutoModel",
    "AutoModelForCausalLM",
    "AutoModelForSequenceClassification",
    "AttentionInterface",
    "AttentionMaskInterface",
    "AutoTokenizer",
    "DynamicCache",
    "DynamicLayer",
    "GenerationConfig",
    "LlamaForCausalLM",
    "LoraConfig",
    "LoraLayer",
    "LoraLinear",
    "LoraParamWrapper",
    "PeftModel",
    "PreTrainedModel",
    "PreTrainedTokenizerFast",
    "flash_attention_mask",
    "get_peft_model",
    "get_peft_model_state_dict",
    "hf_logging",
    "remove_tied_weights_from_state_dict",
    "revert_weight_conversion",
    "sdpa_mask",
    "set_peft_model_state_dict",
]
