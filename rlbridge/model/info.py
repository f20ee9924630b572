"""What the checks and the plan need to know about a model, read from its config.json alone.

No weights, no transformers import: a recipe for a 235B model validates on a laptop. Short model names (e.g.
`smollm2-135m-instruct`) resolve to a directory in rlbridge's cache; their config is known here, so they
validate before they are materialized. A Hub id's config.json comes from the Hugging Face cache, or alone
from the Hub when it is online (hub.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlbridge.errors import RlbridgeError
from rlbridge.model.hub import is_hub_id

# Short names -> the config.json of the model rlbridge materializes for them (see cache.py).
_TINY_QWEN3: dict[str, Any] = {
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 260,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "initializer_range": 0.1,
}
"""What the tiny Qwen3-MoE and its dense counterpart share: attention, layers, vocabulary, norms, init."""

SHORT_NAMES: dict[str, dict[str, Any]] = {
    "smollm2-135m-instruct": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-05,
        "rope_theta": 100000.0,
    },
    # Gemma 3 270M (google/gemma-3-270m, the pretrained model) dequantized from a Q4_K_M GGUF (cache.py): a second
    # real family. Five of every six layers attend within a sliding window of 512 tokens, queries are scaled by
    # query_pre_attn_scalar**-0.5, q/k are RMS-normed, the embedding (262,144 tokens, tied) is scaled by
    # sqrt(hidden); no soft-capping. Its checks: recipe/checks/model.py (check_model_family).
    "gemma3-270m": {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": 640,
        "intermediate_size": 2048,
        "num_hidden_layers": 18,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "vocab_size": 262144,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-06,
        "sliding_window": 512,
        "layer_types": ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(18)],
        "query_pre_attn_scalar": 256,
    },
    # A random tiny Qwen2 (q/k/v biases, untied) with a byte-level tokenizer (random_weights.py), built in a few
    # seconds: the model of recipes/smoke-megatron-cpu.yaml. Heads and layers split at tensor 2 x pipeline
    # 2; head_dim 32 is the smallest vLLM's CPU attention takes.
    "tiny-qwen2-smoke": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 260,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "initializer_range": 0.1,
    },
    # A random tiny Qwen3-MoE (4 routed experts, top-2, q/k norms, untied) with the byte tokenizer: the model of
    # recipes/moe-lora-cpu.yaml and of the MoE + LoRA tests (docs/moe.md). head_dim 32 for vLLM's CPU attention.
    "tiny-qwen3-moe-smoke": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        **_TINY_QWEN3,
    },
    # Its dense counterpart: the same attention, layers and vocabulary, and a dense MLP as wide as the two experts
    # a token is routed to (the same active parameters per token), to compare the MoE's train/rollout gap against.
    "tiny-qwen3-dense-smoke": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 128,
        "intermediate_size": 128,
        **_TINY_QWEN3,
    },
    # Qwen2.5-7B-Instruct's published architecture and sizes (its config.json: 28 layers, hidden 3584, 28 heads /
    # 4 KV heads, vocabulary 152064, untied) with random bf16 weights and a byte tokenizer padded to the full
    # vocabulary: a model of the real size for runs that prove memory, speed and checkpoints at 7B without a hub.
    "qwen2.5-7b-random": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "initializer_range": 0.02,
    },
    # Qwen3-30B-A3B's published architecture (its config.json: 48 layers, hidden 2048, 32 heads / 4 KV heads of
    # 128, 128 routed experts of width 768, top-8, vocabulary 151936, untied) with random bf16 weights: the MoE of
    # recipes/qwen3-30b-a3b-moe-lora.yaml at its real size (61 GB of safetensors once materialized).
    "qwen3-30b-a3b-random": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "initializer_range": 0.02,
    },
}
RANDOM_SHORT_NAMES = frozenset(
    {
        "tiny-qwen2-smoke",
        "tiny-qwen3-moe-smoke",
        "tiny-qwen3-dense-smoke",
        "qwen2.5-7b-random",
        "qwen3-30b-a3b-random",
    }
)
"""Short names whose weights are random (built by rlbridge.model.random_weights), not a real model's."""
FULL_SIZE_SHORT_NAMES = frozenset({"qwen2.5-7b-random", "qwen3-30b-a3b-random"})
"""Random short names of a real model's full size: vocabulary kept (the byte tokenizer padded to it), bf16."""


