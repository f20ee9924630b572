"""A CPU trainer's host memory, touched before the first update needs it.

The first update of a CPU trainer allocates its activations for the first time, and every fresh page costs the
kernel a page fault (zeroing it; under a VM also the host's backing of it). For the quickstart's batch that is
millions of faults: the first update took more than twice as long as the later ones, which reuse the same memory
(rlbridge's CPU workers run glibc's allocator with one arena that never trims or unmaps:
cluster/ray_cluster/connect.CPU_MALLOC). `Prefault` touches that much memory in a background thread of the
trainer while the rollout engine starts and generates the first batch, then frees it into the allocator's
arena, where the update's allocations find it already resident.

How much: the plan's activation estimate (plan.memory.activations), the part of the trainer's memory that the
update allocates and frees. Touched in chunks of CHUNK_BYTES (freed together, they join into one region of the
arena that large tensors fit in). The update waits for the thread (`wait`), so the touched memory and the
update's own never add up.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 << 20
"""Bytes allocated and touched at a time."""


def touch(num_bytes: int) -> int:
    """Allocate `num_bytes` (rounded down to CHUNK_BYTES) in chunks, write every page, free them all; returns the
    bytes touched."""
    chunks = [torch.empty(CHUNK_BYTES, dtype=torch.uint8).fill_(0) for _ in range(num_bytes // CHUNK_BYTES)]
    touched = len(chunks) * CHUNK_BYTES
    del chunks
    return touched


class Prefault:
    """`touch(num_bytes)` in a daemon thread, started at once; `wait` joins it (once) and logs what it did."""

    def __init__(self, num_bytes: int) -> None:
        self.num_bytes = num_bytes
        self.touched = 0
        self.seconds = 0.0
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = threading.Thread(
            target=self._run, name="rlbridge-prefault", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            self.touched = touch(self.num_bytes)
        except BaseException as e:  # out of memory: the update would meet it anyway, and says so itself
            self.error = e
        self.seconds = time.perf_counter() - start

    def wait(self) -> None:
        """Block until the memory is touched and freed (a no-op after the first call)."""
        if self._thread is None:
            return
        waited = time.perf_counter()
        self._thread.join()
        self._thread = None
        if self.error is not None:
            log.warning("host memory prefault stopped after %.1f s: %r", self.seconds, self.error)
            return
        log.info(
            "host memory prefault: %.2f GiB touched in %.1f s before the first update (waited %.1f s for it)",
            self.touched / 2**30,
            self.seconds,
            time.perf_counter() - waited,
        )
