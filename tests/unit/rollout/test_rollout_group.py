"""rollout/group.RolloutGroup with in-process engines: chunks go to whichever engine is free, come back in the
batch's order, and the samples depend on (seed, group index) only, not on the number of engines; weights and
sleep reach every engine; a failing engine's error is the one raised."""

from __future__ import annotations

from typing import Any

import pytest

from rlbridge.batch import Rollouts
from rlbridge.rollout.base import SamplingCfg
from rlbridge.rollout.client import RolloutClient, Sent
from rlbridge.rollout.group import RolloutGroup, even_chunks, group_seeds, next_chunk

SAMPLING = SamplingCfg(n=2, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=4)


class Engine(RolloutClient):
    """An engine and its client in one: completion j of a prompt is (the prompt's first token, its group seed + j),
    what vLLM's per-request generators make of a seed, without vLLM. A call runs when waited for, in the order
    sent, and is logged."""

    def __init__(self, name: str, log: list[tuple[str, str, Any]]) -> None:
        self.name, self.log, self.version, self.asleep = name, log, 0, False

    def _send(self, method: Any, *args: Any, **kwargs: Any) -> Sent[Any]:
        return Sent((self, method.__name__, args, kwargs))

    def wait(self, sent: Sent[Any]) -> Any:
        _, method, args, kwargs = sent.ref
        self.log.append((self.name, method, args[0] if method == "generate" else args))
        return getattr(self, "_" + method)(*args, **kwargs)

    def kill(self) -> None:
        self.log.append((self.name, "kill", ()))

    def _generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingCfg,
        *,
        expect_version: int,
        seed: int | None = None,
        group_seeds: list[int] | None = None,
    ) -> Rollouts:
        assert expect_version == self.version and group_seeds is not None and len(group_seeds) == len(prompts)
        rows = [
            (p, [p[0], s + j]) for p, s in zip(prompts, group_seeds, strict=True) for j in range(sampling.n)
        ]
        return Rollouts(
            [p for p, _ in rows],
            [r for _, r in rows],
            [[0.0, 0.0]] * len(rows),
            ["length"] * len(rows),
            self.version,
        )

    def _load_weights(self, weights: Any, version: int) -> None:
        if weights == "broken" and self.name == "e1":
            raise RuntimeError("e1: cannot load")
        self.version = version

    def _sleep(self, level: int) -> None:
        self.asleep = True

    def _wake_up(self, tags: list[str] | None) -> None:
        self.asleep = False


def group(num: int, ready: Any = None) -> tuple[RolloutGroup, list[Engine], list[tuple[str, str, Any]]]:
    log: list[tuple[str, str, Any]] = []
    engines = [Engine(f"e{i}", log) for i in range(num)]
    return RolloutGroup(list(engines), seeds_per_group=True, ready=ready), engines, log


PROMPTS = [[100 + i] for i in range(13)]


def test_samples_do_not_depend_on_the_number_of_engines_and_come_back_in_order() -> None:
    one = group(1)[0].generate(PROMPTS, SAMPLING, expect_version=0, seed=7)
    three, _, log = group(3)
    got = three.generate(PROMPTS, SAMPLING, expect_version=0, seed=7)
    assert got.response_ids == one.response_ids and got.prompt_ids == one.prompt_ids
    assert [r[0] for r in got.response_ids] == [100 + i for i in range(13) for _ in range(2)]  # batch order
    seeds = group_seeds(7, 13)
    assert [r[1] for r in got.response_ids[::2]] == seeds
    assert {name for name, method, _ in log if method == "generate"} == {"e0", "e1", "e2"}
    assert sum(size for _, _, size in three.chunks_sent) == 13
    other = group(3)[0].generate(PROMPTS, SAMPLING, expect_version=0, seed=8)
    assert other.response_ids != got.response_ids


def test_group_seeds_are_a_function_of_seed_and_group_index() -> None:
    assert group_seeds(5, 3, start=4) == group_seeds(5, 7)[4:]
    assert len(set(group_seeds(5, 1000))) == 1000
    assert all(0 <= s < 2**31 - 64 for s in group_seeds(123, 100))


def test_a_free_engine_takes_the_next_chunk() -> None:
    """Engine 1 is slow: while its first chunk runs, engine 0 answers and takes every later chunk."""

    def engine0_first(refs: list[Any]) -> list[int]:
        mine = [i for i, ref in enumerate(refs) if ref[0].name == "e0"]
        return mine[:1] or [0]

    g, _, _ = group(2, ready=engine0_first)
    g.generate(PROMPTS, SAMPLING, expect_version=0, seed=1)
    engines = [e for e, _, _ in g.chunks_sent]
    assert engines[:2] == [0, 1] and set(engines[2:]) == {0}, g.chunks_sent


def test_chunks_start_large_and_shrink() -> None:
    sizes, left = [], 64
    while left:
        sizes.append(next_chunk(left, 64, 2))
        left -= sizes[-1]
    assert sizes == [16, 12, 9, 8, 8, 8, 3] and sum(sizes) == 64
    assert next_chunk(64, 64, 1) == 64
    assert even_chunks(5, 2) == [(0, 3), (3, 5)] and even_chunks(1, 3) == [(0, 1)]


def test_async_submit_sends_one_chunk_per_engine_behind_the_loads() -> None:
    g, engines, log = group(2)
    loaded = g.send_load_weights("w1", 1)
    sent = g.send_generate(PROMPTS, SAMPLING, expect_version=1, seed=3)
    assert g.wait(loaded) is None
    got = g.wait(sent)
    assert got.weight_version == 1 and len(got) == 26
    assert [(e, n) for e, _, n in g.chunks_sent] == [(0, 7), (1, 6)]
    assert got.response_ids == group(1)[0].generate(PROMPTS, SAMPLING, expect_version=0, seed=3).response_ids


def test_weights_sleep_and_wake_reach_every_engine() -> None:
    g, engines, log = group(3)
    g.load_weights("w", 4)
    assert [e.version for e in engines] == [4, 4, 4]
    g.sleep(1)
    assert all(e.asleep for e in engines)
    g.wake_up(["weights"])
    assert not any(e.asleep for e in engines)
    g.kill()
    assert [name for name, method, _ in log if method == "kill"] == ["e0", "e1", "e2"]


def test_an_engine_that_fails_raises_its_own_error() -> None:
    g, _, _ = group(2)
    with pytest.raises(RuntimeError, match="e1: cannot load"):
        g.load_weights("broken", 1)
