"""A trainer of several ranks (the megatron engine) as one object that the loop drives like one worker.

Every rank is a Ray actor (`TrainerRank`: a TrainerRole whose engine is built once the ranks have formed
their torch.distributed group) on its own bundle of the plan's placement group, bundle i for global rank i.
Forming the group needs no launcher: rank 0 picks a free port on its node and returns (host, port) to the
driver, which hands it to every rank; each rank then joins torch.distributed (gloo on CPU, NCCL on GPUs)
and builds the megatron engine, which initializes megatron's parallel state from the recipe.

`TrainerGroup` offers what `ray_cluster.Worker` offers (call, submit, kill) for TrainerRole's methods, and
trainer/client.RayTrainer picks, per method, how the ranks' answers combine. Every call goes to every rank
(the engine's methods are collective) and the answer comes from the ranks that hold it:

  call_rows       logprobs, values (PPO's critic): each data-parallel replica computes its share of the
                  rows; the shares, in dp order
  call_metrics    update: each replica trains on its share of every mini-batch (TrainerRole._shard) with the
                  mini-batch's loss normalization, so DP=2 takes the same step as DP=1; metrics are the
                  replicas' mean (their max for *_max)
  call, submit    global rank 0's answer (export_weights: rank 0 holds the full export and, on one node,
                  writes it as files; the other ranks return an empty export)

Arguments are put into Ray's object store once and shared by all ranks.

Waiting is a watchdog, not one blocking get: the driver polls every rank's result, and the first rank that
fails (an exception, or its process dying) stops the call at once with that rank's error. All ranks are
then killed, because the survivors would otherwise wait inside a collective until the distributed timeout.
A call that runs past `cluster.collective_timeout_s` stops the run naming the ranks that did not answer.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from rlbridge.cluster import ray_cluster as rc
from rlbridge.cluster.logs import WarningEcho
from rlbridge.cluster.ray_cluster import Worker, start_worker
from rlbridge.engines.base import RankedEngine
from rlbridge.errors import RlbridgeError
from rlbridge.recipe.schema import Recipe
from rlbridge.run import directory as rundir
from rlbridge.trainer.role import TrainerRole, _mean_metrics

Log = Callable[[str], None]
ADDRESS_TIMEOUT_S = 120.0
FAILURE_GRACE_S = 3.0
"""After a rank fails, how long to collect the other ranks' errors before stopping them all."""


def interface_of(ip: str) -> str | None:
    """The network interface that holds IPv4 address `ip` (Linux), or None. Gloo binds to the address of the
    host name unless GLOO_SOCKET_IFNAME names an interface; where the host name resolves to 127.0.0.1 (common in
    /etc/hosts), ranks on other hosts could not reach it. The node's IP as Ray sees it is the one they reach."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address on this interface
                continue
        if socket.inet_ntoa(packed[20:24]) == ip:
            return name
    return None


@dataclass(frozen=True)
class RankInfo:
    """A rank's answer to `TrainerRank.join`: where it sits in the layout and where it runs."""

    rank: int
    dp: int
    tp: int
    pp: int
    cp: int
    pid: int
    host: str
    node: str
    """Its Ray node id."""
    gloo_if: str | None
    """The network interface gloo uses (CPU), or None."""


