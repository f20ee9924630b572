"""The rollout as the plan lays it out: N engines (one per rollout.tensor_parallel devices) behind one client.

`RolloutGroup` is the driver's rollout client (rollout/client.RolloutClient) whatever the number of engines: it
generates, loads weights and puts to sleep through one client per engine (client.RayRollout over a Ray actor, or
an in-process one in tests), each of which runs its calls in the order they were sent.

Generation. A batch is a list of prompt groups (each prompt is generated rollout.n times). The group cuts it
into chunks of consecutive prompt groups and sends each chunk to an engine as that engine frees up, so an engine
that draws long responses does not hold the others back; the chunks' rollouts are put back in the batch's
order. Chunks start large (half an engine's share) and shrink towards the end of the batch (guided
self-scheduling: `next_chunk`), which keeps most of the batch in big engine calls and the tail balanced.

Samples do not depend on the number of engines or on the chunks. Each prompt group gets its own sampling seed,
`group_seeds(step seed, group index)`, a function of (run.seed, step, group index) only, and vLLM samples each
request from a generator seeded with it (`SamplingParams.seed`; completion j of a group uses seed + j), so a
group's completions are the same in whichever engine and beside whichever other requests it runs (up to the
numerics of the batch it lands in: bit-identical on CPU; on GPUs bf16 kernels may differ by batch
composition). An engine that cannot seed per request (rollout.engine hf: one torch RNG per call, and left
padding that depends on the batch) gets one seed per chunk instead; with one engine that is one chunk and the
step's seed, as before, and with several its samples depend on the split.

Async mode (rollout.mode async) sends a generation without waiting, so no one is there to hand out chunks as
engines free up: `send_generate` splits the batch into one contiguous near-equal chunk per engine at once.
Every engine receives every weight load and every generation's chunk in the order the driver sent them, so
"the weights an engine has when a chunk runs" is still the version of the last load sent before it, and
all of one generation's samples carry that version (checked when the chunks are gathered): the loop's
staleness accounting holds per sample, whatever engine made it.

Weights go to every engine at once (`load_weights`: the same export reference handed to each; they load in
parallel) and sleep / wake_up reach all engines in parallel too. A failure of any engine raises that engine's
error (its name, its node on a cluster of several nodes, the last lines of its log).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

from rlbridge.batch import Rollouts
from rlbridge.rollout.base import SamplingCfg
from rlbridge.rollout.client import RolloutClient, Sent

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")

Ready = Callable[[list[Any]], list[int]]
"""Blocks until at least one of these calls (the engines' Sent.ref) has answered; returns the positions of those
that have (Ray: ray_cluster.answered)."""


def group_seeds(seed: int, num_groups: int, start: int = 0) -> list[int]:
    """The sampling seeds of prompt groups start .. start+num_groups-1 of a generation whose seed is `seed` (the
    loop's resume.rollout_seed(run.seed, step, purpose)): a function of (seed, group index) only. 31 bits, and
    below 2**31 - 64 so that vLLM's seed + j per completion stays a non-negative 32-bit integer."""
    out = []
    for g in range(start, start + num_groups):
        digest = hashlib.sha256(f"rlbridge-group/{seed}/{g}".encode()).digest()
        out.append((int.from_bytes(digest[:4], "little") >> 1) % (2**31 - 64))
    return out


def next_chunk(remaining: int, total: int, num_engines: int) -> int:
    """How many of the `remaining` prompt groups (of `total`) the next engine call takes: all with one engine;
    else half an engine's share of what remains, but not below a quarter of an engine's share of the batch (a
    call of a few requests wastes the engine's batching)."""
    if num_engines <= 1:
        return remaining
    size = max(math.ceil(remaining / (2 * num_engines)), math.ceil(total / (4 * num_engines)), 1)
    return min(remaining, size)


def even_chunks(total: int, num_engines: int) -> list[tuple[int, int]]:
    """[start, stop) of one contiguous near-equal chunk per engine (the first ones one larger), empty ones left
    out."""
    base, extra = divmod(total, num_engines)
    out, start = [], 0
    for e in range(num_engines):
        stop = start + base + (1 if e < extra else 0)
        if stop > start:
            out.append((start, stop))
        start = stop
    return out


def gather(parts: list[Rollouts]) -> Rollouts:
    """Chunks' rollouts, in the order given, as one batch. They must share one weight version: every engine got
    the same loads in the same order before its chunk (see the module docstring)."""
    versions = {p.weight_version for p in parts}
    if len(versions) != 1:
        raise RuntimeError(
            f"the engines generated one batch with different weight versions {sorted(versions)}: a weight load "
            "reached some engines and not others"
        )
    out = Rollouts([], [], [], [], parts[0].weight_version, [])
    for p in parts:
        out.prompt_ids += p.prompt_ids
        out.response_ids += p.response_ids
        out.response_logprobs += p.response_logprobs
        out.finish_reasons += p.finish_reasons
        out.texts += p.texts
        out.routed_experts += p.routed_experts
    return out


@dataclass
class Calls:
    """What a group's Sent holds: each engine's own Sent, in order, and whether it is a generation (gathered)."""

    sent: list[tuple[int, Sent[Any]]]
    generation: bool


class RolloutGroup(RolloutClient):
    """The driver's client of the rollout engines. See the module docstring."""

    def __init__(
        self, engines: list[RolloutClient], *, seeds_per_group: bool, ready: Ready | None = None
    ) -> None:
        """engines: one client per engine; seeds_per_group: the engines sample each prompt group from its own
        seed (RolloutEngineSpec.seeds_per_group); ready: what waits for the first of several calls (default: the
        first in the list, for in-process clients whose calls run when waited for or sent)."""
        if not engines:
            raise ValueError("a rollout group needs at least one engine")
        self.engines = engines
        self.seeds_per_group = seeds_per_group
        self._ready: Ready = ready or (lambda refs: [0])
        self.chunks_sent: list[tuple[int, int, int]] = []
        """(engine, first group, number of groups) of each chunk the last generation sent, in the order sent."""

    @property
    def num_engines(self) -> int:
        return len(self.engines)

    # ------------------------------------------------------------------ generation
    def _send_chunk(
        self,
        engine: int,
        prompt_ids: list[list[int]],
        start: int,
        stop: int,
        sampling: SamplingCfg,
        expect_version: int,
        seed: int | None,
    ) -> Sent[Rollouts]:
        chunk_seed, seeds = seed, None
        if seed is not None and self.seeds_per_group:
            seeds = group_seeds(seed, stop - start, start)
        elif seed is not None and not (start == 0 and stop == len(prompt_ids)):
            chunk_seed = group_seeds(seed, 1, start)[
                0
            ]  # one seed per engine call (the step's for the whole batch)
        self.chunks_sent.append((engine, start, stop - start))
        return self.engines[engine].send_generate(
            prompt_ids[start:stop],
            sampling,
            expect_version=expect_version,
            seed=chunk_seed,
            group_seeds=seeds,
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
        """n completions per prompt, grouped and in the order of `ids` (rows [i*n, (i+1)*n) belong to prompt i),
        the prompts dispatched in chunks to the engines as they free up. The group derives the prompt groups'
        seeds from `seed` itself (`group_seeds` must be None)."""
        assert group_seeds is None, "the group derives the prompt groups' seeds from seed"
        total = len(ids)
        self.chunks_sent = []
        parts: dict[int, Rollouts] = {}
        running: list[tuple[Sent[Rollouts], int, int]] = []  # (call, engine, chunk start)
        free = list(range(self.num_engines))
        start = 0
        while start < total or running:
            while start < total and free:
                size = next_chunk(total - start, total, self.num_engines)
                engine = free.pop(0)
                running.append(
                    (
                        self._send_chunk(engine, ids, start, start + size, sampling, expect_version, seed),
                        engine,
                        start,
                    )
                )
                start += size
            done = set(self._ready([sent.ref for sent, _, _ in running]))
            for sent, engine, at in [running[i] for i in sorted(done)]:
                parts[at] = self.engines[engine].wait(sent)
                free.append(engine)
            running = [item for i, item in enumerate(running) if i not in done]
        return gather([parts[k] for k in sorted(parts)]) if parts else empty(expect_version)

    def send_generate(
        self,
        ids: list[list[int]],
        sampling: SamplingCfg,
        *,
        expect_version: int,
        seed: int | None = None,
        group_seeds: list[int] | None = None,
    ) -> Sent[Rollouts]:
        """`generate` without waiting (rollout.mode async): one contiguous chunk per engine, sent now behind
        whatever each engine was sent before; `wait` gathers them."""
        assert group_seeds is None, "the group derives the prompt groups' seeds from seed"
        self.chunks_sent = []
        calls = [
            (e, self._send_chunk(e, ids, a, b, sampling, expect_version, seed))
            for e, (a, b) in enumerate(even_chunks(len(ids), self.num_engines))
        ]
        return cast(Sent[Rollouts], Sent(Calls(cast(list[tuple[int, Sent[Any]]], calls), generation=True)))

    # ------------------------------------------------------------------ every engine: loads, sleep, wake
    def _send(self, method: Callable[Concatenate[Any, P], R], *args: P.args, **kwargs: P.kwargs) -> Sent[R]:
        """`method` to every engine, in parallel (loads: the same export reference handed to each, which fetches
        it itself; sleep, wake_up)."""
        return Sent(Calls([(e, c._send(method, *args, **kwargs)) for e, c in enumerate(self.engines)], False))

    def wait(self, sent: Sent[T]) -> T:
        """The answer of what was sent: a generation's rollouts gathered in order, else the first engine's answer
        (all alike). The first engine to fail raises its own error, as soon as it fails."""
        calls: Calls = sent.ref
        answers: dict[int, Any] = {}
        running = list(range(len(calls.sent)))  # positions in calls.sent
        while running:
            done = set(self._ready([calls.sent[i][1].ref for i in running]))
            for i in [running[j] for j in sorted(done)]:
                engine, one = calls.sent[i]
                answers[i] = self.engines[engine].wait(one)
            running = [i for j, i in enumerate(running) if j not in done]
        ordered = [answers[i] for i in range(len(calls.sent))]
        if not calls.generation:
            return cast(T, ordered[0] if ordered else None)
        return cast(T, gather(ordered) if ordered else empty(None))

    def kill(self) -> None:
        for c in self.engines:
            c.kill()


def empty(version: int | None) -> Rollouts:
    return Rollouts([], [], [], [], version or 0, [])
