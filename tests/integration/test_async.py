"""rollout.mode async (rlbridge/pipeline.py, docs/async.md): the schedule, and exact resume.

- In process (no Ray; the trainer and hf rollout the Ray workers hold, called directly): with max_staleness 1
  step j trains on samples of weight version max(j - 2, 0), checked against an independent generation: a
  fresh rollout with the base weights, the step's prompts and its seed, samples exactly step 2's completions
  (rollout_sha); step 1 equals the synchronous loop's step 1.
- `rlbridge train` / `resume` as subprocesses (Ray, hf rollout, hf trainer, LoRA): kill -9 of everything once
  the step-2 checkpoint is complete (step 3's rollouts were in flight and are saved in it), then `resume`: the
  same per-step metrics and final tensors as the uninterrupted async run (tests/integration/test_resume.py's
  comparison and tolerances).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlbridge.loop import train_step
from rlbridge.pipeline import RolloutSource
from rlbridge.recipe.schema import Recipe
from rlbridge.run import checkpoint as ckpt
from rlbridge.run.resume import rollout_seed
from tests.fixtures.local_session import LocalRollout, QueuedRollout, local_session
from tests.fixtures.tiny_llama import build_tiny_llama
from tests.integration import test_resume as tr

pytestmark = [pytest.mark.integration]


def recipe_dict(model_dir: Path, **rollout: Any) -> dict[str, Any]:
    d = tr.recipe(model_dir)
    d["name"] = "async"
    d["rollout"] = {**d["rollout"], "engine": "hf", **rollout}
    d["run"]["health"] = {"max_logprob_diff": None}  # stale samples: the gap includes one update's drift
    return d


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny"))


def run_in_process(
    recipe: Recipe,
    model_dir: Path,
    run_dir: Path,
    steps: int,
    rollout_cls: type[LocalRollout] = LocalRollout,
    after_step: Any = None,
    engines: int = 1,
) -> list[dict[str, Any]]:
    """The loop's order (loop.train): fill the pipeline, then per step train on the step's rollouts and send
    the generations the finished step unlocks. after_step(session, step), if given, runs after each step."""
    run_dir.mkdir(parents=True)
    out = []
    with local_session(recipe, run_dir, model_dir, rollout_cls=rollout_cls, engines=engines) as s:
        source = RolloutSource(s)
        source.fill(0)
        for step in range(1, steps + 1):
            record = train_step(s, step, source=source)
            assert record is not None
            out.append(record)
            source.done(step)
            if after_step is not None:
                after_step(s, step)
            source.fill(step)
    return out


def test_async_trains_step_j_on_version_j_minus_2(model_dir: Path, tmp_path: Path) -> None:
    steps = 3
    a = Recipe.model_validate(recipe_dict(model_dir, mode="async", max_staleness=1))
    got = run_in_process(a, model_dir, tmp_path / "async", steps)
    assert [r["weight_version"] for r in got] == [1, 2, 3]
    assert [r["rollout_version"] for r in got] == [0, 0, 1]
    assert [r["staleness"] for r in got] == [0, 1, 1]

    sync = Recipe.model_validate(recipe_dict(model_dir))
    first = run_in_process(sync, model_dir, tmp_path / "sync", 1)
    assert first[0]["rollout_sha"] == got[0]["rollout_sha"]  # step 1: the same prompts, weights and seed

    # Independent: the base weights (version 0) sample step 2's prompts with step 2's seed -> step 2's completions
    (tmp_path / "fresh").mkdir()
    with local_session(sync, tmp_path / "fresh", model_dir) as s:
        s.sampler.next_indices(sync.data.batch_size)  # step 1's prompts
        rows = s.sampler.next_indices(sync.data.batch_size)
        from rlbridge.loop import rollout_digest

        ro = s.generate([s.train_data.ids[i] for i in rows], seed=rollout_seed(sync.run.seed, 2))
    assert ro.weight_version == 0
    assert rollout_digest(ro) == got[1]["rollout_sha"]


def test_async_with_two_engines_keeps_the_schedule(model_dir: Path, tmp_path: Path) -> None:
    """Two rollout engines behind a RolloutGroup, each running its calls in the order sent (QueuedRollout): every
    generation's chunks and every weight load reach both, so each step trains on samples of the version one engine
    would have given it, all of one batch alike (the group checks it when it gathers the chunks)."""
    a = Recipe.model_validate(recipe_dict(model_dir, mode="async", max_staleness=1))
    seen: list[list[str]] = []

    def pending(s: Any, step: int) -> None:
        seen.append([m for w in s.rollout.engines for m in w.pending()])

    got = run_in_process(
        a, model_dir, tmp_path / "two", 3, rollout_cls=QueuedRollout, after_step=pending, engines=2
    )
    assert [r["weight_version"] for r in got] == [1, 2, 3]
    assert [r["rollout_version"] for r in got] == [0, 0, 1]
    assert [r["staleness"] for r in got] == [0, 1, 1]
    assert (
        seen == [["generate", "load_weights"] * 2] * 3
    )  # each engine: its chunk of the next batch, the load


def test_async_weight_loads_are_sent_unwaited_and_change_no_sample(model_dir: Path, tmp_path: Path) -> None:
    """vLLM resident (no sleep/wake): the step's weight load is queued behind the generation in flight and the
    driver goes on (the update of the next step overlaps load + generation on a GPU); the rollout's order alone
    decides which weights sample what, so every step's completions and versions equal those of loads waited for.
    A load that fails is reported as itself, not as the stale weights the next generation then finds."""
    a = Recipe.model_validate(recipe_dict(model_dir, mode="async", max_staleness=1))
    seen: list[list[str]] = []
    want = run_in_process(a, model_dir, tmp_path / "waited", 3)

    def pending(s: Any, step: int) -> None:
        seen.append(s.rollout.pending())

    got = run_in_process(a, model_dir, tmp_path / "queued", 3, rollout_cls=QueuedRollout, after_step=pending)
    # after step j: generation j+1 (sent after step j-1), then the load of v(j) behind it, both unwaited
    assert seen == [["generate", "load_weights"]] * 3
    for key in ("rollout_sha", "weight_version", "rollout_version", "staleness", "loss"):
        assert [r[key] for r in got] == [r[key] for r in want], key

    class FailingLoad(QueuedRollout):
        def __init__(self, obj: Any) -> None:
            super().__init__(obj)

            def load_weights(weights: Any, version: int) -> None:
                raise RuntimeError(f"disk full while loading v{version}")

            obj.load_weights = load_weights

    with pytest.raises(RuntimeError, match="disk full while loading v1"):
        run_in_process(a, model_dir, tmp_path / "failing", 3, rollout_cls=FailingLoad)


def test_the_last_steps_load_is_waited_for_by_the_loop(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """loop.train waits for the last weight load sent unwaited: one that fails after the last step is reported,
    not left behind when the run ends (no evaluation afterwards would find it)."""
    from rlbridge import loop

    a = Recipe.model_validate(recipe_dict(model_dir, mode="async", max_staleness=1))
    a = a.model_copy(update={"data": a.data.model_copy(update={"val": None})})

    class FailingLast(QueuedRollout):
        def __init__(self, obj: Any) -> None:
            super().__init__(obj)
            load = obj.load_weights

            def load_weights(weights: Any, version: int) -> None:
                if version == a.run.steps:
                    raise RuntimeError(f"disk full while loading v{version}")
                load(weights, version)

            obj.load_weights = load_weights

    def session(recipe: Recipe, plan: Any, run_dir: Path, model_dir: Path) -> Any:
        return local_session(recipe, run_dir, model_dir, rollout_cls=FailingLast)

    monkeypatch.setattr(loop, "Session", session)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with pytest.raises(RuntimeError, match=f"disk full while loading v{a.run.steps}"):
        loop.train(a, None, run_dir, model_dir)  # type: ignore[arg-type]  # no plan: in-process workers


@pytest.mark.slow
def test_kill_9_with_rollouts_in_flight_then_resume_is_exact(model_dir: Path, tmp_path: Path) -> None:
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(recipe_dict(model_dir, mode="async", max_staleness=1)))
    want = tmp_path / "reference"
    rc, out = tr.run(["train", str(recipe_file), "--run-dir", str(want)], tmp_path / "reference.log")
    assert rc == 0, out[-5000:]
    assert [r["staleness"] for r in tr.train_metrics(want)] == [0, 1, 1, 1]

    run_dir, log = tmp_path / "run", tmp_path / "log.txt"
    proc = tr.start(["train", str(recipe_file), "--run-dir", str(run_dir)], log)
    manifest = run_dir / "checkpoints" / "step_000002" / "manifest.json"
    tr.wait_for(manifest.is_file, proc, "the step-2 checkpoint", log)
    tr.kill_everything(proc)
    assert ckpt.verify_checkpoint(manifest.parent) is None
    state = json.loads((manifest.parent / "state.json").read_text())
    assert [(it["step"], it["rollouts"]["weight_version"]) for it in state["inflight"]] == [(3, 1)]

    rc, out = tr.run(["resume", str(run_dir)], log)
    assert rc == 0, out[-5000:]
    assert [r["weight_version"] for r in tr.train_metrics(run_dir)] == [1, 2, 3, 4]
    tr.assert_same_run(run_dir, want)
