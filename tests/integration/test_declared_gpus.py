"""Which devices generate and which train, with GPUs declared to a local Ray on CPU (issues 18 and 43).

Ray hands out declared GPUs like real ones: it assigns ids and sets CUDA_VISIBLE_DEVICES in each actor, which is
what puts vLLM and the trainer on their devices on a real machine. The session's own placement code
(ray_cluster.reserve / placement / start_worker, launch.engine_specs, the plan's bundles) places probe actors,
one per trainer rank and one per rollout engine, for several layouts, and what Ray reports (GPU ids, bundle,
node) is compared with the plan's placement (plan.rollout_devices, `rlbridge plan`'s "rollout engines" line):

* colocated, 2 ranks: engine i shares rank i's GPU;
* separate, `rollout.gpus: 2`: two engines, each on a GPU of its own;
* separate, `rollout.gpus: 3` at `rollout.tensor_parallel: 3`: one engine whose actor holds three GPUs (vLLM's
  workers run in its processes);
* colocated, 3 ranks at `rollout.tensor_parallel: 3`: one engine spanning the ranks' bundles; its actor takes no
  GPU and vLLM's Ray workers (probed here, as vLLM's Ray executor places them) get a share of each rank's GPU;
* `rollout.engines_per_device: 2`, colocated on one GPU and separate on one rollout GPU: both engines on the same
  GPU (and, colocated, the trainer's).

The workers' start-up answer carries their GPU ids (printed on the start-up line on GPUs: "rollout engine 1: vLLM
engine up on GPU 2 (...)").
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import ray
from ray.util.placement_group import remove_placement_group

from rlbridge.cluster import ray_cluster as rc
from rlbridge.launch import engine_specs
from rlbridge.model.info import read_model_info
from rlbridge.plan import Plan, make_plan
from rlbridge.recipe.load import load_recipe

pytestmark = [pytest.mark.integration]


class Probe:
    def where(self) -> tuple[list[str], str | None, str]:
        return [str(i) for i in ray.get_gpu_ids()], os.environ.get("CUDA_VISIBLE_DEVICES"), rc.node_id()


@pytest.fixture(scope="module")
def declared_gpus() -> Iterator[None]:
    here = Path(__file__).parent  # the workers import Probe from this file
    path = os.pathsep.join([str(here), str(here.parents[1]), os.environ.get("PYTHONPATH", "")])
    ray.init(
        address="local",
        num_cpus=6,
        num_gpus=6,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    yield
    ray.shutdown()


@dataclass
class Seen:
    plan: Plan
    trainer: list[list[str]]
    """Each trainer rank's GPU ids."""
    trainer_nodes: list[str]
    engines: list[list[str]]
    """Each rollout engine's GPU ids: its actor's, or (spread over trainer bundles) its vLLM workers'."""
    engine_nodes: list[str]
    engine_bundles: list[list[int]]
    trainer_slots: list[int]


def place(tmp: Path, *sets: str) -> Seen:
    r = load_recipe("recipes/quickstart-gpu.yaml", list(sets))
    plan = make_plan(r, read_model_info(r.model.path))
    bundles = [b for node in plan.bundles_per_node for b in node] + plan.rollout_bundles
    pg = rc.reserve(bundles, timeout_s=60, log=print)
    workers: list[rc.Worker] = []
    try:
        where = rc.placement(pg, len(bundles) - len(plan.rollout_bundles))
        share = 0.5 if plan.colocate else 1.0

        def start(name: str, bundle: int, gpus: float, cpus: float) -> rc.Worker:
            w = rc.start_worker(
                Probe, name, pg, bundle, num_cpus=cpus, num_gpus=gpus, log_file=tmp / f"{name}.log"
            )
            workers.append(w)
            return w

        trainer = [start(f"trainer rank {i}", s, share, share) for i, s in enumerate(where.slots)]
        specs = engine_specs(plan, where)
        engines: list[list[rc.Worker]] = []
        for spec in specs:
            actor = start(spec.name, spec.bundles[0], spec.num_gpus, spec.num_cpus)
            if (
                spec.parallel.get("executor") == "ray"
            ):  # vLLM's Ray workers, one per bundle (VLLM_RAY_BUNDLE_INDICES)
                per = float(spec.parallel["ray_gpus_per_worker"])
                engines.append(
                    [start(f"{spec.name} worker {b}", b, per, 0.0) for b in spec.parallel["ray_bundles"]]
                )
                assert spec.num_gpus == 0.0 and actor.call("where", timeout=60)[0] == []
            else:
                engines.append([actor])
        started = [w.wait(w.send_started(), timeout=120) for w in workers]
        seen = {w.name: w.call("where", timeout=60) for w in workers}
    finally:
        for w in workers:
            w.kill()
        remove_placement_group(pg)
    for w, answer in zip(workers, started, strict=True):
        ids, visible, _ = seen[w.name]
        assert answer.gpus == ids and (visible or "") == ",".join(ids), (w.name, answer, ids, visible)
    return Seen(
        plan,
        [seen[w.name][0] for w in trainer],
        [seen[w.name][2] for w in trainer],
        [sorted(g for w in ws for g in seen[w.name][0]) for ws in engines],
        [seen[ws[0].name][2] for ws in engines],
        [s.bundles for s in specs],
        where.slots,
    )