class TrainerRank(TrainerRole):
    """One rank of a multi-process trainer, inside a Ray actor. Constructing it is cheap; `join` forms the
    process group and builds the engine (TrainerRole.__init__ then runs, with the engine factory)."""

    def __init__(
        self, recipe: Recipe, model_dir: str, *, rank: int, world: int, num_threads: int | None
    ) -> None:
        self._setup = (recipe, model_dir, rank, world, num_threads)
        if num_threads:
            torch.set_num_threads(num_threads)

    def address(self) -> tuple[str, int]:
        """(host, free port) for the process group's rendezvous; called on rank 0 only."""
        host = rc.node_ip()
        with socket.socket() as s:
            s.bind((host, 0))
            return host, int(s.getsockname()[1])

    def join(self, host: str, port: int, timeout_s: float) -> RankInfo:
        """Join the torch.distributed group, build the engine; returns this rank's coordinates."""
        import torch.distributed as dist

        recipe, model_dir, rank, world, threads = self._setup
        cuda = recipe.cluster.device == "cuda" and torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(0)  # Ray shows each rank only the GPU of its bundle
        os.environ.update(
            RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR=host, MASTER_PORT=str(port)
        )
        gloo_if = os.environ.get("GLOO_SOCKET_IFNAME") or (None if cuda else interface_of(rc.node_ip()))
        # gloo would take the host name's address, often 127.0.0.1: unreachable from other hosts
        if gloo_if and not cuda:
            os.environ["GLOO_SOCKET_IFNAME"] = gloo_if
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            init_method=f"tcp://{host}:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )

        super().__init__(
            recipe, model_dir, num_threads=threads
        )  # the engine registry builds this rank's engine
        self.is_holder = rank == 0
        assert isinstance(self.engine, RankedEngine)
        return RankInfo(
            **self.engine.coordinates(),
            pid=os.getpid(),
            host=rc.node_ip(),
            node=rc.node_id(),
            gloo_if=None if cuda else gloo_if,
        )


