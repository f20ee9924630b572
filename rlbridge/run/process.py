"""Whether a process is alive: the one check behind the checkpoint format's leftover sweep, the RAM weight
directories' sweep and `rlbridge report`'s running/crashed verdict. No torch (report imports it)."""

from __future__ import annotations

import os
from pathlib import Path


def pid_alive(pid: int, *, python_only: bool = False) -> bool:
    """Whether a process with this pid exists (ours or another user's). python_only: it counts only while it
    runs python or rlbridge, so a recycled pid of an unrelated program does not (where /proc tells)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if not python_only:
        return True
    cmdline = Path(f"/proc/{pid}/cmdline")
    if cmdline.exists():
        try:
            text = cmdline.read_bytes()
        except OSError:
            return True
        return b"python" in text or b"rlbridge" in text
    return True
