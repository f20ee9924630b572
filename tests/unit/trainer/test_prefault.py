"""trainer/prefault.py: memory touched in the background is resident when the update allocates it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from rlbridge.cluster.ray_cluster import CPU_MALLOC

PROBE = """
import json, resource, sys, torch
from rlbridge.trainer.prefault import CHUNK_BYTES, Prefault
total = 256 << 20
if sys.argv[1] == "prefault":
    p = Prefault(total)
    p.wait()
    assert p.error is None and p.touched == total, (p.error, p.touched)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
# what an update does: tensors of several sizes, written, alive together
held = [torch.empty(n, dtype=torch.uint8).fill_(1) for n in (96 << 20, 64 << 20, 48 << 20, 32 << 20)]
print(json.dumps({"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def faults(mode: str) -> int:
    env = {**os.environ, **CPU_MALLOC, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True, check=True, timeout=120
    )
    return int(json.loads(out.stdout.strip().splitlines()[-1])["faults"])


def test_prefaulted_memory_is_reused_by_later_allocations_without_page_faults() -> None:
    """With rlbridge's CPU allocator settings, 240 MiB of tensors allocated after a 256 MiB prefault take (almost)
    no page faults; without it, one per 4 KiB page (61,440)."""
    pages = (240 << 20) // 4096
    cold, warm = faults("none"), faults("prefault")
    assert cold > 0.9 * pages, cold
    assert warm < 0.02 * pages, warm
