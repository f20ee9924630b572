"""Ray: connect, reserve the plan's bundles, start workers, and turn worker failures into clear errors.

Placement is computed by plan.py; here it is only realized. Waiting for resources prints what is
missing every few seconds and fails after `cluster.placement_timeout_s` with the numbers; a worker that
dies makes the next call raise with the worker's own error instead of hanging.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlbridge.errors import RlbridgeError
from rlbridge.plan import Plan
from rlbridge.recipe.schema import ClusterCfg

Log = Callable[[str], None]


def connect(cfg: ClusterCfg, plan: Plan, log: Log) -> None:
    """ray.init: an existing cluster at cfg.address, else a local one sized for the plan. Dashboard off."""
    if ray.is_initialized():
        return
    env_vars = {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "OMP_", "RLBRIDGE_", "HF_", "TRANSFORMERS_"))}
    env_vars.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM's INFO/WARNING lines would drown the step lines
    env_vars.setdefault("TQDM_DISABLE", "1")  # no progress bar per weight reload
    env = {"env_vars": env_vars}
    if cfg.address:
        log(f"connecting to the Ray cluster at {cfg.address}")
        ray.init(address=cfg.address, include_dashboard=False, runtime_env=env, log_to_driver=True)
        return
    needed_cpu = sum(b.get("CPU", 0) for node in plan.bundles_per_node for b in node) + sum(b.get("CPU", 0) for b in plan.rollout_bundles)
    gpus = None
    if cfg.device == "cpu":
        gpus = 0
    ray.init(num_cpus=max(int(needed_cpu), os.cpu_count() or 1), num_gpus=gpus, include_dashboard=False,
             runtime_env=env, log_to_driver=True, configure_logging=False)


def _missing(bundles: list[dict[str, float]]) -> str:
    need: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            need[k] = need.get(k, 0) + v
    have = ray.available_resources()
    total = ray.cluster_resources()
    parts = [f"{k}: need {v:g}, available {have.get(k, 0):g} of {total.get(k, 0):g}" for k, v in sorted(need.items())]
    return "; ".join(parts)


def reserve(bundles: list[dict[str, float]], *, timeout_s: float, log: Log, fail_fast: bool = True) -> PlacementGroup:
    """Create a placement group and wait for it, saying what it waits for.

    fail_fast: a plan larger than the whole cluster fails at once (a local cluster cannot grow; an
    autoscaling one, given by cluster.address, may, so there we wait up to the timeout)."""
    total = ray.cluster_resources()
    for key in {k for b in bundles for k in b}:
        if fail_fast and sum(b.get(key, 0) for b in bundles) > total.get(key, 0):
            raise RlbridgeError(f"the cluster can never satisfy the plan: {_missing(bundles)} "
                                "(check cluster.nodes / cluster.gpus_per_node, or cluster.address)")
    pg = placement_group(bundles, strategy="PACK")
    start = time.monotonic()
    while True:
        ready, _ = ray.wait([pg.ready()], timeout=5.0)
        if ready:
            return pg
        waited = time.monotonic() - start
        if waited > timeout_s:
            msg = _missing(bundles)
            remove_placement_group(pg)
            raise RlbridgeError(f"gave up after {waited:.0f} s waiting for Ray resources: {msg} "
                                "(cluster.placement_timeout_s sets the wait)")
        log(f"waiting for Ray resources ({waited:.0f} s): {_missing(bundles)}")


class Worker:
    """One Ray actor with error translation: calls return results or raise RlbridgeError naming the worker."""

    def __init__(self, name: str, handle: Any) -> None:
        self.name = name
        self.handle = handle

    def submit(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.handle, method).remote(*args, **kwargs)

    def call(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        return self.wait(self.submit(method, *args, **kwargs), timeout=timeout)

    def wait(self, ref: Any, timeout: float | None = None) -> Any:
        try:
            return ray.get(ref, timeout=timeout)
        except RayTaskError as e:
            cause = e.cause if isinstance(e.cause, BaseException) else None
            if isinstance(cause, RlbridgeError):
                raise type(cause)(f"{self.name}: {cause}") from None
            raise RlbridgeError(f"{self.name} worker failed: {cause!r}\n{_tail(str(e))}") from None
        except RayActorError as e:
            raise RlbridgeError(f"{self.name} worker died: {_tail(str(e), 6)}") from None
        except GetTimeoutError:
            raise RlbridgeError(f"{self.name} worker did not answer within {timeout} s") from None

    def kill(self) -> None:
        try:
            ray.kill(self.handle, no_restart=True)
        except Exception:  # noqa: BLE001 (already gone)
            pass


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def start_worker(cls: type, name: str, pg: PlacementGroup, bundle: int, *, num_cpus: float, num_gpus: float,
                 args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Worker:
    actor: Any = ray.remote(cls).options(
        name=None, num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0, max_concurrency=1,
        scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle),
    )
    return Worker(name, actor.remote(*args, **(kwargs or {})))


def shutdown(pg: PlacementGroup | None = None) -> None:
    if pg is not None:
        try:
            remove_placement_group(pg)
        except Exception:  # noqa: BLE001
            pass
    if ray.is_initialized():
        ray.shutdown()
