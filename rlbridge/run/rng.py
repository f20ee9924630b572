"""This process's RNG states as JSON: saved into every checkpoint (trainer and driver), restored on resume, so
the draws that follow a resume repeat those that followed the save."""

from __future__ import annotations

import base64
import logging
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from rlbridge.errors import RlbridgeError

log = logging.getLogger(__name__)


def rng_state() -> dict[str, Any]:
    """JSON-able RNG states of python `random`, numpy's global generator, torch CPU and, when this process
    has initialised CUDA, every CUDA device (a process that never used CUDA has nothing to save, and asking
    would create a CUDA context)."""
    version, internal, gauss_next = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "name": name,
            "keys": [int(k) for k in keys],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore the states of `rng_state()`; the draws that follow repeat those that followed the save."""
    try:
        py, npy = state["python"], state["numpy"]
        random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
        np.random.set_state(
            (
                npy["name"],
                np.array(npy["keys"], dtype=np.uint32),
                npy["pos"],
                npy["has_gauss"],
                npy["cached_gaussian"],
            )
        )
        torch.set_rng_state(_unb64(state["torch"]))
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise RlbridgeError(f"invalid RNG state in the checkpoint ({type(e).__name__}: {e})") from e
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        num_devices = torch.cuda.device_count()
        if len(cuda) != num_devices:
            log.warning(
                "the checkpoint has CUDA RNG states for %d devices, this process sees %d; restoring "
                "the first %d",
                len(cuda),
                num_devices,
                min(len(cuda), num_devices),
            )
        torch.cuda.set_rng_state_all([_unb64(s) for s in cuda[:num_devices]])
    elif cuda:
        log.warning("the checkpoint has CUDA RNG states but CUDA is not available; they are ignored")


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
