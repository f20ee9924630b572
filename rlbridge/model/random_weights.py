"""Random-weight Hugging Face model directories with a byte-level tokenizer, built locally in seconds.

Two users: the `tiny-qwen2-smoke` short name (the model of recipes/smoke-megatron-cpu.yaml) and
`rlbridge train --smoke`, which shrinks a recipe's model (smoke.py) and needs that shrunk architecture as
a real directory. Neither needs a model hub.

The tokenizer maps the 256 bytes to ids 0..255 plus four specials (pad, bos, eos, im_start; ids 256..259)
and carries a ChatML-like chat template, so every id a model samples decodes and any dataset encodes.
The model's vocabulary is set to exactly these 260 ids. Transformers, peft, Megatron-Bridge and vLLM (CPU
build) load the result like any local model directory; for vLLM's CPU attention, head_dim must be 32, 64,
80, ... (smoke.py picks 32).

A config whose vocabulary is larger than that (a full-size architecture such as `qwen2.5-7b-random`) can keep
it (`keep_vocab`): the tokenizer is then padded to the model's vocabulary with multi-byte filler tokens, so that
every id the model samples decodes (to its bytes), as a real byte-level BPE vocabulary does. Such a model is
built in bfloat16, on the GPU when there is one: its float32 random init would take minutes and twice the memory.

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


def _filler_tokens(count: int, chars: list[str]) -> list[str]:
    """`count` distinct byte-level tokens of two or three bytes (never produced by encoding: there are no merges),
    which decode to their bytes."""
    if count > 256**2 + 256**3:
        raise ValueError(f"cannot pad a byte tokenizer by {count} tokens")
    out: list[str] = []
    for k in range(count):
        if k < 256**2:
            out.append(chars[k // 256] + chars[k % 256])
        else:
            j = k - 256**2
            out.append(chars[j // 256**2] + chars[(j // 256) % 256] + chars[j % 256])
    return out


def save_byte_tokenizer(out_dir: Path, *, model_max_length: int, vocab_size: int = VOCAB_SIZE) -> None:
    """The byte tokenizer, padded with filler tokens to `vocab_size` ids (>= VOCAB_SIZE)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from rlbridge.model.hf import PreTrainedTokenizerFast

    chars = _bytes_to_unicode()
    vocab = {c: b for b, c in enumerate(chars)}
    vocab.update({t: 256 + i for i, t in enumerate(SPECIALS)})  # the added specials keep these ids
    vocab.update({t: VOCAB_SIZE + i for i, t in enumerate(_filler_tokens(vocab_size - VOCAB_SIZE, chars))})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>", eos_token="<|eos|>",
        chat_template=CHAT_TEMPLATE, model_max_length=model_max_length,
    )  # fmt: skip
    if len(fast) != vocab_size or fast.convert_tokens_to_ids("<|eos|>") != EOS_ID:
        raise AssertionError("byte tokenizer ids are not the expected ones")
    fast.save_pretrained(out_dir)


def build_random_model(
    config: dict[str, Any],
    out_dir: Path,
    *,
    seed: int = 0,
    logit_scale: float = 2.5,
    keep_vocab: bool = False,
) -> Path:
    """Write a random model of `config` (a config.json mapping) with the byte tokenizer into `out_dir`.

    By default the vocabulary and special-token ids are replaced by the byte tokenizer's and the weights are
    float32. keep_vocab: the config's vocabulary stays (the tokenizer is padded to it) and the weights are
    bfloat16, initialized on the GPU when there is one (full-size architectures)."""
    import torch

    from rlbridge.model.hf import AutoConfig, AutoModelForCausalLM, GenerationConfig

    cfg = {
        k: v
        for k, v in config.items()
        if k not in ("architectures", "quantization_config", "torch_dtype", "dtype")
    }
    vocab_size = max(int(cfg.get("vocab_size", VOCAB_SIZE)), VOCAB_SIZE) if keep_vocab else VOCAB_SIZE
    cfg.update(vocab_size=vocab_size, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    hf_config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    hf_config.architectures = list(config.get("architectures") or []) or None
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if keep_vocab else torch.float32
    device = "cuda" if keep_vocab and torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            # HF initializes biases to 0: draw them, so a bias lost in a conversion shows
            if name.endswith(".bias"):
                param.normal_(0.0, 0.1)
        if not hf_config.tie_word_embeddings:
            model.get_output_embeddings().weight.mul_(logit_scale)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID).save_pretrained(out_dir)
    save_byte_tokenizer(
        out_dir,
        model_max_length=int(getattr(hf_config, "max_position_embeddings", 2048)),
        vocab_size=vocab_size,
    )
    return out_dir
