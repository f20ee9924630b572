"""Random-weight Hugging Face model directories with a byte-level tokenizer, built locally in seconds.

Two users: the `tiny-qwen2-smoke` short name (the model of recipes/smoke-megatron-cpu.yaml) and
`rlbridge train --smoke`, which shrinks a recipe's model (smoke.py) and needs that shrunk architecture as
a real directory. Neither needs a model hub.

The tokenizer maps the 256 bytes to ids 0..255 plus four specials (pad, bos, eos, im_start; ids 256..259)
and carries a ChatML-like chat template, so every id a model samples decodes and any dataset encodes.
The model's vocabulary is set to exactly these 260 ids. Transformers, peft, Megatron-Bridge and vLLM (CPU
build) load the result like any local model directory; for vLLM's CPU attention, head_dim must be 32, 64,
80, ... (smoke.py picks 32).

The output layer is scaled after the random init (`logit_scale`) so next-token distributions are peaked:
greedy decoding then has no near-ties, and log-prob comparisons between engines mean something.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SPECIALS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>"]
PAD_ID, BOS_ID, EOS_ID = 256, 257, 258
VOCAB_SIZE = 256 + len(SPECIALS)

CHAT_TEMPLATE = (
    "{{ '<|bos|>' }}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|eos|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table (what the tokenizers ByteLevel pre-tokenizer emits)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def save_byte_tokenizer(out_dir: Path, *, model_max_length: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab={c: b for b, c in enumerate(_bytes_to_unicode())}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>", eos_token="<|eos|>",
        chat_template=CHAT_TEMPLATE, model_max_length=model_max_length,
    )  # fmt: skip
    if len(fast) != VOCAB_SIZE or fast.convert_tokens_to_ids("<|eos|>") != EOS_ID:
        raise AssertionError("byte tokenizer ids are not the expected ones")
    fast.save_pretrained(out_dir)


def build_random_model(
    config: dict[str, Any], out_dir: Path, *, seed: int = 0, logit_scale: float = 2.5
) -> Path:
    """Write a float32 random model of `config` (a config.json mapping; vocabulary and special-token ids
    are replaced by the byte tokenizer's) with that tokenizer into `out_dir`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    cfg = {
        k: v
        for k, v in config.items()
        if k not in ("architectures", "quantization_config", "torch_dtype", "dtype")
    }
    cfg.update(vocab_size=VOCAB_SIZE, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    hf_config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    hf_config.architectures = list(config.get("architectures") or []) or None
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(
                ".bias"
            ):  # HF initializes biases to 0: draw them, so a bias lost in a conversion shows
                param.normal_(0.0, 0.1)
        if not hf_config.tie_word_embeddings:
            model.get_output_embeddings().weight.mul_(logit_scale)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID).save_pretrained(out_dir)
    save_byte_tokenizer(out_dir, model_max_length=int(getattr(hf_config, "max_position_embeddings", 2048)))
    return out_dir
