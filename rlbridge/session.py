"""Everything a run holds while it trains: data, tokenizer, reward pool, Ray workers, metrics log.

`Session` is a context manager: whatever was started (Ray, the vLLM engine, reward workers) is stopped on
the way out, failure included. The loop (loop.py) only calls its verbs.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.markup import escape

from rlbridge.algo.correction import MismatchNotices
from rlbridge.algo.drift import DriftWatch
from rlbridge.algo.kl_control import kl_controller
from rlbridge.batch import Rollouts
from rlbridge.cluster import logs
from rlbridge.cluster import ray_cluster as rc
from rlbridge.data.datasets import LazyEncoded, PromptSampler, encode_prompts, open_prompts
from rlbridge.data.reward_pool import RewardPool
from rlbridge.engines.registry import trainer_engine
from rlbridge.metrics.log import MetricsLog, console
from rlbridge.model.tokenizer import load_tokenizer
from rlbridge.plan import Plan, resolved_sleep, rollout_sleeps
from rlbridge.recipe.schema import Recipe
from rlbridge.rollout.base import SamplingCfg
from rlbridge.rollout.client import RayRollout, RolloutClient, Sent
from rlbridge.rollout.group import RolloutGroup
from rlbridge.rollout.memory import RolloutMemory
from rlbridge.rollout.registry import rollout_engine
from rlbridge.run import directory as rundir
from rlbridge.run import gpu_faults, stalls
from rlbridge.trainer.client import RayTrainer, Trainer
from rlbridge.trainer.group import TrainerGroup, start_trainer_group
from rlbridge.trainer.role import TrainerRole
from rlbridge.weights import WeightSync


def log(msg: str) -> None:
    console.print(f"[dim]rlbridge[/] {msg}")


def log_plain(text: str) -> None:
    """`log` for text that is not markup: it may quote paths and worker log lines, whose brackets rich would
    read as tags ("[W1201 ... utils.cpp:68]")."""
    log(escape(text))


class Encoded:
    """Prompts with their token ids (after the length filter)."""

    def __init__(self, prompts: list[Any], ids: list[list[int]]) -> None:
        self.prompts, self.ids = prompts, ids


@dataclass
class Workers:
    """What a session trains with: the trainer and the rollout (typed clients), and the rollout's GPU memory."""

    trainer: Trainer
    rollout: RolloutClient
    memory: RolloutMemory


StartWorkers = Callable[["Session"], Workers]
"""Starts a session's workers once its data, rewards and metrics are ready (default: Ray actors)."""


