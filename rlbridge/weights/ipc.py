"""Merged weights from a colocated CUDA trainer to vLLM by CUDA IPC handles (rollout.weight_transport cuda_ipc).

The trainer puts its merged tensors on its GPU in the rollout's dtype and hands out, for each, the arguments
torch's own CUDA tensor pickling produces (`torch.multiprocessing.reductions.reduce_tensor`): an IPC handle of
the allocation, offsets, shape, stride, dtype. The vLLM worker on the same GPU (another process) opens them
(`rebuild_cuda_tensor`) and reloads from those tensors in place: no copy through host memory or /dev/shm.

The payload is plain data (`share`): classes, dtypes and sizes become names and lists, so it travels through
Ray, pickle or msgpack alike, and `open_shared` turns it back. The trainer keeps the shared tensors alive until the
rollout has loaded them (TrainerRole.release_export); the rollout synchronizes its device before it lets go.

Limits: the handles open on the same physical GPU only (the payload carries the GPU's UUID, checked on open) and
in another process only (CUDA cannot open a handle in the process that made it). tests/gpu/test_gpu_ipc_sync.py
checks it on a GPU against the file route.

Imported by vLLM's worker processes (WorkerExtension): nothing heavy at module level beyond torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

HANDLE_ARGS = 15
"""Arguments of torch's `rebuild_cuda_tensor` (torch 2.x): tensor class, size, stride, offset, storage class, dtype,
device index, handle, storage bytes, storage offset, requires_grad, ref-counter handle and offset, event handle,
event sync required."""
DEVICE_ARG = 6
"""Position of the device index in those arguments: set to the receiver's own index of the same GPU."""


def _classes() -> dict[str, type]:
    """The classes a payload may name (nothing else is resolved from a name)."""
    allowed: list[type] = [torch.Tensor, torch.nn.Parameter, torch.storage.TypedStorage, torch.UntypedStorage]
    return {f"{c.__module__}.{c.__qualname__}": c for c in allowed}


def to_plain(value: Any) -> Any:
    """One of reduce_tensor's arguments as plain data (None, bool, int, float, str, bytes, lists, one-key dicts)."""
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return value
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, type):
        name = f"{value.__module__}.{value.__qualname__}"
        if name not in _classes():
            raise TypeError(f"CUDA IPC payload: unexpected class {name}")
        return {"class": name}
    if isinstance(value, torch.Size):
        return {"size": [int(v) for v in value]}
    if isinstance(value, tuple | list):
        return {"tuple": [to_plain(v) for v in value]}
    raise TypeError(f"CUDA IPC payload: cannot make {type(value).__name__} plain")


def from_plain(value: Any) -> Any:
    """The inverse of `to_plain`."""
    if not isinstance(value, dict):
        return value
    if len(value) != 1:
        raise ValueError(f"CUDA IPC payload: malformed entry {value!r}")
    ((kind, inner),) = value.items()
    if kind == "dtype":
        dtype = getattr(torch, str(inner), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"CUDA IPC payload: unknown dtype {inner!r}")
        return dtype
    if kind == "class":
        classes = _classes()
        if inner not in classes:
            raise ValueError(f"CUDA IPC payload: unexpected class {inner!r}")
        return classes[inner]
    if kind == "size":
        return torch.Size(int(v) for v in inner)
    if kind == "tuple":
        return tuple(from_plain(v) for v in inner)
    raise ValueError(f"CUDA IPC payload: unknown entry kind {kind!r}")


def device_uuid(device: torch.device | int) -> str:
    """The physical GPU's UUID (the same whatever CUDA_VISIBLE_DEVICES numbers it in a process)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def share(
    tensors: Mapping[str, torch.Tensor], *, dtype: torch.dtype, device: torch.device
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """(payload, the tensors it refers to). Floating tensors are cast to `dtype` (the rollout's, as write_merged
    does for files), all made contiguous on `device` (a CUDA device of this process). The caller keeps the
    tensors alive until the receiver has loaded them."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    items: list[list[Any]] = []
    held: list[torch.Tensor] = []
    for name, tensor in tensors.items():
        t = tensor.detach()
        t = t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device=device)
        t = t.contiguous()
        rebuild, args = reduce_tensor(t)
        if rebuild is not rebuild_cuda_tensor or len(args) != HANDLE_ARGS:
            raise RuntimeError(
                f"CUDA IPC: torch reduced {name} as {getattr(rebuild, '__name__', rebuild)} with {len(args)} "
                f"arguments, expected rebuild_cuda_tensor with {HANDLE_ARGS} (a torch this code does not know)"
            )
        held.append(t)
        items.append([name, to_plain(args)])
    return {"uuid": device_uuid(device), "pid": os.getpid(), "items": items}, held


def check_receiver(payload: Mapping[str, Any], *, uuid: str, pid: int) -> None:
    """Raises unless a process `pid` on the GPU `uuid` can open the payload's handles."""
    if payload.get("uuid") != uuid:
        raise RuntimeError(
            f"CUDA IPC: the trainer's tensors are on GPU {payload.get('uuid')}, this vLLM worker runs on {uuid}: "
            "handles open on the same GPU only (rollout.weight_transport cuda_ipc needs cluster.colocate: true)"
        )
    if payload.get("pid") == pid:
        raise RuntimeError(
            "CUDA IPC: the trainer and the vLLM worker are one process, and CUDA cannot open an IPC handle in the "
            "process that made it; use rollout.weight_transport: files"
        )


def rebuild_args(plain_args: Any, device_index: int) -> tuple[Any, ...]:
    """rebuild_cuda_tensor's arguments from the payload, for the receiver's index of the GPU."""
    args = list(from_plain(plain_args))
    if len(args) != HANDLE_ARGS:
        raise ValueError(f"CUDA IPC payload: {len(args)} handle arguments, expected {HANDLE_ARGS}")
    args[DEVICE_ARG] = int(device_index)
    return tuple(args)


def open_shared(payload: Mapping[str, Any], device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """The payload's tensors, opened on `device` (this process's CUDA device; checked to be the sender's GPU)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    check_receiver(payload, uuid=device_uuid(device), pid=os.getpid())
    index = device.index if device.index is not None else torch.cuda.current_device()
    return [(str(name), rebuild_cuda_tensor(*rebuild_args(args, index))) for name, args in payload["items"]]
