"""Starting a run's workers as Ray actors, placed as the plan lays them out: the trainer (the hf engine's one
worker, or one rank per device of a megatron trainer, formed into a TrainerGroup) and the plan's rollout engines
(`engine_specs`: which placement-group bundles each holds and how it starts its tensor-parallel workers), each
start-up announced with where it landed and what took the time. Session (session.py) calls `start_ray_workers`
once its data, rewards and metrics are ready; tests hand it in-process workers instead (Session's
start_workers). The placement group and the clients are set on the session as they come, so that a start that
fails half-way is stopped with the session.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rich.markup import escape

from rlbridge.cluster import logs
from rlbridge.cluster import ray_cluster as rc
from rlbridge.data.datasets import LazyEncoded
from rlbridge.engines.registry import trainer_engine
from rlbridge.metrics.log import log, log_plain
from rlbridge.plan import Plan, resolved_sleep, rollout_sleeps
from rlbridge.rollout.client import RayRollout, RolloutClient
from rlbridge.rollout.group import RolloutGroup
from rlbridge.rollout.memory import RolloutMemory
from rlbridge.rollout.registry import rollout_engine
from rlbridge.run import directory as rundir
from rlbridge.run import gpu_faults
from rlbridge.trainer.client import RayTrainer, Trainer
from rlbridge.trainer.group import TrainerGroup, start_trainer_group
from rlbridge.trainer.role import TrainerRole

if TYPE_CHECKING:
    from rlbridge.session import Session


@dataclass
class Workers:
    """What a session trains with: the trainer and the rollout (typed clients), and the rollout's GPU memory."""

    trainer: Trainer
    rollout: RolloutClient
    memory: RolloutMemory


StartWorkers = Callable[["Session"], Workers]
"""Starts a session's workers once its data, rewards and metrics are ready (default: Ray actors)."""


def start_ray_workers(s: Session) -> Workers:
    """The session's trainer and rollout as Ray actors (the default StartWorkers)."""
    return RayLaunch(s).start()


