"""How a trainer hands its weight export to the rollout: as the engine returned it (through Ray), as files in a
RAM-backed directory on this node, or as CUDA IPC handles of tensors kept on this GPU. TrainerRole owns one
WeightSender; what it keeps between syncs (the run's merged directory, the shared GPU tensors) lives here."""

from __future__ import annotations

import gc
import logging
import shutil
import time
import weakref
from pathlib import Path

import torch

from rlbridge.errors import RlbridgeError
from rlbridge.weights import WeightExport, WeightSync

log = logging.getLogger(__name__)


class WeightSender:
    """The trainer side of a weight sync, after the engine's export; `dtype` is the rollout's (model.dtype)."""

    def __init__(self, model_dir: Path, dtype: torch.dtype) -> None:
        self.model_dir = model_dir
        self.dtype = dtype
        self.last_bytes = 0
        """Tensor bytes of the last export (the session's sync_bytes metric)."""
        self._shared: list[torch.Tensor] = []
        """The tensors of a CUDA IPC export, alive until `release` (the rollout reads them in place)."""
        self._merged_dir: Path | None = None
        """Same-node merged exports: the RAM-backed directory overwritten each sync (removed with this object;
        a killed trainer's by the session's sweep when the run ends, or by the next run's ram_tempdir)."""

    def send(
        self, weights: WeightExport, *, started: float, as_files: bool = False, cuda_ipc: bool = False
    ) -> WeightExport:
        """What the rollout receives for `weights` (the engine's export, begun at perf_counter `started`).
        as_files (rollout on this node): written straight into a RAM-backed directory in the rollout's dtype and
        handed over by path, instead of shipped through Ray. cuda_ipc (merged, rollout.weight_transport
        cuda_ipc): the tensors stay on this GPU in the rollout's dtype and the export carries CUDA IPC handles
        of them; they are kept until `release`."""
        if cuda_ipc:
            return self._share_merged(weights)
        if not as_files:
            return weights
        exported = time.perf_counter()
        from rlbridge.weights.directory import overwrite_merged, ram_tempdir, write_adapter, write_merged

        kind = weights.kind
        if (
            kind == WeightSync.MERGED
        ):  # one directory for the run, its file overwritten in place (weights/directory.py)
            if self._merged_dir is None:
                self._merged_dir = ram_tempdir("rlbridge-merged-", weights.nbytes(self.dtype))
                weakref.finalize(self, shutil.rmtree, self._merged_dir, ignore_errors=True)
            out, how = self._merged_dir, "in place"
            if not overwrite_merged(weights, out, dtype=self.dtype):
                write_merged(weights, out, base_dir=self.model_dir, dtype=self.dtype)
                how = "new file"
        else:
            out = write_adapter(weights, ram_tempdir("rlbridge-adapter-", weights.nbytes()))
            how = "new directory"
        end = time.perf_counter()
        log.info(
            "%s weights exported in %.3f s (engine %.3f s, write %.3f s, %s, %.1f MB)",
            kind, end - started, exported - started, end - exported, how, self.last_bytes / 1e6,
        )  # fmt: skip
        return WeightExport(
            kind, {}, weights.adapter_config, path=str(out), sender_keeps=kind == WeightSync.MERGED
        )

    def _share_merged(self, weights: WeightExport) -> WeightExport:
        from rlbridge.weights import ipc

        if weights.kind != WeightSync.MERGED:
            raise RlbridgeError(
                f"rollout.weight_transport cuda_ipc moves merged weights, not {weights.kind!r}"
            )
        if not torch.cuda.is_available():
            raise RlbridgeError("rollout.weight_transport cuda_ipc needs the trainer on a CUDA device")
        self.release()  # one the rollout never loaded (a failed sync) goes first
        device = torch.device("cuda", torch.cuda.current_device())
        payload, self._shared = ipc.share(weights.tensors, dtype=self.dtype, device=device)
        return WeightExport(WeightSync.MERGED, {}, ipc=payload)

    def release(self) -> None:
        """Drop the tensors of the last CUDA IPC export (the rollout has loaded them, or the sync failed) and
        give their memory back to the device (a no-op without one)."""
        if not self._shared:
            return
        self._shared = []
        gc.collect()
        torch.cuda.ipc_collect()  # blocks the receiver has let go of; then the cache, for vLLM's KV cache
        torch.cuda.empty_cache()
