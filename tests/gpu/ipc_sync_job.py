"""The vLLM side of tests/gpu/test_gpu_ipc_sync.py: rlbridge's VllmRollout (weight_sync merged, no LoRA, sleep
mode) in a process of its own, driven by the test (the trainer's process) over a local socket.

    python tests/gpu/ipc_sync_job.py --model-dir DIR --address SOCKET   (authkey: $RLBRIDGE_IPC_JOB_KEY, hex)

CUDA IPC handles open only in another process than the one that made them, as a run's rollout worker is; the
socket carries what a run's Ray calls carry (WeightExport, with the IPC payload as plain data). Requests are
(verb, *args) tuples, each answered with ("ok", value) or ("error", traceback):

    load EXPORT      load_weights(EXPORT) as the next version -> {"sync_s", "version"}
    greedy           greedy completions of the test prompts -> Rollouts as a dict
    sleep LEVEL      sleep(LEVEL)
    wake TAGS        wake_up(TAGS)
    free             the device's free bytes (torch.cuda.mem_get_info)
    stop             shut the engine down and exit

The engine is tests/gpu/vllm_engine_job.start_engine's (bfloat16, the suite's sizes, compiled unless
RLBRIDGE_GPU_TESTS_EAGER=all).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import traceback
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rlbridge.rollout.base import SamplingCfg  # noqa: E402
from tests.gpu.common import P  # noqa: E402
from tests.gpu.vllm_engine_job import free_bytes, make_prompts, start_engine  # noqa: E402

KEY_ENV = "RLBRIDGE_IPC_JOB_KEY"


def serve(conn: Any, model_dir: Path) -> None:
    engine = start_engine(model_dir, "merged")
    rollout = engine.rollout
    prompts = make_prompts(model_dir)
    greedy = SamplingCfg(n=1, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=P.max_tokens, greedy=True)
    conn.send(("ok", {"startup_s": engine.startup_s, "pool_bytes": engine.pool_bytes, "pid": os.getpid()}))
    try:
        while True:
            verb, *args = conn.recv()
            try:
                if verb == "stop":
                    conn.send(("ok", None))
                    return
                if verb == "load":
                    rollout.load_weights(args[0], version=rollout.weight_version + 1)
                    value: Any = {"sync_s": rollout.last_sync_s, "version": rollout.weight_version}
                elif verb == "greedy":
                    out = rollout.generate(prompts, greedy, expect_version=rollout.weight_version)
                    value = dataclasses.asdict(out)
                elif verb == "sleep":
                    value = rollout.sleep(*args)
                elif verb == "wake":
                    value = rollout.wake_up(*args)
                elif verb == "free":
                    value = free_bytes()
                else:
                    raise ValueError(f"unknown request {verb!r}")
                conn.send(("ok", value))
            except Exception:  # the test reports it; the engine stays up for the next request
                conn.send(("error", traceback.format_exc()))
    finally:
        rollout.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--address", required=True, help="a unix socket path to listen on")
    args = ap.parse_args()
    with Listener(args.address, family="AF_UNIX", authkey=bytes.fromhex(os.environ[KEY_ENV])) as listener:
        with listener.accept() as conn:
            serve(conn, Path(args.model_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