class RayLaunch:
    """One start of a session's workers: what it placed where, for the start-up lines and the workers' errors."""

    def __init__(self, s: Session) -> None:
        self.s = s
        self.start_time = 0.0
        """When the workers were asked for (time.monotonic)."""
        self.multi_node = False
        """The workers run on a cluster of several nodes (cluster.address or cluster.nodes > 1)."""
        self.announced: list[rc.Worker] = []
        """The workers whose start-up gets its own line (the hf trainer, the rollout engines; not megatron ranks)."""
        self.rollout_workers: list[rc.Worker] = []

    def start(self) -> Workers:
        """Reserve the placement group, start the trainer and the rollout engines, and wait until all have
        started (out of GPU memory: the error names the recipe key to change)."""
        s = self.s
        r, plan = s.recipe, s.plan
        sleeps = rollout_sleeps(r, plan)
        # the trainer releases torch's cached blocks after each update only for a vLLM that wakes into them:
        # it gets rollout.sleep as the plan decided auto (it has no plan of its own)
        trainer_recipe = r if r.rollout.sleep != "auto" else resolved_sleep(r, sleeps)
        rc.connect(r.cluster, plan, log_plain)
        s.driver_log.apply()  # Ray's loggers, as ray.init left them
        bundles = [b for node in plan.bundles_per_node for b in node] + plan.rollout_bundles
        if r.cluster.address:
            rc.check_nodes(r.cluster)
        s.placement_group = rc.reserve(
            bundles,
            timeout_s=r.cluster.placement_timeout_s,
            log=log_plain,
            fail_fast=r.cluster.address is None,
        )
        place = self._placement(len(bundles) - len(plan.rollout_bundles))
        if self.multi_node:  # before any worker starts: every node sees the run directory
            rc.check_shared_run_dir(s.run_dir, place.nodes + place.rollout_nodes, log_plain)
        gpu = 1.0 if r.cluster.device == "cuda" else 0.0
        share = 0.5 if r.cluster.colocate else 1.0
        threads = os.cpu_count() or 1
        rollout_threads = threads
        if (
            r.rollout.mode == "async" and r.cluster.device == "cpu"
        ):  # both compute at once: half the cores each
            rollout_threads = max(threads // 2, 1)
            threads = max(threads - rollout_threads, 1)
        log_plain(f"starting the trainer and rollout workers (their output: {s.run_dir / 'logs'})")
        self.start_time = time.monotonic()
        starting: list[tuple[rc.Worker, Any]] = []
        multi_rank = trainer_engine(r).multi_rank
        trainer: rc.Worker | TrainerGroup | None = None
        if not multi_rank:
            trainer = rc.start_worker(
                TrainerRole,
                "trainer",
                s.placement_group,
                place.slots[0],
                num_cpus=share,
                num_gpus=gpu * share,
                log_file=rundir.log_file(s.run_dir, "trainer"),
                echo=s.echo,
                args=(trainer_recipe, str(s.model_dir)),
                kwargs={"num_threads": threads, **self._prerecord_kwargs()},
                node=self._node(place, 0),
            )
            self.announced = [trainer]
            client = s.trainer = RayTrainer(trainer)  # stopped on the way out even if the start fails
            starting.append((trainer, trainer.send_started()))
        rollout_client, engines, last_wave = self._start_rollout(place, rollout_threads)
        s.rollout = rollout_client  # stopped on the way out even if the start fails
        starting += last_wave
        # colocated GPUs in sync mode, unless rollout.sleep lets vLLM stay resident; async: always resident
        memory = RolloutMemory(rollout_client, enabled=sleeps)
        joins: list[Any] = []
        if multi_rank:  # one actor per rank (bundle i); forms while the rollout loads
            trainer, joins = start_trainer_group(
                trainer_recipe,
                s.placement_group,
                s.model_dir,
                num_cpus=share,
                num_gpus=gpu * share,
                run_dir=s.run_dir,
                log=log_plain,
                echo=s.echo,
                slots=place.slots,
                nodes=[self._node(place, i) for i in range(r.world_size)],
            )
            client = s.trainer = RayTrainer(trainer)
            starting += list(zip(trainer.ranks, joins, strict=True))
        # out of GPU memory: the error names the recipe key (the engines' explainers: _start_rollout)
        for worker, _ in starting:
            if not any(worker is w for w in engines):
                worker.explain = functools.partial(gpu_faults.explain, role="trainer", recipe=r, plan=plan)
        answers = rc.wait_started(
            starting, timeout_s=r.cluster.startup_timeout_s, log=log_plain, on_ready=self._started
        )
        if isinstance(trainer, TrainerGroup):
            log(
                f"trainer: {len(joins)} megatron ranks formed, model loaded ({time.monotonic() - self.start_time:.1f} s)"
            )
            trainer.formed(answers[-len(joins) :], log_plain)
        return Workers(client, rollout_client, memory)

    def _start_rollout(
        self, place: rc.Placement, threads: int
    ) -> tuple[RolloutGroup, list[rc.Worker], list[tuple[rc.Worker, Any]]]:
        """The plan's rollout engines, each a Ray actor placed as `engine_specs` says, and the start-up calls of
        those not yet waited for. On CPU the engines split the cores (they generate at the same time). Engines
        sharing a device (rollout.engines_per_device k > 1) start in k waves, one engine per device each, every wave
        after the previous one has started: vLLM sizes its KV cache by profiling the device's memory, and counts
        what another engine allocates on the same device meanwhile as its own use (then it finds no memory
        left for the cache)."""
        s = self.s
        r, kind = s.recipe, rollout_engine(s.recipe)
        specs = engine_specs(s.plan, place)
        if r.cluster.device == "cpu":
            threads = max(threads // len(specs), 1)
        waves = s.plan.engines_per_device
        placed: dict[int, rc.Worker] = {}
        starting: list[tuple[rc.Worker, Any]] = []
        for wave in range(waves):
            if starting:
                rc.wait_started(
                    starting, timeout_s=r.cluster.startup_timeout_s, log=log_plain, on_ready=self._started
                )
            wave_workers = {
                i: rc.start_worker(
                    kind.worker(),
                    spec.name,
                    s.placement_group,
                    spec.bundles[0],
                    num_cpus=spec.num_cpus,
                    num_gpus=spec.num_gpus,
                    log_file=rundir.log_file(s.run_dir, spec.log),
                    echo=s.echo,
                    args=(str(s.model_dir), r.rollout, r.model),
                    kwargs={
                        **kind.worker_kwargs(r, threads),
                        **(spec.parallel if kind.spreads_tensor_parallel else {}),
                    },
                    node=self._engine_node(place, i),
                )
                for i, spec in enumerate(specs)
                if i % waves == wave
            }
            placed.update(wave_workers)
            self.rollout_workers += wave_workers.values()
            self.announced += wave_workers.values()
            starting = [(w, w.send_started()) for w in wave_workers.values()]
            # out of GPU memory: the error names the recipe key to change
            for worker in wave_workers.values():
                worker.explain = functools.partial(gpu_faults.explain, role="rollout", recipe=r, plan=s.plan)
        workers = [placed[i] for i in range(len(specs))]
        if len(specs) > 1:
            log_plain(f"rollout: {len(specs)} engines ({'; '.join(s.plan.engine_places())})")
        clients: list[RolloutClient] = [RayRollout(w) for w in workers]
        group = RolloutGroup(clients, seeds_per_group=kind.seeds_per_group, ready=rc.answered)
        return group, workers, starting

    def _engine_node(self, place: rc.Placement, engine: int) -> rc.NodeInfo | None:
        """Rollout engine `engine`'s node, named in its errors (clusters of several nodes only)."""
        s = self.s
        if not self.multi_node:
            return None
        if s.plan.colocate:
            return self._node(place, s.plan.rollout_devices[engine][0])
        return place.rollout_nodes[engine] if engine < len(place.rollout_nodes) else None

    def _prerecord_kwargs(self) -> dict[str, Any]:
        """trainer.cuda_graphs: the training prompts' token counts, for the trainer to record the passes they make
        likely while vLLM starts (TrainerRole.prerecord)."""
        s = self.s
        if not s.recipe.trainer.cuda_graphs:
            return {}
        data = s.train_data
        if isinstance(data, LazyEncoded):  # a sample, not every row of a large source
            return {"prompt_lengths": [len(ids) for ids in data.first(4096)[1]]}
        return {"prompt_lengths": [len(ids) for ids in data.ids]}

    def _placement(self, num_trainer: int) -> rc.Placement:
        """Where the trainer's devices landed, node by node; printed on a cluster of several nodes, with a warning
        when that differs from the plan's cluster.nodes x cluster.gpus_per_node."""
        s = self.s
        place = rc.placement(s.placement_group, num_trainer)
        c = s.recipe.cluster
        self.multi_node = bool(c.address) or len({n.id for n in place.nodes + place.rollout_nodes}) > 1
        if self.multi_node:
            for line in place.describe():
                log_plain(
                    f"placement: {line}"
                    + (" (and their rollout engines)" if line.startswith("node ") and c.colocate else "")
                )
            counts = [place.node_of_slot.count(j) for j in range(len(place.nodes))]
            if c.address and counts != [c.gpus_per_node] * c.nodes:
                log(
                    "[yellow]warning[/] "
                    + escape(
                        f"Ray placed the trainer's devices {counts} per node, not the plan's "
                        f"cluster.nodes {c.nodes} x gpus_per_node {c.gpus_per_node}: the nodes' "
                        "free resources differ from the recipe's"
                    )
                )
        return place

    def _node(self, place: rc.Placement, device: int) -> rc.NodeInfo | None:
        """The node of trainer device `device`, named in its worker's errors (clusters of several nodes only)."""
        return place.nodes[place.node_of_slot[device]] if self.multi_node else None

    def _started(self, worker: rc.Worker, answer: rc.Started) -> None:
        """The start-up line of the hf trainer or a rollout engine (`Worker.send_started`'s answer): seconds since
        the workers were asked for, of which the Ray worker process took those before its constructor ran; on a
        cluster of several nodes, the Ray node the worker reports it runs on."""
        s = self.s
        if not any(worker is w for w in self.announced):
            return  # a megatron rank: the group's line comes once all have formed
        seconds = time.monotonic() - self.start_time
        phases = logs.describe_phases({"ray worker": max(0.0, seconds - answer.seconds), **answer.phases})
        rollout = any(worker is w for w in self.rollout_workers)
        what = rollout_engine(s.recipe).started if rollout else "model loaded"
        gpus = answer.gpus
        where = f" on GPU {', '.join(gpus)}" if gpus and s.recipe.cluster.device == "cuda" else ""
        if self.multi_node and answer.node:  # where Ray put it, as the worker itself reads it
            where += f" (ray node {answer.node[:8]})"
        log_plain(f"{worker.name}: {what}{where} ({seconds:.1f} s: {phases})")


@dataclass(frozen=True)
class EngineSpec:
    """Where one rollout engine's actor goes and what it holds (`engine_specs`)."""

    name: str
    log: str
    """Its log file's role name (logs/<log>.log)."""
    bundles: list[int]
    """Its placement-group bundles; the actor sits on the first."""
    num_cpus: float
    num_gpus: float
    parallel: dict[str, Any]
    """At rollout.tensor_parallel > 1, how the engine starts its workers (VllmRollout's executor, ray_bundles,
    ray_gpus_per_worker); empty at 1."""


def engine_specs(plan: Plan, place: rc.Placement) -> list[EngineSpec]:
    """Each rollout engine of the plan (plan.rollout_devices) as an actor. Colocated, engine i shares its trainer
    devices' bundles (half of each: the trainer rank holds the other half), its actor on the first; at
    rollout.tensor_parallel t > 1 one actor cannot hold t bundles, so the actor takes no device and vLLM starts a
    Ray worker on each bundle (rollout/vllm.py "Tensor parallelism"). Separate, engine i's actor holds the whole
    bundle of t devices reserved for it after the trainer's, and vLLM's workers run in its processes. Engines
    sharing a device (rollout.engines_per_device k) each hold 1/k of what one engine would."""
    gpu = 1.0 if plan.device == "cuda" else 0.0
    tp, num = plan.rollout_tp, len(plan.rollout_devices)
    gpu /= plan.engines_per_device  # rollout.engines_per_device engines share a device (tensor_parallel 1)
    out = []
    for i, bundles in enumerate(engine_bundles(plan, place)):
        name, log = ("rollout", "rollout") if num == 1 else (f"rollout engine {i}", f"rollout-engine{i}")
        if plan.colocate:
            spread = tp > 1
            parallel = (
                {"executor": "ray", "ray_bundles": bundles, "ray_gpus_per_worker": gpu * 0.5}
                if spread
                else {}
            )
            cpus = 0.5 / plan.engines_per_device
            out.append(EngineSpec(name, log, bundles, cpus, 0.0 if spread else gpu * 0.5, parallel))
        else:
            parallel = {"executor": "mp"} if tp > 1 else {}
            out.append(EngineSpec(name, log, bundles, tp / plan.engines_per_device, gpu * tp, parallel))
    return out


def engine_bundles(plan: Plan, place: rc.Placement) -> list[list[int]]:
    """The placement-group bundles of each rollout engine (plan.rollout_devices): colocated, the bundles of its
    trainer devices (Placement.slots, node by node); separate, its one bundle of rollout.tensor_parallel devices
    among those reserved after the trainer's (plan.rollout_bundles)."""
    if plan.colocate:
        return [[place.slots[d] for d in devices] for devices in plan.rollout_devices]
    first = sum(len(node) for node in plan.bundles_per_node)
    return [[first + i // plan.engines_per_device] for i in range(len(plan.rollout_devices))]
