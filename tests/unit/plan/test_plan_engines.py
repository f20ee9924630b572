"""The plan's rollout engines (plan.rollout_devices) and how the session places them (launch.engine_specs), for
the shipped multi-GPU recipes and the CPU quickstart with engines of its own; pure (no Ray: a Placement is built
by hand, as ray_cluster.placement reads it back)."""

from __future__ import annotations

import pytest

from rlbridge.cluster.ray_cluster import NodeInfo, Placement
from rlbridge.errors import RecipeError
from rlbridge.launch import engine_specs
from rlbridge.model.info import read_model_info
from rlbridge.plan import Plan, make_plan
from rlbridge.recipe import validate_recipe
from rlbridge.recipe.load import load_recipe


def plan_of(recipe: str, *sets: str) -> Plan:
    return make_plan(load_recipe(f"recipes/{recipe}.yaml", list(sets)), None)


def one_node(plan: Plan) -> Placement:
    node = NodeInfo("n0", "192.0.2.1", True, {})
    world = plan.world_size
    return Placement(list(range(world)), [node], [0] * world, [node] * len(plan.rollout_bundles))


def test_colocated_tensor_parallel_engines_span_their_ranks() -> None:
    """qwen2.5-7b: 8 GPUs, rollout.tensor_parallel 2 -> 4 engines, engine i on ranks 2i, 2i+1; each actor on its
    first rank's bundle without a device, vLLM's Ray workers on both bundles with half a GPU each."""
    plan = plan_of("qwen2.5-7b-grpo-lora")
    assert plan.rollout_engines == 4 and plan.rollout_devices == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert plan.rollout_bundles == []
    assert plan.engine_places()[1] == "engine 1: trainer device(s) 2-3 (node 0)"
    specs = engine_specs(plan, one_node(plan))
    assert [s.bundles for s in specs] == plan.rollout_devices
    assert [s.name for s in specs] == [f"rollout engine {i}" for i in range(4)]
    assert all(s.num_gpus == 0.0 and s.num_cpus == 0.5 for s in specs)
    assert specs[3].parallel == {"executor": "ray", "ray_bundles": [6, 7], "ray_gpus_per_worker": 0.5}


def test_two_nodes_keep_each_engine_on_its_ranks_node() -> None:
    """qwen3-30b: 2 nodes x 8 GPUs, rollout.tensor_parallel 4 -> 4 engines, two per node; with Ray's bundles
    interleaved over the nodes, an engine's bundles are still its ranks' (Placement.slots)."""
    plan = plan_of("qwen3-30b-a3b-moe-lora")
    assert plan.rollout_engines == 4 and plan.rollout_tp == 4
    assert [p.split(" (")[1] for p in plan.engine_places()] == ["node 0)", "node 0)", "node 1)", "node 1)"]
    a, b = NodeInfo("a", "192.0.2.1", True, {}), NodeInfo("b", "192.0.2.2", False, {})
    slots = [0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15]  # bundle 2k on node a, 2k+1 on node b
    place = Placement(slots, [a, b], [0] * 8 + [1] * 8, [])
    specs = engine_specs(plan, place)
    assert specs[0].bundles == [0, 2, 4, 6] and specs[2].bundles == [1, 3, 5, 7]


def test_separate_engines_get_bundles_of_their_own() -> None:
    """The CPU quickstart with two engines of its own: bundles 1 and 2 after the trainer's; at tensor_parallel 2 on
    GPUs each engine's one bundle holds 2 GPUs and its actor all of them (vLLM's workers in its processes)."""
    plan = plan_of("quickstart", "cluster.colocate=false", "rollout.gpus=2")
    assert plan.rollout_engines == 2 and plan.rollout_bundles == [{"CPU": 1.0}, {"CPU": 1.0}]
    specs = engine_specs(plan, one_node(plan))
    assert [(s.bundles, s.num_cpus, s.num_gpus, s.parallel) for s in specs] == [
        ([1], 1.0, 0.0, {}),
        ([2], 1.0, 0.0, {}),
    ]
    assert [s.log for s in specs] == ["rollout-engine0", "rollout-engine1"]

    gpu = plan_of("quickstart-gpu", "cluster.colocate=false", "rollout.gpus=6", "rollout.tensor_parallel=3")
    assert gpu.rollout_bundles == [{"GPU": 3.0, "CPU": 3.0}] * 2
    assert gpu.engine_places() == [
        "engine 0: rollout device(s) 0-2 of its own",
        "engine 1: rollout device(s) 3-5 of its own",
    ]
    specs = engine_specs(gpu, one_node(gpu))
    assert [(s.bundles, s.num_gpus, s.parallel) for s in specs] == [
        ([1], 3.0, {"executor": "mp"}),
        ([2], 3.0, {"executor": "mp"}),
    ]


def test_one_engine_keeps_its_old_name() -> None:
    plan = plan_of("quickstart")
    (spec,) = engine_specs(plan, one_node(plan))
    assert (spec.name, spec.log, spec.bundles, spec.num_cpus) == ("rollout", "rollout", [0], 0.5)