class TrainerGroup:
    """The driver's handle on all ranks of a multi-process trainer. See the module docstring."""

    def __init__(self, ranks: list[Worker], *, timeout_s: float) -> None:
        self.ranks = ranks
        self.timeout_s = timeout_s
        self.coords: list[RankInfo] = []
        self._leaders = [0]
        """The lowest global rank of each data-parallel replica, in dp order."""

    def formed(self, coords: list[RankInfo], log: Log) -> None:
        """The ranks' answers to `join`: their coordinates, which name them from now on."""
        self.coords = coords
        num_dp = max(c.dp for c in coords) + 1
        self._leaders = [min(i for i, c in enumerate(coords) if c.dp == d) for d in range(num_dp)]
        for worker, c in zip(self.ranks, coords, strict=True):
            worker.name = f"trainer rank {c.rank} (dp {c.dp}, tp {c.tp}, pp {c.pp})"
            log(
                f"trainer rank {c.rank}: pid {c.pid}, dp {c.dp} tp {c.tp} pp {c.pp}, host {c.host} "
                f"(ray node {c.node[:8]})" + (f", gloo via {c.gloo_if}" if c.gloo_if else "")
            )

    # ------------------------------------------------------------------------------ Worker's interface
    def call(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """`method` on every rank; global rank 0's answer."""
        return self._wait(self._submit_all(method, args, kwargs), method, timeout=timeout)[0]

    def call_rows(self, method: str, *args: Any, **kwargs: Any) -> torch.Tensor:
        """`method` on every rank, each data-parallel replica answering for its share of the rows: the
        shares, concatenated in dp order."""
        results = self._wait(self._submit_all(method, args, kwargs), method)
        return torch.cat([results[i] for i in self._leaders])

    def call_metrics(self, method: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """`method` on every rank; the replicas' metrics averaged (their max for *_max)."""
        results = self._wait(self._submit_all(method, args, kwargs), method)
        return _mean_metrics([results[i] for i in self._leaders])

    def submit(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Runs `method` on every rank and returns a reference to rank 0's result once all have finished,
        so a failed rank surfaces here (the weight export is handed to the rollout by reference: rank 0's
        result is not fetched, it goes from rank 0 to the rollout without passing through the driver)."""
        refs = self._submit_all(method, args, kwargs)
        self._wait(refs, method, fetch=lambda i: i != 0)
        return refs[0]

    def wait(self, ref: Any, timeout: float | None = None) -> Any:
        """A reference from `submit` (rank 0's result): its value, or rank 0's error."""
        return self.ranks[0].wait(ref, timeout=timeout)

    def kill(self) -> None:
        for worker in self.ranks:
            worker.kill()

    # ---------------------------------------------------------------------------------------- internals
    def _submit_all(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        args = tuple(rc.share(a) for a in args)
        kwargs = {k: rc.share(v) for k, v in kwargs.items()}
        return [worker.submit(method, *args, **kwargs) for worker in self.ranks]

    def _wait(
        self,
        refs: list[Any],
        what: str,
        *,
        timeout: float | None = None,
        fetch: Callable[[int], bool] = lambda i: True,
    ) -> list[Any]:
        limit = timeout or self.timeout_s
        deadline = time.monotonic() + limit
        pending = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                names = ", ".join(self.ranks[i].name for i in sorted(pending.values()))
                self.kill()
                raise RlbridgeError(
                    f"{names} did not finish {what} within {limit:.0f} s (a stuck collective?); "
                    "all trainer ranks were stopped (cluster.collective_timeout_s sets the limit)"
                )
            ready = rc.wait_ready(list(pending), num_returns=1, timeout=min(left, 1.0), fetch_local=False)
            for ref in ready:
                i = pending.pop(ref)
                if fetch(i):
                    try:
                        results[i] = self.ranks[i].wait(ref)
                    except RlbridgeError as e:
                        self._fail(what, [str(e)], pending)
        return results

    def _fail(self, what: str, errors: list[str], pending: dict[Any, int]) -> None:
        """Stop every rank and raise. The first error is often a peer's broken collective; the ranks that
        fail within a short grace period are collected too, and a rank that died is named first."""
        ready = (
            rc.wait_ready(list(pending), num_returns=len(pending), timeout=FAILURE_GRACE_S) if pending else []
        )
        for ref in ready:
            try:
                self.ranks[pending[ref]].wait(ref)
            except RlbridgeError as e:
                errors.append(str(e))
        self.kill()
        errors.sort(key=lambda e: " died" not in e)
        others = "".join(f"\n  also: {e.splitlines()[0]}" for e in errors[1:])
        raise RlbridgeError(f"{errors[0]}\n(during {what}; all trainer ranks were stopped){others}")


def start_trainer_group(
    recipe: Recipe,
    pg: Any,
    model_dir: Path,
    *,
    num_cpus: float,
    num_gpus: float,
    run_dir: Path,
    log: Log,
    echo: WarningEcho | None = None,
    slots: list[int] | None = None,
    nodes: list[rc.NodeInfo | None] | None = None,
) -> tuple[TrainerGroup, list[Any]]:
    """One TrainerRank per device of the plan (rank i on bundle i, its output in logs/trainer-rank<i>.log).
    Returns the group and the ranks' `join` calls, which form the process group and build the engine: the
    caller waits for them (ray_cluster.wait_started, beside the rollout's start) and hands the answers to
    `TrainerGroup.formed`. slots: rank i's bundle (ray_cluster.Placement.slots, node by node; default bundle i);
    nodes: rank i's node, named in its errors."""
    world = recipe.world_size
    slots = slots or list(range(world))
    threads = max(1, (os.cpu_count() or 1) // world) if recipe.cluster.device == "cpu" else None
    timeout = recipe.cluster.collective_timeout_s
    ranks = [
        start_worker(
            TrainerRank,
            f"trainer rank {i}",
            pg,
            slots[i],
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            log_file=rundir.log_file(run_dir, f"trainer-rank{i}"),
            echo=echo,
            args=(recipe, str(model_dir)),
            kwargs={"rank": i, "world": world, "num_threads": threads},
            node=nodes[i] if nodes else None,
        )
        for i in range(world)
    ]
    group = TrainerGroup(ranks, timeout_s=timeout)
    log(
        f"starting {world} megatron trainer ranks ({recipe.cluster.device}, "
        f"{'nccl' if recipe.cluster.device == 'cuda' else 'gloo'})"
    )
    host, port = group._wait(
        [ranks[0].submit(TrainerRank.address.__name__)], "the rendezvous address", timeout=ADDRESS_TIMEOUT_S
    )[0]
    log(
        f"rendezvous: tcp://{host}:{port} (rank 0's node{': ' + nodes[0].label() if nodes and nodes[0] else ''})"
    )
    return group, [w.submit(TrainerRank.join.__name__, host, port, timeout) for w in ranks]
