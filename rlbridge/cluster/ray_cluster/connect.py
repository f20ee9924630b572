"""Ray up and down: join the cluster at cluster.address (after checking that something answers there) or start
a local one sized for the plan, with the environment every worker gets; and shut it down."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group

from rlbridge.cluster.logs import tail_text
from rlbridge.errors import RlbridgeError
from rlbridge.plan import Plan
from rlbridge.recipe.schema import ClusterCfg

Log = Callable[[str], None]
CPU_MALLOC = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}
"""glibc malloc in CPU workers: every allocation from one heap that is never handed back. By default each tensor
over 32 MiB (logits, their gradients, merged weights) is a fresh mmap whose pages fault in one by one as they
are first written, and freed memory is returned; on a virtual machine each such fault is expensive. With these:
no fault after the first step, and a faster update (docs/defaults.md#cpu-allocator). A variable
already set in the driver's environment wins."""


def connect(cfg: ClusterCfg, plan: Plan, log: Log) -> None:
    """ray.init: an existing cluster at cfg.address, else a local one sized for the plan. Dashboard off.
    Workers' output stays in their log files (log_to_driver=False)."""
    if ray.is_initialized():
        return
    start = time.monotonic()
    env_vars = {
        k: v
        for k, v in os.environ.items()
        if k.startswith(("VLLM_", "OMP_", "RLBRIDGE_", "HF_", "TRANSFORMERS_", "MALLOC_"))
    }
    if cfg.device == "cpu":
        env_vars.update({k: v for k, v in CPU_MALLOC.items() if k not in env_vars})
    env_vars.setdefault(
        "VLLM_LOGGING_LEVEL", "INFO"
    )  # into the rollout's log file: its load/compile/graph times
    env_vars.setdefault("TQDM_DISABLE", "1")  # no progress bar per weight reload (libraries that honour it)
    env = {"env_vars": env_vars}
    if cfg.address:
        log(f"connecting to the Ray cluster at {cfg.address}")
        _check_reachable(cfg.address)
        try:
            ray.init(address=cfg.address, include_dashboard=False, runtime_env=env, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise RlbridgeError(
                f"cannot join the Ray cluster at cluster.address {cfg.address}: {tail_text(str(e), 3)}"
            ) from None
    else:
        needed_cpu = sum(b.get("CPU", 0) for node in plan.bundles_per_node for b in node) + sum(
            b.get("CPU", 0) for b in plan.rollout_bundles
        )
        gpus = None
        if cfg.device == "cpu":
            gpus = 0
        ray.init(
            num_cpus=max(int(needed_cpu), os.cpu_count() or 1),
            num_gpus=gpus,
            include_dashboard=False,
            runtime_env=env,
            log_to_driver=False,
            configure_logging=False,
        )
    log(f"ray {'connected' if cfg.address else 'started'} ({time.monotonic() - start:.1f} s)")


def _check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """A TCP connection to the head's GCS port, so that an address with nothing behind it fails in seconds with
    what to do (ray.init would retry for a minute and end in a traceback)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise RlbridgeError(
            f"cluster.address {address!r} is not HOST:PORT (the head's `ray start --head --port PORT`)"
        )
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise RlbridgeError(
            f"no Ray cluster at cluster.address {address}: {e.strerror or e}. Start one with "
            f"`ray start --head --port {port}` on {host} (and `ray start --address={address}` on the other "
            "nodes), or fix cluster.address (null starts a local one)"
        ) from None


def shutdown(pg: PlacementGroup | None = None) -> None:
    if pg is not None:
        try:
            remove_placement_group(pg)
        except Exception:  # noqa: BLE001
            pass
    if ray.is_initialized():
        ray.shutdown()