def test_engines_sharing_a_device() -> None:
    """rollout.engines_per_device 2 on the one-GPU quickstart: two engines on device 0 beside the trainer, each
    actor with a quarter GPU (the trainer rank holds the other half); their memory counts twice in the plan.
    Separate, both engines in the one rollout bundle, half its GPU each."""
    one = plan_of("quickstart-gpu", "rollout.gpu_memory_utilization=0.3")
    plan = plan_of("quickstart-gpu", "rollout.engines_per_device=2", "rollout.gpu_memory_utilization=0.3")
    assert plan.rollout_engines == 2 and plan.rollout_devices == [[0], [0]] and plan.engines_per_device == 2
    specs = engine_specs(plan, one_node(plan))
    assert [(s.bundles, s.num_cpus, s.num_gpus) for s in specs] == [([0], 0.25, 0.25), ([0], 0.25, 0.25)]
    model = read_model_info(load_recipe("recipes/quickstart-gpu.yaml", []).model.path)
    a = make_plan(load_recipe("recipes/quickstart-gpu.yaml", ["rollout.gpu_memory_utilization=0.3"]), model)
    b = make_plan(
        load_recipe(
            "recipes/quickstart-gpu.yaml",
            ["rollout.engines_per_device=2", "rollout.gpu_memory_utilization=0.3"],
        ),
        model,
    )
    assert a.memory is not None and b.memory is not None and one.rollout_engines == 1
    assert b.memory.rollout_total == pytest.approx(2 * a.memory.rollout_total, abs=2e-3)
    sep = plan_of(
        "quickstart-gpu", "cluster.colocate=false", "rollout.gpus=1", "rollout.engines_per_device=2"
    )
    assert sep.rollout_bundles == [{"GPU": 1.0, "CPU": 1.0}]
    specs = engine_specs(sep, one_node(sep))
    assert [(s.bundles, s.num_cpus, s.num_gpus) for s in specs] == [([1], 0.5, 0.5), ([1], 0.5, 0.5)]


@pytest.mark.parametrize(
    ("sets", "key"),
    [
        (
            ["rollout.engines_per_device=2", "rollout.gpu_memory_utilization=0.6"],
            "rollout.gpu_memory_utilization",
        ),
        (
            ["rollout.engines_per_device=2", "rollout.tensor_parallel=2", "cluster.gpus_per_node=2"],
            "rollout.engines_per_device",
        ),
        (
            [
                "rollout.engines_per_device=2",
                "rollout.gpu_memory_utilization=0.3",
                "rollout.weight_transport=cuda_ipc",
                "rollout.weight_sync=merged",
            ],
            "rollout.engines_per_device",
        ),
    ],
)
def test_engines_per_device_refused_where_they_cannot_share(sets: list[str], key: str) -> None:
    with pytest.raises(RecipeError) as e:
        validate_recipe("recipes/quickstart-gpu.yaml", sets, model_checks=False)
    assert key in [i.key for i in e.value.issues], e.value.issues


def test_max_num_seqs_below_an_engines_rollouts_is_noted() -> None:
    """quickstart-gpu: 8 prompts x 4 samples on one engine; 7B recipe: 32 x 8 over 4 engines = 64 each."""
    note = "generates per step: it generates them in waves"
    assert not any(note in n for n in plan_of("quickstart-gpu", "rollout.max_num_seqs=32").notes)
    assert [n for n in plan_of("quickstart-gpu", "rollout.max_num_seqs=16").notes if note in n] == [
        "rollout.max_num_seqs 16 is below the 32 rollouts each engine generates per step: it generates them in "
        "waves (32 or more decodes them at once)"
    ]
    assert any(
        "the 64 rollouts" in n for n in plan_of("qwen2.5-7b-grpo-lora", "rollout.max_num_seqs=8").notes
    )
    assert not any(note in n for n in plan_of("quickstart-gpu").notes)


def test_a_vllm_key_set_for_another_rollout_engine_is_noted_as_changing_nothing() -> None:
    """rollout.engine hf reads none of vLLM's tuning keys: one set away from its default is noted (not refused: a
    recipe switched to the hf engine for a debugging run keeps its vLLM keys), one at its default is not."""
    hf = ("rollout.engine=hf", "rollout.weight_sync=merged")
    notes = plan_of("quickstart-gpu", *hf, "rollout.enforce_eager=true", "rollout.max_num_seqs=8").notes
    assert [n for n in notes if "changes nothing" in n] == [
        "rollout.gpu_memory_utilization 0.3 changes nothing: rollout.engine hf does not read it (vllm does)",
        "rollout.enforce_eager True changes nothing: rollout.engine hf does not read it (vllm does)",
        "rollout.max_num_seqs 8 changes nothing: rollout.engine hf does not read it (vllm does)",
    ]
    assert not any("waves" in n for n in notes)  # no waves note for a key the engine ignores
    assert not any(
        "changes nothing" in n for n in plan_of("quickstart", *hf, "rollout.float32_head=true").notes
    )
    assert not any(
        "changes nothing" in n for n in plan_of("quickstart-gpu", "rollout.enforce_eager=true").notes
    )
