"""The driver's typed handle on the rollout: what the session and the memory machine ask of it, as methods.

`RolloutClient` is the interface. The session (generate, weight loads) and rollout/memory.RolloutMemory (sleep,
wake) call its methods, so the type checker follows every call into the engine's (rollout/base.RolloutEngine).
A call can be sent without waiting (`send_generate`, `send_load_weights`): the answer is a `Sent`, which `wait`
resolves; calls run in the order sent, which is what makes the asynchronous pipeline exact (pipeline.py).

    RayRollout     one rollout engine in a Ray actor (cluster/ray_cluster.Worker); the engine's methods reach Ray
                   by reference (`RolloutEngine.generate`, not "generate").
    LocalRollout   an engine in this process (tests, single-process tools): each call runs when sent.

The interface is the one a group of engines behind one client would offer too: `generate` of many prompt
groups (dispatched to free engines, gathered in prompt order), `load_weights` / `sleep` / `wake_up` to every
engine, one `Sent` standing for the answers of several engines.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar, cast

from rlbridge.batch import Rollouts
from rlbridge.rollout.base import RolloutEngine, SamplingCfg, SleepingRolloutEngine

if TYPE_CHECKING:
    from rlbridge.cluster.ray_cluster import Worker

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


class Sent(Generic[T]):
    """A call sent without waiting for its answer (a T); `RolloutClient.wait` gives it. What it holds is the
    client's own business (a Ray reference; for a group of engines, one per engine)."""

    __slots__ = ("ref",)

    def __init__(self, ref: Any) -> None:
        self.ref = ref


class RolloutClient(ABC):
    """The rollout as the driver sees it. A client says how a call reaches its engine(s) (`_send`, `wait`,
    `kill`); the calls themselves are the same for all. A group of engines overrides the calls it spreads."""

    @abstractmethod
    def _send(self, method: Callable[Concatenate[Any, P], R], *args: P.args, **kwargs: P.kwargs) -> Sent[R]:
        """`method` (a method of RolloutEngine or SleepingRolloutEngine, by reference), without waiting."""

    @abstractmethod
    def wait(self, sent: Sent[T]) -> T:
        """The answer of a call sent earlier (its error, raised here)."""

    @abstractmethod
    def kill(self) -> None:
        """Stop the worker(s) now (any thread): a call waiting on them fails at once."""

    def send_generate(
        self,
        ids: list[list[int]],
        sampling: SamplingCfg,
        *,
        expect_version: int,
        seed: int | None = None,
        group_seeds: list[int] | None = None,
    ) -> Sent[Rollouts]:
        """n completions for each prompt (`ids`: its token ids), grouped by prompt (RolloutEngine.generate),
        without waiting: it runs after every call sent before it, with the weights they loaded. group_seeds: one
        sampling seed per prompt (engines whose spec has seeds_per_group; rollout/group.py)."""
        if group_seeds is None:  # engines without per-prompt seeds take no such argument
            return self._send(RolloutEngine.generate, ids, sampling, expect_version=expect_version, seed=seed)
        return self._send(
            RolloutEngine.generate,
            ids,
            sampling,
            expect_version=expect_version,
            seed=seed,
            group_seeds=group_seeds,
        )

    def generate(
        self,
        ids: list[list[int]],
        sampling: SamplingCfg,
        *,
        expect_version: int,
        seed: int | None = None,
        group_seeds: list[int] | None = None,
    ) -> Rollouts:
        return self.wait(
            self.send_generate(
                ids, sampling, expect_version=expect_version, seed=seed, group_seeds=group_seeds
            )
        )

    def send_load_weights(self, weights: Any, version: int) -> Sent[None]:
        """Sample from `weights` (a WeightExport, or a reference to the one the trainer produces) from now on, as
        weight version `version`; without waiting."""
        return self._send(RolloutEngine.load_weights, weights, version)

    def load_weights(self, weights: Any, version: int) -> None:
        self.wait(self.send_load_weights(weights, version))

    def sleep(self, level: int = 1) -> None:
        """Free the device memory it reserved (colocated GPUs, during the update: rollout/memory.py)."""
        self.wait(self._send(SleepingRolloutEngine.sleep, level))

    def wake_up(self, tags: list[str]) -> None:
        """Re-allocate what sleep freed: 'weights', then 'kv_cache'."""
        self.wait(self._send(SleepingRolloutEngine.wake_up, tags))


class RayRollout(RolloutClient):
    """One rollout engine in a Ray actor. See the module docstring."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def _send(self, method: Callable[Concatenate[Any, P], R], *args: P.args, **kwargs: P.kwargs) -> Sent[R]:
        return Sent(self.worker.submit(method.__name__, *args, **kwargs))

    def wait(self, sent: Sent[T]) -> T:
        return cast(T, self.worker.wait(sent.ref))

    def kill(self) -> None:
        self.worker.kill()


class LocalRollout(RolloutClient):
    """An engine in this process: a call sent runs at once (nothing overlaps in one process), so the order is
    the order sent, as in the Ray actor."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine

    def _send(self, method: Callable[Concatenate[Any, P], R], *args: P.args, **kwargs: P.kwargs) -> Sent[R]:
        """The engine's `method` now; its error is raised here."""
        return Sent(getattr(self.engine, method.__name__)(*args, **kwargs))

    def wait(self, sent: Sent[T]) -> T:
        return cast(T, sent.ref)

    def kill(self) -> None:
        pass
