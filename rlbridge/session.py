"""Everything a run holds while it trains: data, tokenizer, reward pool, Ray workers, metrics log.

`Session` is a context manager: whatever was started (Ray, the vLLM engine, reward workers) is stopped on
the way out, failure included. The loop (loop.py) only calls its verbs: generate, sync the weights, release the
rollout's memory. How the workers start and where they are placed is launch.py.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
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
from rlbridge.launch import StartWorkers, start_ray_workers
from rlbridge.metrics.log import MetricsLog, log, log_plain
from rlbridge.model.tokenizer import load_tokenizer
from rlbridge.plan import Plan
from rlbridge.recipe.schema import Recipe
from rlbridge.rollout.base import SamplingCfg
from rlbridge.rollout.client import RolloutClient, Sent
from rlbridge.rollout.registry import rollout_engine
from rlbridge.run import directory as rundir
from rlbridge.run import stalls
from rlbridge.trainer.client import Trainer
from rlbridge.weights import WeightSync


class Encoded:
    """Prompts with their token ids (after the length filter)."""

    def __init__(self, prompts: list[Any], ids: list[list[int]]) -> None:
        self.prompts, self.ids = prompts, ids


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
        self.placement_group: Any = None
        """The Ray placement group the workers were placed in (launch.py), removed on the way out."""
        self._start_workers: StartWorkers = start_workers or start_ray_workers
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
        """What the loop has said of the trainer's measured GPU peak against the plan (health.memory_notice)."""
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
        with ThreadPoolExecutor(1, thread_name_prefix="rlbridge-tokenizer") as pool:
            # transformers' import (seconds) in a thread while ray.init waits on the processes it starts; Ray
            # itself starts from this thread: its processes die with the thread that started them
            tokenizer = pool.submit(load_tokenizer, self.model_dir)
            if self._start_workers is start_ray_workers:
                stack.callback(rc.shutdown)  # Ray down on a failure before the workers' start too
                rc.connect(r.cluster, self.plan, log_plain)
            self.tokenizer = tokenizer.result()
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
        rc.shutdown(self.placement_group)
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
