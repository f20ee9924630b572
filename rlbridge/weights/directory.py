"""Hand a WeightExport to a rollout engine as files: one RAM-backed directory per weight version.

vLLM takes new weights most cheaply from disk (its worker's `reload_weights(weights_path=...)` and
`LoRARequest(path=...)`), so the rollout writes each version into a directory in /dev/shm when present (no
disk I/O) that lives only until the next version replaces it. The files themselves are written by
`rlbridge.weights.hf_files.save_hf`, the same writer `export-hf` uses; this module adds what the rollout
needs on top: the RAM-backed location, the cast to the engine's dtype (a float32 export for a bfloat16
engine is written at half the size), and the checks that catch a wrong export before vLLM sees it.
"""

from __future__ import annotations

import enum
import json
import logging
import mmap
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from rlbridge.errors import RlbridgeError
from rlbridge.run.process import pid_alive
from rlbridge.weights import WeightExport, WeightSync
from rlbridge.weights.hf_files import MERGED_FILE, SAFETENSORS_DTYPES, save_hf

log = logging.getLogger(__name__)


ROOM_MARGIN = 1.05
"""Free space a weights directory asks for beyond the tensors' bytes (safetensors header, filesystem blocks)."""


def ram_tempdir(prefix: str, need_bytes: int = 0) -> Path:
    """A fresh directory in RAM-backed storage (/dev/shm) when available, else the system temp dir, named
    `<prefix><pid>-<random>`. Directories of this kind left by dead processes are removed first: a run that
    is killed (or whose rollout worker is killed on the way out) cannot delete its last weights, and in
    /dev/shm they would hold RAM until the next reboot (a merged SmolLM2 is 540 MB).

    need_bytes: the tensor bytes about to be written. Where /dev/shm has less room (a container's default
    /dev/shm is 64 MB; a merged 30B model is 57 GiB), the directory goes to the system temp dir (disk) with a
    warning, and where neither has room an RlbridgeError says so with the fixes, before anything is written
    (a write that runs out of room fails half-way, or kills the reader of a mapped file with SIGBUS)."""
    shm, disk = _ram_base(), Path(tempfile.gettempdir())
    sweep_stale(shm)
    base = shm
    if need_bytes and _free_bytes(shm) < need_bytes * ROOM_MARGIN:
        if shm != disk:
            sweep_stale(disk)
        if _free_bytes(disk) < need_bytes * ROOM_MARGIN:
            raise RlbridgeError(_no_room_message(need_bytes, [shm, disk]))
        if shm != disk and shm not in _warned:
            _warned.add(shm)
            log.warning(
                f"rlbridge: {need_bytes / 2**30:.2f} GiB of weights do not fit {shm} "
                f"({_free_bytes(shm) / 2**30:.2f} GiB free): writing them to {disk} (disk, slower). A larger "
                "/dev/shm (docker run --shm-size), rollout.weight_sync adapter or rollout.weight_transport "
                "cuda_ipc avoids it."
            )
        base = disk
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=base))


def _ram_base() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _free_bytes(path: Path) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


def _no_room_message(need_bytes: int, places: list[Path]) -> str:
    free = ", ".join(f"{p} {_free_bytes(p) / 2**30:.2f} GiB free" for p in dict.fromkeys(places))
    return (
        f"no room for the rollout's weights: {need_bytes / 2**30:.2f} GiB to write ({free}). Fix: "
        "rollout.weight_sync adapter (LoRA: megabytes), rollout.weight_transport cuda_ipc (colocated GPUs: no "
        "files), a larger /dev/shm (docker run --shm-size), or TMPDIR on a disk with room"
    )


_warned: set[Path] = set()
"""The RAM-backed directories already reported too small by this process (one warning each)."""


def sweep_ram_dirs() -> list[str]:
    """sweep_stale where ram_tempdir creates directories: after a run's workers are gone, their last weights."""
    return sweep_stale(_ram_base())


_WEIGHTS_DIR = re.compile(r"rlbridge-(?:merged|adapter)-(?:(\d+)-)?[A-Za-z0-9_]+")
_UNOWNED_AGE_S = 3600.0
"""Directories named without a pid (earlier rlbridge versions) are removed once this old."""