def check_colocated(s: Seen) -> None:
    """Engine i on the GPUs, bundles and node of the trainer devices the plan gives it."""
    assert len(s.engines) == s.plan.rollout_engines
    for i, devices in enumerate(s.plan.rollout_devices):
        assert s.engines[i] == sorted(s.trainer[d][0] for d in devices), (i, s.engines, s.trainer)
        assert s.engine_bundles[i] == [s.trainer_slots[d] for d in devices]
        assert s.engine_nodes[i] == s.trainer_nodes[devices[0]]


def check_separate(s: Seen) -> None:
    """Each engine on plan.rollout_tp GPUs of its own, in its own bundle after the trainer's."""
    trainer = {g for ids in s.trainer for g in ids}
    assert len(s.engines) == s.plan.rollout_engines
    first = len(s.trainer)
    k = s.plan.engines_per_device
    for i, ids in enumerate(s.engines):
        assert len(ids) == s.plan.rollout_tp and not trainer & set(ids), (s.trainer, s.engines)
        assert s.engine_bundles[i] == [first + i // k]
    assert len({g for ids in s.engines for g in ids}) == s.plan.rollout_tp * len(s.engines) // k


def test_colocated_engines_share_their_ranks_gpus(tmp_path: Path, declared_gpus: Any) -> None:
    s = place(tmp_path, "trainer.engine=megatron", "cluster.gpus_per_node=2", "data.batch_size=8")
    assert s.plan.engine_places() == [
        "engine 0: trainer device(s) 0 (node 0)",
        "engine 1: trainer device(s) 1 (node 0)",
    ]
    assert len({g[0] for g in s.trainer}) == 2
    check_colocated(s)


def test_separate_engines_each_get_a_gpu_of_their_own(tmp_path: Path, declared_gpus: Any) -> None:
    s = place(tmp_path, "cluster.colocate=false", "rollout.gpus=2")
    assert s.plan.rollout_engines == 2 and len(s.plan.rollout_bundles) == 2
    check_separate(s)


def test_a_separate_tensor_parallel_engine_holds_all_its_gpus(tmp_path: Path, declared_gpus: Any) -> None:
    s = place(tmp_path, "cluster.colocate=false", "rollout.gpus=3", "rollout.tensor_parallel=3")
    assert s.plan.engine_places() == ["engine 0: rollout device(s) 0-2 of its own"]
    check_separate(s)


def test_a_colocated_tensor_parallel_engine_spans_its_ranks(tmp_path: Path, declared_gpus: Any) -> None:
    s = place(
        tmp_path,
        "trainer.engine=megatron",
        "trainer.parallel.tensor=3",
        "cluster.gpus_per_node=3",
        "rollout.tensor_parallel=3",
    )
    assert s.plan.engine_places() == ["engine 0: trainer device(s) 0-2 (node 0)"]
    check_colocated(s)


def test_two_engines_share_the_trainers_gpu(tmp_path: Path, declared_gpus: Any) -> None:
    s = place(tmp_path, "rollout.engines_per_device=2", "rollout.gpu_memory_utilization=0.3")
    assert s.plan.engine_places() == [
        "engine 0: trainer device(s) 0 (shared by 2 engines) (node 0)",
        "engine 1: trainer device(s) 0 (shared by 2 engines) (node 0)",
    ]
    assert s.engines == [s.trainer[0], s.trainer[0]]
    check_colocated(s)


def test_two_engines_share_a_rollout_gpu_of_their_own(tmp_path: Path, declared_gpus: Any) -> None:
    s = place(
        tmp_path,
        "cluster.colocate=false",
        "rollout.gpus=1",
        "rollout.engines_per_device=2",
        "rollout.gpu_memory_utilization=0.4",
    )
    assert s.plan.rollout_engines == 2 and len(s.plan.rollout_bundles) == 1
    assert s.engines[0] == s.engines[1]
    check_separate(s)
