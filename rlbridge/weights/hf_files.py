"""Weight exports as HF files, for both trainer engines, export-hf and the rollout's weight directories.

Both engines hand weights out as a `WeightExport` (HF parameter names); this module holds what does not
depend on how the engine holds its model: folding a LoRA/DoRA adapter into its base weight in float32, and
writing an export as a directory that transformers, peft and vLLM load (`save_hf`, whose safetensors files
`write_safetensors` writes). Only torch and the standard library are imported here.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import torch

from rlbridge.weights import WeightExport, WeightSync

MERGED_FILE = "model.safetensors"
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".index.json")


def merge_lora(
    weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
    magnitude: torch.Tensor | None = None,
) -> torch.Tensor:
    """`weight + scaling * B @ A` computed in float32 and cast back to `weight.dtype`.

    weight [out, in], lora_a [r, in], lora_b [out, r]. With DoRA's `magnitude` [out], each output row of the
    merged matrix is rescaled to that norm: `magnitude / ||W + sBA||_row * (W + sBA)` (what peft computes).
    """
    merged = weight.detach().float() + scaling * (lora_b.detach().float() @ lora_a.detach().float())
    if magnitude is not None:
        norm = torch.linalg.norm(merged, dim=1)
        merged = (magnitude.detach().float() / norm).unsqueeze(1) * merged
    return merged.to(weight.dtype)


def save_hf(out_dir: str | Path, weights: WeightExport, *, base_dir: str | Path | None = None) -> Path:
    """Write `weights` as a directory transformers / peft / vLLM load, and return it.

    merged: config.json (its dtype set to the tensors' dtype), the tokenizer and other non-weight files
    copied from `base_dir` (the model the engine loaded; required), and model.safetensors; stale weight
    files in `out_dir` are removed. adapter: adapter_config.json + adapter_model.safetensors (a PEFT
    directory; base_dir unused). Each file is written under a temporary name and renamed into place.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = _saveable(weights.tensors)
    if weights.kind == WeightSync.MERGED:
        if base_dir is None:
            raise ValueError("save_hf of merged weights needs base_dir (for config.json and the tokenizer)")
        _remove_weight_files(out)
        _copy_base_files(Path(base_dir), out, _float_dtype(tensors))
        _save_tensors(tensors, out / MERGED_FILE)
    elif weights.kind == WeightSync.ADAPTER:
        if not weights.adapter_config:
            raise ValueError("an adapter WeightExport needs adapter_config (the adapter_config.json content)")
        _write_text(out / ADAPTER_CONFIG_FILE, json.dumps(weights.adapter_config, indent=2, sort_keys=True))
        _save_tensors(tensors, out / ADAPTER_FILE)
    else:
        raise ValueError(f"unknown WeightExport kind {weights.kind!r} (expected 'merged' or 'adapter')")
    return out


HOST_COPY_CHUNK_BYTES = 64 << 20
"""host_copies joins tensors into one transfer up to this many bytes (a transient device buffer that
size); a larger tensor is copied on its own, where one copy is bandwidth-bound anyway."""


def host_copies(
    tensors: dict[str, torch.Tensor], *, chunk_bytes: int = HOST_COPY_CHUNK_BYTES
) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies of `tensors` (same names, order, dtypes and values; never the live storage).
    Tensors are flattened into one buffer per device, dtype and `chunk_bytes`, copied to the host in one
    transfer, and handed out as non-overlapping views of it: an adapter of 420 small tensors on a GPU costs
    one device-to-host copy and synchronization instead of 420 (safetensors writes such views as they are).
    On the CPU the joined buffer is the copy."""
    out: dict[str, torch.Tensor] = {}
    chunks: dict[tuple[torch.device, torch.dtype], list[tuple[list[str], int]]] = {}  # (names, bytes)
    for name, tensor in tensors.items():
        t = tensor.detach()
        size = t.numel() * t.element_size()
        if size >= chunk_bytes:
            out[name] = t.to("cpu", copy=True).contiguous()
            continue
        group = chunks.setdefault((t.device, t.dtype), [])
        if not group or group[-1][1] + size > chunk_bytes:
            group.append(([], 0))
        names, used = group[-1]
        names.append(name)
        group[-1] = (names, used + size)
    for group in chunks.values():
        for names, _ in group:
            flat = torch.cat(
                [tensors[n].detach().reshape(-1) for n in names]
            ).cpu()  # cat copies: fresh storage
            for n, v in zip(names, flat.split([tensors[n].numel() for n in names]), strict=True):
                out[n] = v.view(tensors[n].shape)
    return {name: out[name] for name in tensors}


def _saveable(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU tensors: device tensors come over in few transfers (`host_copies`); write_safetensors writes each
    tensor's bytes on its own, so views of one buffer or tensors that share storage need no copies."""
    on_device = {n: t for n, t in tensors.items() if t.device.type != "cpu"}
    copied = host_copies(on_device) if on_device else {}
    return {name: copied[name] if name in copied else tensor.detach() for name, tensor in tensors.items()}


SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64", torch.int32: "I32",
    torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip
"""torch dtypes and their names in a safetensors header."""


def write_safetensors(
    tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None
) -> int:
    """Write CPU `tensors` as a safetensors file (the format: an 8-byte little-endian header length, the JSON
    header of each tensor's dtype, shape and byte range, padded with spaces to a multiple of 8, then the bytes)
    and return its size. What safetensors' save_file writes, without its per-tensor conversions (~60 % of the
    GPU quickstart's adapter sync on a CPU) and without refusing tensors that share storage (views of one host
    buffer, as host_copies hands out: each is written on its own). Tensors are laid out widest element first so
    each starts aligned to its element size, as save_file does."""
    order = sorted(tensors, key=lambda n: -tensors[n].element_size())  # stable: names keep their order
    header: dict[str, Any] = {}
    parts: list[torch.Tensor] = []
    offset = 0
    for name in order:
        t = tensors[name].detach()
        if t.device.type != "cpu":
            raise ValueError(f"write_safetensors: {name} is on {t.device}, not the CPU")
        if t.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(
                f"write_safetensors: {name} has dtype {t.dtype}, which safetensors does not hold"
            )
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        parts.append(t.contiguous().reshape(-1).view(torch.uint8))
        offset += size
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for part in parts:
            if part.numel():
                f.write(part.numpy().data)
    return 8 + len(raw) + offset


def _float_dtype(tensors: dict[str, torch.Tensor]) -> torch.dtype | None:
    return next((t.dtype for t in tensors.values() if t.is_floating_point()), None)


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    write_safetensors(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, path)


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _is_weight_file(path: Path) -> bool:
    return path.is_file() and path.name.endswith(_WEIGHT_SUFFIXES)


def _remove_weight_files(out: Path) -> None:
    for f in out.iterdir():
        if _is_weight_file(f):
            f.unlink()


def _copy_base_files(base: Path, out: Path, dtype: torch.dtype | None) -> None:
    """Everything of the base directory but its weights (tokenizer, generation config, chat template), and
    config.json with the dtype of the exported tensors."""
    if base.resolve() == out.resolve():
        raise ValueError(f"save_hf would overwrite the base model directory {base}")
    for f in base.iterdir():
        if f.is_file() and not _is_weight_file(f) and not f.name.startswith(".") and f.name != "config.json":
            shutil.copyfile(f, out / f.name)
    config: dict[str, Any] = json.loads((base / "config.json").read_text(encoding="utf-8"))
    if dtype is not None:
        name = str(dtype).removeprefix("torch.")
        config["dtype"] = name
        if "torch_dtype" in config:
            config["torch_dtype"] = name
    _write_text(out / "config.json", json.dumps(config, indent=2, sort_keys=True))