def sweep_stale(base: Path) -> list[str]:
    """Remove the weight directories under `base` whose creating process is gone (or, unnamed, that are over
    an hour old); returns their names. A live process's directories are never touched."""
    removed: list[str] = []
    try:
        entries = list(base.iterdir())
    except OSError:
        return removed
    for path in entries:
        m = _WEIGHTS_DIR.fullmatch(path.name)
        if not m or not path.is_dir() or path.is_symlink():
            continue
        try:
            stale = (
                not pid_alive(int(m.group(1)))
                if m.group(1)
                else time.time() - path.stat().st_mtime > _UNOWNED_AGE_S
            )
        except OSError:
            continue
        if stale:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return removed

    return True


def remove_dir(path: Path | None) -> None:
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def write_merged(weights: WeightExport, out_dir: Path, *, base_dir: str | Path, dtype: torch.dtype) -> Path:
    """A 'merged' export (full HF state dict) as an HF directory, floating tensors cast to `dtype`."""
    if weights.kind != WeightSync.MERGED:
        raise ValueError(f"write_merged needs a 'merged' WeightExport, got kind={weights.kind!r}")
    return save_hf(
        out_dir, WeightExport(WeightSync.MERGED, _in_dtype(weights.tensors, dtype)), base_dir=base_dir
    )


def _in_dtype(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating tensors cast to `dtype` (the rollout engine's), the others as they are."""
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}


def overwrite_merged(weights: WeightExport, out_dir: Path, *, dtype: torch.dtype) -> bool:
    """Write a 'merged' export into out_dir's existing model.safetensors in place, when its header lists exactly
    these names, dtypes (after the cast to `dtype`) and shapes; False (nothing written) otherwise. The file keeps
    its pages: on a RAM-backed directory a fresh file costs the kernel a page allocation per page on every
    sync, seconds for a merged small model on a CPU (docs/defaults.md#vllm-on-the-cpu). The reader must not be reading the
    file meanwhile (the rollout loads each version before the next export starts)."""
    path = out_dir / MERGED_FILE
    try:
        with path.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header: dict[str, Any] = json.loads(f.read(size))
    except (OSError, ValueError):
        return False
    header.pop("__metadata__", None)
    cast = _in_dtype(weights.tensors, dtype)
    if set(header) != set(cast):
        return False
    for name, t in cast.items():
        layout = (SAFETENSORS_DTYPES.get(t.dtype), list(t.shape))
        if (header[name].get("dtype"), list(header[name].get("shape", []))) != layout:
            return False
    with path.open("r+b") as out, mmap.mmap(out.fileno(), 0) as mm:
        data = torch.frombuffer(mm, dtype=torch.uint8)
        base = 8 + size
        for name, t in cast.items():
            start, end = header[name]["data_offsets"]
            src = t.detach().contiguous().reshape(-1).view(torch.uint8)
            data[base + start : base + end].copy_(src)
        del data  # the mmap closes only once no tensor views it
    return True


def write_adapter(weights: WeightExport, out_dir: Path) -> Path:
    """An 'adapter' export as a PEFT adapter directory (adapter_config.json + adapter_model.safetensors)."""
    if weights.kind != WeightSync.ADAPTER:
        raise ValueError(f"write_adapter needs an 'adapter' WeightExport, got kind={weights.kind!r}")
    if not weights.adapter_config:
        raise ValueError(
            "an 'adapter' WeightExport needs adapter_config (the PEFT adapter_config.json content)"
        )
    bad = [n for n in weights.tensors if ".lora_A." not in n and ".lora_B." not in n]
    if bad:
        raise ValueError(
            f"adapter export holds non-LoRA tensors (e.g. {bad[:3]}); export kind='merged' for those"
        )
    config = {"peft_type": "LORA", **_json_safe(weights.adapter_config)}
    return save_hf(out_dir, WeightExport(WeightSync.ADAPTER, weights.tensors, config))


def _json_safe(value: Any) -> Any:
    """peft's `LoraConfig.to_dict()` holds sets (target_modules) and enums; JSON wants lists and strings."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, set | frozenset):
        return sorted(_json_safe(v) for v in value)
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    return value


def read_export_dir(weights: WeightExport) -> WeightExport:
    """The tensors of a directory hand-off (WeightExport.path), which is removed afterwards; or, when the sender
    keeps it (and will overwrite it), copied out of it."""
    from safetensors.torch import load_file

    assert weights.path is not None
    path = Path(weights.path)
    name = MERGED_FILE if weights.kind == WeightSync.MERGED else "adapter_model.safetensors"
    tensors = load_file(str(path / name))
    if weights.sender_keeps:  # never a view of a file the next version overwrites
        tensors = {k: v.clone() for k, v in tensors.items()}
    else:
        remove_dir(path)
    return WeightExport(weights.kind, tensors, weights.adapter_config)
