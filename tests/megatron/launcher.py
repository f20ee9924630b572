"""Run a worker function on N gloo ranks, importing the Megatron stack once.

    python tests/megatron/launcher.py FUNCTION WORLD OUT_DIR KWARGS_JSON

Importing megatron-core + Megatron-Bridge takes ~10 s of CPU per process; on a 2-core machine N parallel
imports would eat most of a test's budget. So this process activates rlbridge's megatron compat layer once
(single-threaded, before any parallel op) and *forks* the N ranks, which then join a gloo group on
localhost. Each rank writes `rank<r>.pt` (torch.save of the function's return value) into OUT_DIR. A rank
that fails prints its traceback; the others are then stopped (after MT_LAUNCHER_GRACE seconds, default 1, in
which they may report what they saw) and the launcher exits 1.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(fn_name: str, rank: int, world: int, port: int, out_dir: str, kwargs: dict) -> None:
    import torch
    import torch.distributed as dist

    try:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=90),
        )
        import megatron_workers

        result = getattr(megatron_workers, fn_name)(**kwargs)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)


def main() -> int:
    fn_name, world, out_dir, kwargs = sys.argv[1], int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
    import torch

    torch.set_num_threads(1)
    from rlbridge.engines.megatron import compat

    compat.activate()
    import megatron_workers  # noqa: F401  (imported before the fork, like the Megatron stack)

    port = _free_port()
    ctx = mp.get_context("fork")
    procs = [
        ctx.Process(target=_rank_main, args=(fn_name, r, world, port, out_dir, kwargs)) for r in range(world)
    ]
    for p in procs:
        p.start()
    while any(p.is_alive() for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs):
            time.sleep(
                float(os.environ.get("MT_LAUNCHER_GRACE", "1"))
            )  # the failing rank's traceback flushes
            for p in procs:
                if p.is_alive():
                    p.kill()
            return 1
        time.sleep(0.05)
    return 0 if all(p.exitcode == 0 for p in procs) else 1


if __name__ == "__main__":
    sys.exit(main())