def cache_dir() -> Path:
    """Where rlbridge keeps materialized models (RLBRIDGE_CACHE, else ~/.cache/rlbridge)."""
    return Path(os.environ.get("RLBRIDGE_CACHE", Path.home() / ".cache" / "rlbridge"))


def resolve_model_path(path: str, revision: str | None = None) -> Path:
    """The directory of a recipe's `model.path`, the one resolver of validation, plan, train and the workers:
    a short name maps to its cache directory (materialized by cache.ensure_model); a path that exists is that
    path; a Hub id (`org/name`, at `revision`) is its snapshot in the Hugging Face cache (hub.py; an
    RlbridgeError naming the fetch command when it is not there); anything else is the local path, which the
    caller finds missing."""
    if path in SHORT_NAMES:
        return cache_dir() / "models" / path
    local = Path(path).expanduser()
    if local.exists() or not is_hub_id(path):
        return local
    from rlbridge.model.hub import cached_snapshot

    return cached_snapshot(path, revision)


@dataclass(frozen=True)
class ModelInfo:
    architecture: str
    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_positions: int
    tied_embeddings: bool
    num_experts: int = 0
    """Routed experts per MoE layer (0 for a dense model)."""
    moe_intermediate: int = 0
    shared_expert_intermediate: int = 0
    experts_per_token: int = 0
    """Routed experts each token goes through (top-k; 0 for a dense model)."""
    dense_layers: int = 0
    """Layers of an MoE model whose MLP is dense (`intermediate` wide): DeepSeek's / GLM's first_k_dense_replace,
    Qwen-MoE's mlp_only_layers and decoder_sparse_step, moe_layer_freq; the others are MoE layers."""
    sliding_window_layers: int = 0
    """Layers whose attention only reaches a sliding window of earlier tokens (`sliding_window_layers`)."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.is_moe else 0

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> ModelInfo:
        text = cfg.get("text_config")
        if isinstance(text, dict):  # multimodal wrappers keep the LM config inside
            cfg = {**cfg, **text}
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            layers = int(cfg["num_hidden_layers"])
            vocab = int(cfg["vocab_size"])
        except (KeyError, TypeError, ValueError) as e:
            raise RlbridgeError(f"config.json lacks a usable {e} field") from None
        experts = int(
            cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0
        )
        archs = cfg.get("architectures") or ["?"]
        return cls(
            architecture=str(archs[0]),
            model_type=str(cfg.get("model_type", "?")),
            hidden=hidden,
            intermediate=int(cfg.get("intermediate_size") or 4 * hidden),
            layers=layers,
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            vocab=vocab,
            max_positions=int(cfg.get("max_position_embeddings") or 2048),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            num_experts=experts,
            moe_intermediate=int(cfg.get("moe_intermediate_size") or 0) if experts else 0,
            shared_expert_intermediate=int(cfg.get("shared_expert_intermediate_size") or 0) if experts else 0,
            experts_per_token=int(cfg.get("num_experts_per_tok") or cfg.get("moe_topk") or 1)
            if experts
            else 0,
            dense_layers=dense_layer_count(cfg, layers) if experts else 0,
            sliding_window_layers=sliding_window_layers(cfg, layers),
        )

    # ---- parameter counts (biases and norms included roughly; they are small)
    def attention_params(self) -> int:
        q = self.heads * self.head_dim
        kv = 2 * self.kv_heads * self.head_dim
        return self.hidden * (q + kv) + q * self.hidden

    def mlp_width_per_token(self) -> float:
        """The MLP width one token's activations span, averaged over the layers: `intermediate` on a dense
        layer; top-k routed experts plus the shared expert on an MoE layer."""
        if not self.is_moe:
            return float(self.intermediate)
        moe = self.experts_per_token * self.moe_intermediate + self.shared_expert_intermediate
        return (self.moe_layers * moe + self.dense_layers * self.intermediate) / self.layers

    def dense_mlp_params(self) -> int:
        return 3 * self.hidden * self.intermediate

    def mlp_params(self) -> int:
        """One layer's MLP: the dense one, or an MoE layer's (routed + shared experts + router)."""
        if not self.is_moe:
            return self.dense_mlp_params()
        routed = self.num_experts * 3 * self.hidden * self.moe_intermediate
        return routed + 3 * self.hidden * self.shared_expert_intermediate + self.hidden * self.num_experts

    def layer_params(self) -> int:
        return self.attention_params() + self.mlp_params() + 2 * self.hidden

    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    def total_params(self) -> int:
        dense_gap = self.dense_layers * (self.mlp_params() - self.dense_mlp_params())
        return self.layers * self.layer_params() - dense_gap + self.embedding_params() + self.hidden


def sliding_window_layers(cfg: dict[str, Any], layers: int) -> int:
    """How many layers of a config attend within a sliding window, by the keys transformers' models read:
    `layer_types`' "sliding_attention" entries (Gemma 2/3 and configs written by transformers 5); else
    `sliding_window_pattern` (every layer but each pattern-th: older Gemma 3 configs); else, where a model has the
    `use_sliding_window` switch (Qwen2/3), the layers from `max_window_layers` on when it is on; else every layer
    when `sliding_window` is set (Mistral, Phi-3)."""
    types = cfg.get("layer_types")
    if isinstance(types, list) and types:
        return sum(t == "sliding_attention" for t in types)
    if not cfg.get("sliding_window"):
        return 0
    pattern = cfg.get("sliding_window_pattern")
    if isinstance(pattern, int) and pattern > 0:
        return layers - layers // pattern
    if "use_sliding_window" in cfg:
        return max(0, layers - int(cfg.get("max_window_layers") or 0)) if cfg["use_sliding_window"] else 0
    return layers


def dense_layer_count(cfg: dict[str, Any], layers: int) -> int:
    """How many layers of an MoE config have a dense MLP, by the keys transformers' MoE models read (0: every
    layer is MoE, as in Mixtral and the Qwen3-MoE releases)."""
    only = {int(i) for i in cfg.get("mlp_only_layers") or []}
    step = int(cfg.get("decoder_sparse_step") or 1)  # Qwen2/3-MoE: layer i is MoE when (i + 1) % step == 0
    first_k = int(
        cfg.get("first_k_dense_replace") or 0
    )  # DeepSeek V2/V3, GLM-4.5, Kimi: the first k are dense
    freq = cfg.get("moe_layer_freq")
    freq = int(freq) if isinstance(freq, int) and freq > 0 else 1  # DeepSeek: MoE where i % freq == 0

    def moe(i: int) -> bool:
        return i not in only and (i + 1) % step == 0 and i >= first_k and i % freq == 0

    return sum(1 for i in range(layers) if not moe(i))


def config_file(path: str, revision: str | None = None, *, download: bool = False) -> Path:
    """The config.json of a local directory, or of a Hub id (from the cache; with download=True, fetched alone
    when the Hub is online): validation reads no weights."""
    local = Path(path).expanduser()
    if local.exists() or not is_hub_id(path):
        return local / "config.json"
    from rlbridge.model.hub import cached_file

    return cached_file(path, revision, "config.json", download=download)


def read_model_info(path: str, revision: str | None = None) -> ModelInfo:
    """ModelInfo for a short name, a local directory holding config.json, or a Hub id (its config.json from
    the Hugging Face cache, else from the Hub when online)."""
    if path in SHORT_NAMES:
        return ModelInfo.from_config(SHORT_NAMES[path])
    cfg_file = config_file(path, revision, download=True)
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RlbridgeError(f"no config.json in {cfg_file.parent}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RlbridgeError(f"cannot read {cfg_file}: {e}") from None
    if not isinstance(cfg, dict):
        raise RlbridgeError(f"{cfg_file} is not a JSON object")
    return ModelInfo.from_config(cfg)
