"""What travels from the trainer to the rollout, named once for both sides (and for export-hf).

Both `engines/` (which export weights) and `rollout/` (which load them) import this package, and it imports
neither. `WeightSync` and `WeightExport` are here; the ways an export travels are its modules: `hf_files` (the
HF / PEFT files transformers, peft and vLLM load, and the LoRA merge arithmetic), `directory` (one RAM-backed
directory per weight version for a rollout engine on the same node) and `ipc` (CUDA IPC handles for a rollout
engine on the same GPU). Importing the package imports no torch (recipe validation reads `WeightSync`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class WeightSync(StrEnum):
    """rollout.weight_sync, a WeightExport's kind, export-hf's choice. A `str` enum: each member equals its value,
    so recipe YAML, the resolved recipe.yaml and checkpoint JSON hold the same plain strings ("merged",
    "adapter") and code compares against the members."""

    MERGED = "merged"
    """Every weight of the HF model, with the adapters folded in."""
    ADAPTER = "adapter"
    """The PEFT adapter's lora_A / lora_B tensors alone."""


@dataclass
class WeightExport:
    """Weights for the rollout or for export-hf, with HF parameter names."""

    kind: WeightSync
    """'merged' (every weight of the HF model, adapters folded in) or 'adapter' (PEFT lora_A/lora_B)."""
    tensors: dict[str, torch.Tensor]
    adapter_config: dict | None = None
    """PEFT adapter_config.json content when kind == 'adapter'."""
    path: str | None = None
    """Set when the export was already written as an HF (merged) or PEFT (adapter) directory on this node;
    `tensors` is then empty and the receiver takes ownership of the directory (same-node hand-off: no copy
    through Ray's object store), unless `sender_keeps`."""
    sender_keeps: bool = False
    """With `path`: the sender keeps the directory and overwrites its files in place with the next version
    (weights/directory.overwrite_merged), so the receiver must not remove it and must be done reading it
    when load_weights returns."""
    ipc: dict[str, Any] | None = None
    """Set for rollout.weight_transport cuda_ipc: CUDA IPC handles of merged tensors on the trainer's GPU, as plain
    data (rlbridge/weights/ipc.py); `tensors` is then empty and the trainer keeps the tensors alive until its
    `release_export`."""

    def nbytes(self, dtype: torch.dtype | None = None) -> int:
        """Tensor bytes of `tensors`; with `dtype`, floating tensors counted in it (as a writer casting to the
        rollout's dtype writes them)."""
        return sum(
            t.numel() * (dtype.itemsize if dtype is not None and t.is_floating_point() else t.element_size())
            for t in self.tensors.values()
        )

    def __getstate__(self) -> dict[str, Any]:
        """What pickle (and so Ray, between trainer, driver and rollout workers) sends: the fields, with every
        tensor that views a larger storage replaced by a compact copy. torch pickles a view with its whole
        storage, once per view: host_copies hands out an adapter as hundreds of views of one joined buffer,
        which would pickle to hundreds of times the adapter's size."""
        state = dict(self.__dict__)
        state["tensors"] = {name: compact(t) for name, t in self.tensors.items()}
        return state


def compact(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` itself when it spans its whole storage (strided or not: it pickles at its own size), else a
    contiguous copy that does."""
    import torch

    if tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)