class Session:
    def __init__(
        self,
        recipe: Recipe,
        plan: Plan,
        run_dir: Path,
        model_dir: Path,
        *,
        start_workers: StartWorkers | None = None,
    ) -> None:
        """start_workers: how the trainer and rollout start (default: Ray actors placed as `plan` says;
        tests pass in-process ones, trainer/client.LocalTrainer and rollout/client.LocalRollout)."""
        self.recipe, self.plan, self.run_dir, self.model_dir = recipe, plan, run_dir, model_dir
        self.version = 0
        self._loading: tuple[Sent[None], Any] | None = None
        """A weight load sent without waiting (`sync_weights(background=True)`): its call and the export it loads,
        waited for before the next sync or generation (`wait_loaded`)."""
        self._pg: Any = None
        self._start_workers: StartWorkers = start_workers or Session._start_ray_workers
        self.trainer: Trainer | None = None
        """The trainer's typed client: the hf engine's one worker, or the megatron ranks behind one group."""
        self.rollout: RolloutClient | None = None
        """The rollout's typed client."""
        self.kl_control = kl_controller(recipe.algorithm)
        """PPO's adaptive KL coefficient (algorithm.adaptive_kl_target), or None; checkpointed by run/resume.py."""
        self.mismatch_notices = MismatchNotices()
        """When the loop warns of importance weights outside run.health's limits (not at every step of a long gap)."""
        self.drift = DriftWatch(recipe.run.health.max_logprob_diff_growth)
        """Whether the trainer-vs-rollout log-prob gap grows (run.health.max_logprob_diff_growth); seeded with a
        resumed run's records when the metrics log opens."""
        self.drift_notices = MismatchNotices(
            back="the trainer-vs-rollout log-prob gap is back within run.health.max_logprob_diff_growth"
        )
        self.memory_told: set[str] = set()
        """What the loop has said of the trainer's measured GPU peak against the plan (loop.memory_notice)."""
        self.stall = stalls.from_recipe(
            recipe.run.health,
            lambda msg: log(f"[yellow]warning[/] {escape(msg)}"),
            hint=f" (the workers' logs: {run_dir / 'logs'})",
        )
        """Warns when a phase of a step (generate, update, sync, ...) runs far longer than in earlier steps, with
        its likely cause; stops the run past run.health.stall_stop_s (within the loop's `stall.armed()`)."""
        self.stall.on_stop = self._kill_workers  # ends a driver's wait inside Ray on a stall stop
        self.driver_log = logs.DriverLog(
            rundir.log_file(run_dir, "driver"), show=lambda msg: log(f"[yellow]warning[/] {escape(msg)}")
        )
        self.echo = logs.WarningEcho(
            lambda name, msg: log(f"{escape(name)}: [yellow]warning[/] {escape(msg)}")
        )
        """The workers' own rlbridge warnings, from their log files to the console."""
        self._stack = ExitStack()
        self._start_time = 0.0
        """When the workers were asked for (time.monotonic)."""
        self._multi_node = False
        """The workers run on a cluster of several nodes (cluster.address or cluster.nodes > 1)."""
        self._announced: list[rc.Worker] = []
        """The workers whose start-up gets its own line (the hf trainer, the rollout engines; not megatron ranks)."""
        self._rollout_workers: list[rc.Worker] = []

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Session:
        rundir.write_status(self.run_dir, "running")
        try:
            self._start()
        except (
            BaseException
        ) as e:  # a failed start (a worker that died, a start-up timeout) is cleaned up too
            self.__exit__(type(e), e, e.__traceback__)
            raise
        return self

    def _start(self) -> None:
        r, stack = self.recipe, self._stack
        stack.enter_context(self.driver_log)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.pad_id = (
            self.tokenizer.pad_token_id
            if self.tokenizer.pad_token_id is not None
            else self.tokenizer.eos_token_id
        )
        self.train_data = self._encode(
            open_prompts(r.data.train, r.data, split="train", seed=r.run.seed), "data.train"
        )
        self.val_data = (
            self._encode(open_prompts(r.data.val, r.data, split="val", seed=r.run.seed), "data.val")
            if r.data.val is not None
            else None
        )
        if isinstance(self.val_data, LazyEncoded):  # evaluation reads its first eval_samples prompts: whole
            self.val_data = Encoded(*self.val_data.first(r.run.eval_samples))
        lazy = self.train_data if isinstance(self.train_data, LazyEncoded) else None
        self.sampler = PromptSampler(
            self.train_data.prompts,
            seed=r.run.seed,
            shuffle=r.data.shuffle,
            usable=None if lazy is None else lazy.usable_rows,
            fingerprint_of=None if lazy is None else lazy.source.fingerprint,
        )
        self.rewards = stack.enter_context(
            RewardPool(r.reward, log_file=rundir.log_file(self.run_dir, "reward"))
        )
        self.metrics = MetricsLog(
            self.run_dir,
            r.run.loggers,
            r.run.steps,
            name=self.run_dir.name,
            config=r.model_dump(mode="json"),
            wandb=r.run.wandb,
        )
        stack.callback(self.metrics.close)
        self.drift.seed(self.metrics.history)
        stack.callback(self._stop_workers)
        workers = self._start_workers(self)
        self.trainer, self.rollout, self.memory = workers.trainer, workers.rollout, workers.memory

    def _kill_workers(self) -> None:
        """Kill the trainer and rollout actors (any thread): a call waiting on them fails at once."""
        for w in (self.rollout, self.trainer):
            if w is not None:
                w.kill()

    def _stop_workers(self) -> None:
        for w in (self.rollout, self.trainer):
            if w is not None:
                w.kill()
        rc.shutdown(self._pg)
        from rlbridge.weights.directory import sweep_ram_dirs

        sweep_ram_dirs()  # the killed workers' last weight directories in /dev/shm (540 MB for SmolLM2 merged)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        self._stack.close()  # workers and Ray, metrics, reward workers, the driver's log: in reverse order of start
        rundir.write_status(
            self.run_dir, rundir.exit_state(exc_type), error=None if exc is None else str(exc)[:2000]
        )

    def _encode(self, prompts: Any, key: str) -> Encoded | LazyEncoded:
        r = self.recipe
        if not isinstance(prompts, list):  # read through Hugging Face datasets: encoded when sampled
            if key == "data.train":
                log_plain(f"{prompts.description}: {len(prompts)} rows, read and encoded as they are sampled")
            return LazyEncoded(prompts, self.tokenizer, r.data, r.rollout.max_prompt_tokens)
        ids, kept, filtered = encode_prompts(self.tokenizer, prompts, r.data, r.rollout.max_prompt_tokens)
        if filtered:
            log(
                f"{key}: {filtered} of {len(prompts)} prompts are longer than rollout.max_prompt_tokens "
                f"{r.rollout.max_prompt_tokens} and were left out"
            )
        return Encoded(kept, ids)

    def _start_ray_workers(self) -> Workers:
        r, plan = self.recipe, self.plan
        sleeps = rollout_sleeps(r, plan)
        # the trainer releases torch's cached blocks after each update only for a vLLM that wakes into them:
        # it gets rollout.sleep as the plan decided auto (it has no plan of its own)
        trainer_recipe = r if r.rollout.sleep != "auto" else resolved_sleep(r, sleeps)
        rc.connect(r.cluster, plan, log_plain)
        self.driver_log.apply()  # Ray's loggers, as ray.init left them
        bundles = [b for node in plan.bundles_per_node for b in node] + plan.rollout_bundles
        if r.cluster.address:
            rc.check_nodes(r.cluster)
        self._pg = rc.reserve(
            bundles,
            timeout_s=r.cluster.placement_timeout_s,
            log=log_plain,
            fail_fast=r.cluster.address is None,
        )
        place = self._placement(len(bundles) - len(plan.rollout_bundles))
        if self._multi_node:  # before any worker starts: every node sees the run directory
            rc.check_shared_run_dir(self.run_dir, place.nodes + place.rollout_nodes, log_plain)
        gpu = 1.0 if r.cluster.device == "cuda" else 0.0
        share = 0.5 if r.cluster.colocate else 1.0
        threads = os.cpu_count() or 1
        rollout_threads = threads
        if (
            r.rollout.mode == "async" and r.cluster.device == "cpu"
        ):  # both compute at once: half the cores each
            rollout_threads = max(threads // 2, 1)
            threads = max(threads - rollout_threads, 1)
        log_plain(f"starting the trainer and rollout workers (their output: {self.run_dir / 'logs'})")
        self._start_time = time.monotonic()
        starting: list[tuple[rc.Worker, Any]] = []
        multi_rank = trainer_engine(r).multi_rank
        trainer: rc.Worker | TrainerGroup | None = None
        if not multi_rank:
            trainer = rc.start_worker(
                TrainerRole,
                "trainer",
                self._pg,
                place.slots[0],
                num_cpus=share,
                num_gpus=gpu * share,
                log_file=rundir.log_file(self.run_dir, "trainer"),
                echo=self.echo,
                args=(trainer_recipe, str(self.model_dir)),
                kwargs={"num_threads": threads, **self._prerecord_kwargs()},
                node=self._node(place, 0),
            )
            self._announced = [trainer]
            client = self.trainer = RayTrainer(trainer)  # stopped on the way out even if the start fails
            starting.append((trainer, trainer.send_started()))
        rollout_client, engines = self._start_rollout(place, rollout_threads)
        self.rollout = rollout_client  # stopped on the way out even if the start fails
        self._rollout_workers = engines
        self._announced += engines
        starting += [(w, w.send_started()) for w in engines]
        # colocated GPUs in sync mode, unless rollout.sleep lets vLLM stay resident; async: always resident
        memory = RolloutMemory(rollout_client, enabled=sleeps)
        joins: list[Any] = []
        if multi_rank:  # one actor per rank (bundle i); forms while the rollout loads
            trainer, joins = start_trainer_group(
                trainer_recipe,
                self._pg,
                self.model_dir,
                num_cpus=share,
                num_gpus=gpu * share,
                run_dir=self.run_dir,
                log=log_plain,
                echo=self.echo,
                slots=place.slots,
                nodes=[self._node(place, i) for i in range(r.world_size)],
            )
            client = self.trainer = RayTrainer(trainer)
            starting += list(zip(trainer.ranks, joins, strict=True))
        for worker, _ in starting:  # out of GPU memory: the error names the recipe key to change
            role = "rollout" if any(worker is w for w in engines) else "trainer"
            worker.explain = functools.partial(gpu_faults.explain, role=role, recipe=r, plan=plan)
        answers = rc.wait_started(
            starting, timeout_s=r.cluster.startup_timeout_s, log=log_plain, on_ready=self._started
        )
        if isinstance(trainer, TrainerGroup):
            log(
                f"trainer: {len(joins)} megatron ranks formed, model loaded ({time.monotonic() - self._start_time:.1f} s)"
            )
            trainer.formed(answers[-len(joins) :], log_plain)
        return Workers(client, rollout_client, memory)

    def _start_rollout(self, place: rc.Placement, threads: int) -> tuple[RolloutGroup, list[rc.Worker]]:
        """The plan's rollout engines, each a Ray actor placed as `engine_specs` says. On CPU the engines split
        the cores (they generate at the same time)."""
        r, kind = self.recipe, rollout_engine(self.recipe)
        specs = engine_specs(self.plan, place)
        if r.cluster.device == "cpu":
            threads = max(threads // len(specs), 1)
        workers = [
            rc.start_worker(
                kind.worker(),
                spec.name,
                self._pg,
                spec.bundles[0],
                num_cpus=spec.num_cpus,
                num_gpus=spec.num_gpus,
                log_file=rundir.log_file(self.run_dir, spec.log),
                echo=self.echo,
                args=(str(self.model_dir), r.rollout, r.model),
                kwargs={
                    **kind.worker_kwargs(r, threads),
                    **(spec.parallel if kind.spreads_tensor_parallel else {}),
                },
                node=self._engine_node(place, i),
            )
            for i, spec in enumerate(specs)
        ]
        if len(specs) > 1:
            log_plain(f"rollout: {len(specs)} engines ({'; '.join(self.plan.engine_places())})")
        clients: list[RolloutClient] = [RayRollout(w) for w in workers]
        group = RolloutGroup(clients, seeds_per_group=kind.seeds_per_group, ready=rc.answered)
        return group, workers

    def _engine_node(self, place: rc.Placement, engine: int) -> rc.NodeInfo | None:
        """Rollout engine `engine`'s node, named in its errors (clusters of several nodes only)."""
        if not self._multi_node:
            return None
        if self.plan.colocate:
            return self._node(place, self.plan.rollout_devices[engine][0])
        return place.rollout_nodes[engine] if engine < len(place.rollout_nodes) else None

    def _prerecord_kwargs(self) -> dict[str, Any]:
        """trainer.cuda_graphs: the training prompts' token counts, for the trainer to record the passes they make
        likely while vLLM starts (TrainerRole.prerecord)."""
        if not self.recipe.trainer.cuda_graphs:
            return {}
        data = self.train_data
        if isinstance(data, LazyEncoded):  # a sample, not every row of a large source
            return {"prompt_lengths": [len(ids) for ids in data.first(4096)[1]]}
        return {"prompt_lengths": [len(ids) for ids in data.ids]}

    def _placement(self, num_trainer: int) -> rc.Placement:
        """Where the trainer's devices landed, node by node; printed on a cluster of several nodes, with a warning
        when that differs from the plan's cluster.nodes x cluster.gpus_per_node."""
        place = rc.placement(self._pg, num_trainer)
        c = self.recipe.cluster
        self._multi_node = bool(c.address) or len({n.id for n in place.nodes + place.rollout_nodes}) > 1
        if self._multi_node:
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
        return place.nodes[place.node_of_slot[device]] if self._multi_node else None

    def _started(self, worker: rc.Worker, answer: rc.Started) -> None:
        """The start-up line of the hf trainer or a rollout engine (`Worker.send_started`'s answer): seconds since
        the workers were asked for, of which the Ray worker process took those before its constructor ran; on a
        cluster of several nodes, the Ray node the worker reports it runs on."""
        if not any(worker is w for w in self._announced):
            return  # a megatron rank: the group's line comes once all have formed
        seconds = time.monotonic() - self._start_time
        phases = logs.describe_phases({"ray worker": max(0.0, seconds - answer.seconds), **answer.phases})
        rollout = any(worker is w for w in self._rollout_workers)
        what = rollout_engine(self.recipe).started if rollout else "model loaded"
        gpus = answer.gpus
        where = f" on GPU {', '.join(gpus)}" if gpus and self.recipe.cluster.device == "cuda" else ""
        if self._multi_node and answer.node:  # where Ray put it, as the worker itself reads it
            where += f" (ray node {answer.node[:8]})"
        log_plain(f"{worker.name}: {what}{where} ({seconds:.1f} s: {phases})")

    # ------------------------------------------------------------------ verbs used by the loop
    def started_trainer(self) -> Trainer:
        """The trainer client (the session has started)."""
        assert self.trainer is not None, "the session has not started its workers"
        return self.trainer

    def sampling(self, *, greedy: bool = False, n: int | None = None) -> SamplingCfg:
        """The rollout's sampling (n: samples per prompt, default rollout.n), or greedy decoding."""
        ro = self.recipe.rollout
        return SamplingCfg(
            n=1 if greedy else n or ro.n,
            temperature=0.0 if greedy else ro.temperature,
            top_p=ro.top_p,
            top_k=ro.top_k,
            max_tokens=ro.max_response_tokens,
            greedy=greedy,
            ignore_eos=ro.ignore_eos and not greedy,
        )

    def generate(
        self, ids: list[list[int]], *, greedy: bool = False, seed: int | None = None, n: int | None = None
    ) -> Rollouts:
        """`seed` re-seeds the rollout's sampler first (the loop passes resume.rollout_seed(run.seed, step)); n:
        samples per prompt (default rollout.n; evaluation's pass@k asks for k)."""
        assert self.rollout is not None
        self.wait_loaded()
        return self.rollout.generate(
            ids, self.sampling(greedy=greedy, n=n), expect_version=self.version, seed=seed
        )

    def send_generate(self, ids: list[list[int]], *, seed: int) -> Sent[Rollouts]:
        """`generate` without waiting (rollout.mode async): the rollout runs it with the weights of the last
        load sent before it; `wait_generate` gives the Rollouts."""
        assert self.rollout is not None
        return self.rollout.send_generate(ids, self.sampling(), expect_version=self.version, seed=seed)

    def wait_generate(self, sent: Sent[Rollouts]) -> Rollouts:
        assert self.rollout is not None
        try:
            return self.rollout.wait(sent)
        except Exception:
            # a generation sent after a background load that failed finds the old weights (StaleWeightsError):
            # the load's own error is the one to report
            self.wait_loaded()
            raise

    def loads_initial_adapter(self) -> bool:
        """Whether a fresh run loads the trainer's initial adapter (LoRA B = 0: the base model's outputs) into vLLM
        before its first generation: adapter sync with vLLM on GPUs. vLLM's first generation with an adapter is
        slower than later ones (docs/defaults.md#first-adapter), which otherwise lands in step 3 (the first with
        trained weights); loaded at the start it lands in the warm-up. An adapter vLLM cannot
        load then also fails before any training."""
        r = self.recipe
        return (
            rollout_engine(r).warm_adapter
            and r.rollout.weight_sync == WeightSync.ADAPTER
            and r.cluster.device == "cuda"
        )

    def loads_in_background(self) -> bool:
        """Whether `sync_weights(background=True)` sends the load without waiting: vLLM resident (no sleep or
        wake around the load) and the export not CUDA IPC handles (those are released once loaded)."""
        return not self.memory.enabled and not self._cuda_ipc()

    def _cuda_ipc(self) -> bool:
        """Whether syncs move merged weights by CUDA IPC handles (rollout.weight_transport cuda_ipc)."""
        r = self.recipe.rollout
        return r.weight_sync == WeightSync.MERGED and r.weight_transport == "cuda_ipc"

    def wait_loaded(self) -> None:
        """Wait for a weight load sent in the background; its failure is raised here (the trainer's own error
        when the trainer died exporting)."""
        if self._loading is None:
            return
        (sent, export), self._loading = self._loading, None
        assert self.rollout is not None and self.trainer is not None
        try:
            self.rollout.wait(sent)
        except rc.InputLost:
            self.trainer.raise_if_lost(export)
            raise

    def sync_weights(self, *, version: int | None = None, background: bool = False) -> int:
        """Trainer -> rollout, as recipe.rollout.weight_sync says; returns the bytes moved. The weights get
        the next version number, or `version` (a resume re-sends the checkpoint's weights under their own).

        background (rollout.mode async): where `loads_in_background`, the load is sent behind the generations
        in flight and the driver goes on to the next update at once. The rollout runs its calls in the order sent,
        so every generation sent after this returns samples from these weights, as with a load waited for; the
        load is waited for (and its failure raised) before the next sync or generation. A checkpoint does not wait
        for it: it saves the trainer's weights and their version, and a resume sends them to the rollout again.

        The export travels as a Ray object reference from the trainer straight to the rollout worker:
        the driver never holds (or copies) the weights. With rollout.weight_transport cuda_ipc (merged) it holds
        CUDA IPC handles of tensors the trainer keeps on the GPU: they are released as soon as the rollout has
        loaded them (before vLLM's KV cache wakes), and whatever happens."""
        assert self.trainer is not None and self.rollout is not None
        self.wait_loaded()  # the last one first: a merged export overwrites the file it loads from
        trainer, kind = self.trainer, self.recipe.rollout.weight_sync
        same_node = self.recipe.cluster.nodes == 1 and not self.recipe.cluster.address
        ipc = self._cuda_ipc()
        # an adapter directory is handed over to its receiver, which removes it once read: with several engines
        # the adapter (small) goes through Ray's object store instead, each engine writing its own
        shared_dir = kind == WeightSync.MERGED or self.plan is None or self.plan.rollout_engines == 1
        ref = trainer.export_weights(kind, as_files=same_node and not ipc and shared_dir, cuda_ipc=ipc)
        self.version = self.version + 1 if version is None else version
        rollout, v = self.rollout, self.version
        if background and self.loads_in_background():
            # memory.load only steps its state machine here: nothing sleeps or wakes (loads_in_background)
            self._loading = (self.memory.load(lambda: rollout.send_load_weights(ref, v)), ref)
            return trainer.last_export_bytes()
        held = ipc

        def load() -> None:
            nonlocal held
            try:
                rollout.load_weights(ref, v)
            finally:
                if held:
                    held = False
                    release_export(trainer, failing=sys.exc_info()[0] is not None)

        try:
            self.memory.load(load)
        except (
            rc.InputLost
        ):  # the trainer died while exporting: say so (which rank, which node), not the rollout
            trainer.raise_if_lost(ref)
            raise
        finally:
            if held:  # the load never ran (e.g. vLLM's wake failed)
                release_export(trainer, failing=sys.exc_info()[0] is not None)
        return trainer.last_export_bytes()

    def release_rollout_memory(self) -> None:
        """Colocated GPUs: vLLM sleeps during the update (a no-op on CPU or separate devices)."""
        self.memory.release()

    def rollout_memory_seconds(self) -> dict[str, float]:
        """Colocated GPUs: the seconds vLLM's sleep (inside time_update) and wake-ups (inside time_sync) took
        since the last call, as metrics sleep_s / wake_s; empty elsewhere."""
        return self.memory.take_seconds()


def release_export(trainer: Trainer, *, failing: bool) -> None:
    """trainer.release_export(); while another error is on its way (`failing`), a failure here is only logged, so
    that the error that stopped the sync is the one reported."""
    try:
        trainer.release_export()
    except Exception as e:
        if not failing:
            raise
        log_plain(f"warning: releasing the trainer's CUDA IPC export failed too: {e}")


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
