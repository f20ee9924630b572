"""Every recipe check with a recipe that fails it and one that passes, by key and message."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlbridge.errors import RecipeError
from rlbridge.recipe import validate_recipe

FIX = Path(__file__).resolve().parents[2] / "fixtures" / "configs"
QWEN7B = str(FIX / "qwen2.5-7b-instruct")  # 28 layers, 28 heads, 4 KV heads, dense
MOE = str(FIX / "qwen3-30b-a3b")  # 48 layers, 32 heads, 4 KV heads, 128 experts


FULL_FT_FITS = {"cluster__gpu_memory_gib": 141, "rollout__gpu_memory_utilization": 0.3}
"""Full fine-tuning of base()'s 7B model at tp 2: its Adam state (~45 GiB a device) and a vLLM awake next to it
fit in 141 GiB devices with vLLM at 0.3 of them (at 80 GiB and 0.8 the estimate is 115 GiB)."""
ASYNC = {"rollout__mode": "async", "rollout__gpu_memory_utilization": 0.7}
"""Async mode on base()'s 80 GiB GPUs: vLLM's 56 GiB fit resident next to the trainer's ~16 GiB."""


def base(**over: object) -> dict:
    """A valid megatron recipe on 8 GPUs (tp 2 -> dp 4) that each test breaks in one place."""
    r: dict = {
        "name": "t",
        "model": {"path": QWEN7B, "dtype": "bfloat16"},
        "lora": {"rank": 16, "alpha": 32},
        "trainer": {"engine": "megatron", "parallel": {"tensor": 2}, "micro_batch_size": 2},
        "rollout": {
            "engine": "vllm",
            "n": 4,
            "tensor_parallel": 2,
            "max_prompt_tokens": 512,
            "max_response_tokens": 512,
        },
        "data": {"train": {"path": "builtin:arithmetic"}, "batch_size": 8},
        "reward": {"fn": "arithmetic"},
        "cluster": {"nodes": 1, "gpus_per_node": 8},
    }
    return overridden(r, **over)


def overridden(r: dict, **over: object) -> dict:
    """`r` with each `a__b__c=value` set at r["a"]["b"]["c"] (in place)."""
    for dotted, value in over.items():
        node = r
        *parents, last = dotted.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return r


def check(tmp_path: Path, recipe: dict, *sets: str) -> list[tuple[str, str]]:
    f = tmp_path / "r.yaml"
    f.write_text(yaml.safe_dump(recipe))
    try:
        validate_recipe(f, sets)
    except RecipeError as e:
        return [(i.key, f"{i.message} | {i.fix}") for i in e.issues]
    return []


def keys(issues: list[tuple[str, str]]) -> set[str]:
    return {k for k, _ in issues}


def test_base_recipe_is_valid(tmp_path: Path) -> None:
    assert check(tmp_path, base()) == []


# (description, overrides that break it, expected key, a fragment of the message, overrides that fix it)
CASES = [
    (
        "megatron cannot export DoRA (the first weight sync would fail)",
        {"lora": {"rank": 16, "alpha": 32, "type": "dora"}},
        "lora.type",
        "trainer.engine megatron cannot export DoRA weights",
        {"lora": {"rank": 16, "alpha": 32, "type": "lora"}},
    ),
    (
        "world not divisible by tp*pp*cp",
        {"trainer__parallel": {"tensor": 2, "pipeline": 3}},
        "trainer.parallel.tensor",
        "not divisible",
        {"trainer__parallel": {"tensor": 2, "pipeline": 2}},
    ),
    (
        "layers not divisible by pipeline",
        {"trainer__parallel": {"tensor": 1, "pipeline": 8}},
        "trainer.parallel.pipeline",
        "28 layers",
        {"trainer__parallel": {"tensor": 1, "pipeline": 4}},
    ),
    (
        "layers vs pipeline x virtual",
        {"trainer__parallel": {"tensor": 2, "pipeline": 2, "virtual_pipeline": 4}},
        "trainer.parallel.virtual_pipeline",
        "pipeline 2 x virtual 4",
        {"trainer__parallel": {"tensor": 2, "pipeline": 2, "virtual_pipeline": 7}},
    ),
    (
        "heads vs tp",
        {"trainer__parallel": {"tensor": 8}},
        "trainer.parallel.tensor",
        "4 KV heads",
        {"trainer__parallel": {"tensor": 4}},
    ),
    (
        "expert parallel on a dense model",
        {"trainer__parallel": {"tensor": 2, "expert": 2}},
        "trainer.parallel.expert",
        "dense model",
        {"trainer__parallel": {"tensor": 2, "expert": 1}},
    ),
    (
        "sequence parallel needs tp > 1",
        {"trainer__parallel": {"tensor": 1, "sequence_parallel": True}},
        "trainer.parallel.sequence_parallel",
        "tensor parallel > 1",
        {"trainer__parallel": {"tensor": 2, "sequence_parallel": True}},
    ),
    (
        "virtual pipeline needs pp > 1",
        {"trainer__parallel": {"tensor": 2, "virtual_pipeline": 2}},
        "trainer.parallel.virtual_pipeline",
        "needs pipeline > 1",
        {"trainer__parallel": {"tensor": 2}},
    ),
    (
        "rollout tp does not divide GPUs",
        {"rollout__tensor_parallel": 3},
        "rollout.tensor_parallel",
        "does not divide",
        {"rollout__tensor_parallel": 4},
    ),
    (
        "recompute layers beyond a stage",
        {"trainer__recompute": {"granularity": "full", "method": "uniform", "num_layers": 29}},
        "trainer.recompute.num_layers",
        "28 layers per pipeline stage",
        {"trainer__recompute": {"granularity": "full", "method": "uniform", "num_layers": 28}},
    ),
    (
        "recompute fields without full",
        {"trainer__recompute": {"granularity": "selective", "num_layers": 2}},
        "trainer.recompute.num_layers",
        "only used with granularity full",
        {"trainer__recompute": {"granularity": "selective"}},
    ),
    (
        "mini batch does not divide batch",
        {"data__mini_batch_size": 3},
        "data.mini_batch_size",
        "does not divide batch_size 8",
        {"data__mini_batch_size": 4},
    ),
    (
        "micro batch does not divide per-rank share",
        {"trainer__micro_batch_size": 3},
        "trainer.micro_batch_size",
        "not a multiple of micro_batch_size 3",
        {"trainer__micro_batch_size": 4},
    ),
    (  # the fixed recipe: megatron at pipeline = context = 1 takes the budget
        "token budget on megatron with pipeline parallelism",
        {"trainer__max_tokens_per_micro_batch": 4096, "trainer__parallel": {"tensor": 2, "pipeline": 2}},
        "trainer.max_tokens_per_micro_batch",
        "at pipeline 2 x context 1 sends micro-batches of one fixed shape",
        {"trainer__max_tokens_per_micro_batch": 4096},
    ),
    (
        "token budget on megatron with context parallelism",
        {"trainer__max_tokens_per_micro_batch": 4096, "trainer__parallel": {"tensor": 2, "context": 2}},
        "trainer.max_tokens_per_micro_batch",
        "at pipeline 1 x context 2",
        {"trainer__parallel": {"tensor": 2, "context": 2}},
    ),
    (
        "shared prompts always on megatron",
        {"trainer__shared_prompts": "always"},
        "trainer.shared_prompts",
        "the megatron engine has no shared-prompt passes",
        {"trainer__shared_prompts": "auto"},
    ),
    (
        "shared prompts always with recompute",
        {
            "trainer__shared_prompts": "always",
            "trainer__engine": "hf",
            "trainer__parallel": {},
            "trainer__recompute": {"granularity": "full"},
            "cluster__gpus_per_node": 1,
            "rollout__tensor_parallel": 1,
        },
        "trainer.shared_prompts",
        "recompute (full) drops",
        {
            "trainer__shared_prompts": "always",
            "trainer__engine": "hf",
            "trainer__parallel": {},
            "cluster__gpus_per_node": 1,
            "rollout__tensor_parallel": 1,
        },
    ),
    (
        "cuda graphs on megatron",
        {"trainer__cuda_graphs": True},
        "trainer.cuda_graphs",
        "the megatron engine has no recorded passes",
        {"trainer__cuda_graphs": False},
    ),
    (
        "cuda graphs with recompute and bf16 full fine-tuning",
        {
            "trainer__cuda_graphs": True,
            "trainer__engine": "hf",
            "trainer__parallel": {},
            "trainer__recompute": {"granularity": "full"},
            "lora__rank": 0,
            "cluster__gpus_per_node": 1,
            "rollout__tensor_parallel": 1,
        },
        "trainer.cuda_graphs",
        "full fine-tuning of a bfloat16 model",
        {
            "trainer__cuda_graphs": True,
            "trainer__engine": "hf",
            "trainer__parallel": {},
            "cluster__gpus_per_node": 1,
            "rollout__tensor_parallel": 1,
        },
    ),
    (
        "cuda graphs with bf16 LoRA adapters",
        {
            "trainer__cuda_graphs": True,
            "trainer__engine": "hf",
            "trainer__parallel": {},
            "lora__compute_dtype": "model",
            "cluster__gpus_per_node": 1,
            "rollout__tensor_parallel": 1,
        },
        "trainer.cuda_graphs",
        "lora.compute_dtype model keeps bfloat16 adapters",
        {
            "trainer__cuda_graphs": True,
            "trainer__engine": "hf",
            "trainer__parallel": {},
            "cluster__gpus_per_node": 1,
            "rollout__tensor_parallel": 1,
        },
    ),
    (
        "mini batch does not split over dp",
        {"data__batch_size": 1, "rollout__n": 2},
        "data.mini_batch_size",
        "do not split over 4 data-parallel ranks",
        {"data__batch_size": 2, "rollout__n": 2, "trainer__micro_batch_size": 1},
    ),
    (
        "grpo needs n >= 2",
        {"rollout__n": 1, "trainer__micro_batch_size": 1, "data__batch_size": 8},
        "rollout.n",
        "at least 2",
        {"rollout__n": 2, "trainer__micro_batch_size": 1},
    ),
    (
        "sequence longer than positions",
        {"rollout__max_response_tokens": 32768},
        "rollout.max_response_tokens",
        "exceeds the model's 32768 positions",
        {"rollout__max_response_tokens": 32256, "cluster__gpu_memory_gib": 400},  # 32k-token activations
    ),
    (
        "adapter sync without LoRA",
        {"lora": {"rank": 0}, "rollout__weight_sync": "adapter"},
        "rollout.weight_sync",
        "needs LoRA",
        {"lora": {"rank": 0}, "rollout__weight_sync": "merged", **FULL_FT_FITS},
    ),
    (
        "LoRA rank above vLLM max",
        {"lora": {"rank": 32}, "rollout__weight_sync": "adapter", "rollout__max_lora_rank": 16},
        "lora.rank",
        "greater than rollout.max_lora_rank 16",
        {"lora": {"rank": 32}, "rollout__weight_sync": "adapter", "rollout__max_lora_rank": 32},
    ),
    (
        "mbridge with LoRA",
        {"trainer__bridge": "mbridge"},
        "trainer.bridge",
        "no LoRA",
        {"trainer__bridge": "mbridge", "lora": {"rank": 0}, **FULL_FT_FITS},
    ),
    (
        "unknown LoRA target",
        {"lora": {"rank": 8, "targets": ["linear_qkv", "qkv_proj"]}},
        "lora.targets",
        "qkv_proj",
        {"lora": {"rank": 8, "targets": ["linear_qkv", "o_proj"]}},
    ),
    (
        "canonical targets need canonical_lora",
        {"lora": {"rank": 8, "targets": ["linear_q"]}},
        "lora.targets",
        "canonical_lora",
        {"lora": {"rank": 8, "targets": ["linear_q"], "type": "canonical_lora"}},
    ),
    (
        "reward fn does not import",
        {"reward": {"fn": "no_such_pkg.mod:fn"}},
        "reward.fn",
        "",
        {"reward": {"fn": "gsm8k"}},
    ),
    (
        "data path missing",
        {"data__train": {"path": "/nonexistent/train.jsonl"}},
        "data.train.path",
        "file not found",
        {"data__train": {"path": "builtin:arithmetic"}},
    ),
    (
        "data format unsupported",
        {"data__train": {"path": str(Path("pyproject.toml").resolve())}},
        "data.train.path",
        "unsupported file type '.toml'",
        {"data__train": {"path": "builtin:arithmetic"}},
    ),
    (
        "hf engine with tensor parallel",
        {"trainer__engine": "hf", "cluster__gpus_per_node": 1, "rollout__tensor_parallel": 1},
        "trainer.parallel.tensor",
        "hf engine has no tensor",
        {
            "trainer__engine": "hf",
            "trainer__parallel": {},
            "cluster__gpus_per_node": 1,
            "rollout__tensor_parallel": 1,
        },
    ),
    (
        "sequence parallel on cpu",
        {"trainer__parallel": {"tensor": 2, "sequence_parallel": True}, "cluster__device": "cpu"},
        "trainer.parallel.sequence_parallel",
        "gloo",
        {"trainer__parallel": {"tensor": 2}, "cluster__device": "cpu"},
    ),
    (
        "distributed optimizer on cpu",
        {"trainer__distributed_optimizer": True, "cluster__device": "cpu"},
        "trainer.distributed_optimizer",
        "gloo",
        {"trainer__distributed_optimizer": False, "cluster__device": "cpu"},
    ),
    (
        "ppo on megatron with a pipeline",
        {"algorithm": {"name": "ppo"}, "trainer__parallel": {"tensor": 2, "pipeline": 2}},
        "trainer.parallel.pipeline",
        "PPO's critic on the megatron engine does not support a pipeline",
        {"algorithm": {"name": "ppo"}, "trainer__parallel": {"tensor": 2, "pipeline": 1}},
    ),
    (
        "ppo on megatron with sequence parallel",
        {"algorithm": {"name": "ppo"}, "trainer__parallel": {"tensor": 2, "sequence_parallel": True}},
        "trainer.parallel.sequence_parallel",
        "full hidden states",
        {"algorithm": {"name": "ppo"}, "trainer__parallel": {"tensor": 2}},
    ),
    (
        "adaptive KL needs the KL in the reward",
        {
            "algorithm": {"name": "ppo", "adaptive_kl_target": 6.0, "kl": {"coef": 0.1}},
            "trainer__engine": "hf",
            "trainer__parallel": {},
            "cluster__gpus_per_node": 1,
            "rollout__tensor_parallel": 1,
        },
        "algorithm.adaptive_kl_target",
        "kl.where is loss",
        {
            "algorithm": {"name": "ppo", "adaptive_kl_target": 6.0, "kl": {"coef": 0.1, "where": "reward"}},
            "trainer__engine": "hf",
            "trainer__parallel": {},
            "cluster__gpus_per_node": 1,
            "rollout__tensor_parallel": 1,
            "rollout__gpu_memory_utilization": 0.5,  # the critic is a second 7B copy
        },
    ),
    (
        "context parallel on cpu",
        {"trainer__parallel": {"tensor": 2, "context": 2}, "cluster__device": "cpu"},
        "trainer.parallel.context",
        "Transformer Engine",
        {"trainer__parallel": {"tensor": 2, "context": 1}, "cluster__device": "cpu"},
    ),
    (
        "async with max_staleness 0",
        {**ASYNC, "rollout__max_staleness": 0},
        "rollout.max_staleness",
        "synchronous loop",
        {**ASYNC, "rollout__max_staleness": 1},
    ),
    (
        "async staleness above 1 without an off-policy correction",
        {**ASYNC, "rollout__max_staleness": 2},
        "rollout.max_staleness",
        "off-policy correction",
        {
            **ASYNC,
            "rollout__max_staleness": 2,
            "algorithm": {"name": "grpo", "rollout_correction": {"weights": "token"}},
        },
    ),
    (
        "async with DAPO's dynamic sampling",
        {**ASYNC, "algorithm": {"name": "dapo"}},
        "algorithm.dynamic_sampling",
        "async pipeline",
        {**ASYNC, "algorithm": {"name": "dapo", "dynamic_sampling": False}},
    ),
    (
        "async pipeline deeper than the run",
        {**ASYNC, "rollout__max_staleness": 1, "run__steps": 1},
        "rollout.max_staleness",
        "never overlaps",
        {**ASYNC, "rollout__max_staleness": 1, "run__steps": 2},
    ),
    (
        "async: vLLM resident next to the trainer does not fit",
        {"rollout__mode": "async", "rollout__gpu_memory_utilization": 0.9},
        "rollout.gpu_memory_utilization",
        "resident next to the trainer",
        {"rollout__mode": "async", "rollout__gpu_memory_utilization": 0.5},
    ),
]


@pytest.mark.parametrize(("desc", "bad", "key", "fragment", "good"), CASES, ids=[c[0] for c in CASES])
def test_check_fails_and_passes(
    tmp_path: Path, desc: str, bad: dict, key: str, fragment: str, good: dict
) -> None:
    issues = check(tmp_path, base(**bad))
    assert key in keys(issues), f"{desc}: expected an issue on {key}, got {issues}"
    assert any(fragment in msg for k, msg in issues if k == key), issues
    assert all("fix" not in msg or "| " in msg for _, msg in issues)
    assert check(tmp_path, base(**good)) == [], f"{desc}: the fixed recipe should be valid"


def test_moe_expert_checks(tmp_path: Path) -> None:
    moe = {
        "model": {"path": MOE},
        "lora": {"rank": 8, "targets": ["linear_qkv"]},
        "rollout__tensor_parallel": 4,
        "cluster__gpus_per_node": 8,
    }
    ok = base(**moe, trainer__parallel={"tensor": 1, "expert": 8})
    assert check(tmp_path, ok) == []
    bad_experts = base(**moe, trainer__parallel={"tensor": 1, "expert": 3})
    issues = check(tmp_path, bad_experts)
    assert "trainer.parallel.expert" in keys(issues)
    tp_and_ep = base(
        **moe, trainer__parallel={"tensor": 2, "expert": 8, "sequence_parallel": True}
    )  # 8 ranks per stage hold 8 expert groups
    assert check(tmp_path, tp_and_ep) == []
    # megatron-core trains MoE at TP > 1 only with sequence parallelism (MoELayer.forward raises otherwise)
    no_sp = check(tmp_path, base(**moe, trainer__parallel={"tensor": 2, "expert": 8}))
    assert [k for k, m in no_sp if "sequence parallelism" in m] == ["trainer.parallel.tensor"], no_sp
    # on CPU: no TP > 1 (no reduce-scatter for sequence parallelism); EP 2 is fine
    cpu = base(**moe, trainer__parallel={"tensor": 2, "expert": 2}, cluster__device="cpu")
    cpu_issues = check(tmp_path, cpu)
    assert "CPU/gloo lacks" in dict(cpu_issues)["trainer.parallel.tensor"]
    assert "trainer.parallel.expert" not in dict(cpu_issues)  # EP2 on CPU == EP1 (test_megatron_moe.py)
    bad_group = base(
        **moe, trainer__parallel={"tensor": 1, "pipeline": 2, "expert": 8}
    )  # 4 ranks per stage < 8
    assert "trainer.parallel.expert" in keys(check(tmp_path, bad_group))


def test_missing_model_dir_names_model_path(tmp_path: Path) -> None:
    issues = check(tmp_path, base(model={"path": str(tmp_path / "nope")}))
    assert keys(issues) == {"model.path"}
    assert any("--no-model-checks" in m for _, m in issues)


def test_all_errors_reported_together(tmp_path: Path) -> None:
    bad = base(trainer__micro_batch_size=3, rollout__tensor_parallel=3, reward={"fn": "nopkg:fn"})
    assert {"trainer.micro_batch_size", "rollout.tensor_parallel", "reward.fn"} <= keys(check(tmp_path, bad))


def test_messages_carry_numbers_and_fix(tmp_path: Path) -> None:
    issues = check(tmp_path, base(trainer__micro_batch_size=3))
    msg = dict(issues)["trainer.micro_batch_size"]
    assert "8 sequences per mini-batch" in msg and "set trainer.micro_batch_size to" in msg


def test_moe_expert_lora_checks(tmp_path: Path) -> None:
    moe = {"model": {"path": MOE}, "rollout__tensor_parallel": 4}
    par = {"tensor": 1, "expert": 8}
    experts = {"rank": 8, "targets": ["linear_qkv", "linear_fc1", "linear_fc2"]}
    assert check(tmp_path, base(**moe, lora=experts, trainer__parallel=par)) == []  # merged sync
    adapter = check(
        tmp_path, base(**moe, lora=experts, trainer__parallel=par, rollout__weight_sync="adapter")
    )
    assert keys(adapter) == {"rollout.weight_sync"} and "SkyRL #1852" in adapter[0][1]
    attention_only = {"rank": 8, "targets": ["linear_qkv", "linear_proj"]}
    assert (
        check(
            tmp_path, base(**moe, lora=attention_only, trainer__parallel=par, rollout__weight_sync="adapter")
        )
        == []
    )
    # vLLM's CPU build cannot run an MoE model with LoRA enabled at all
    cpu = base(**moe, lora=attention_only, trainer__parallel={"tensor": 1}, rollout__weight_sync="adapter")
    cpu["cluster"]["device"] = "cpu"
    assert "Triton" in dict(check(tmp_path, cpu))["rollout.weight_sync"]
    hf = {"engine": "hf", "parallel": {"tensor": 1}, "micro_batch_size": 2}
    bad = {"rank": 8, "dropout": 0.1, "type": "dora", "targets": ["gate_proj"]}
    issues = check(
        tmp_path,
        base(model={"path": MOE}, lora=bad, trainer=hf, rollout__tensor_parallel=1, cluster__gpus_per_node=1),
    )
    assert {"lora.dropout", "lora.type", "lora.targets"} <= keys(issues), issues


def test_routing_replay_checks(tmp_path: Path) -> None:
    moe = {
        "model": {"path": MOE},
        "rollout__gpu_memory_utilization": 0.7,
        "rollout__tensor_parallel": 4,
        "trainer__parallel": {"tensor": 1, "expert": 8},
    }
    on = {"rollout__routing_replay": True}
    assert check(tmp_path, base(**moe, **on)) == []  # vLLM on GPUs returns the routed experts
    dense = check(tmp_path, base(**on))
    assert keys(dense) == {"rollout.routing_replay"} and "no routed experts" in dense[0][1]
    cpu = base(**moe, **on, cluster__device="cpu")
    cpu["trainer"]["parallel"] = {"tensor": 1}
    issues = check(tmp_path, cpu)
    assert "Model Runner V2" in dict(issues)["rollout.routing_replay"], issues
    cpu["rollout"]["engine"] = "hf"
    assert check(tmp_path, cpu) == []  # transformers rollouts record the routing on any device


def ipc_recipe(**over: object) -> dict:
    """The accepted cuda_ipc recipe: hf trainer on one GPU, vLLM colocated at tensor_parallel 1, merged sync."""
    r = base(rollout__weight_transport="cuda_ipc", rollout__tensor_parallel=1, cluster__gpus_per_node=1)
    r["trainer"] = {"engine": "hf", "micro_batch_size": 2}
    return overridden(r, **over)


# (overrides that break the cuda_ipc recipe, the key its issue must name)
IPC_REFUSED = [
    ({"cluster__device": "cpu"}, "cluster.device"),
    ({"cluster__colocate": False}, "cluster.colocate"),
    ({"cluster__nodes": 2}, "cluster.nodes"),
    ({"cluster__address": "10.0.0.1:6379"}, "cluster.address"),
    ({"rollout__engine": "hf"}, "rollout.engine"),
    ({"rollout__weight_sync": "adapter"}, "rollout.weight_sync"),
    ({"rollout__tensor_parallel": 2}, "rollout.tensor_parallel"),
    ({"cluster__gpus_per_node": 2, "trainer__engine": "megatron"}, "cluster.gpus_per_node"),
]


def test_cuda_ipc_accepted(tmp_path: Path) -> None:
    assert check(tmp_path, ipc_recipe()) == []
    megatron_one_gpu = ipc_recipe(trainer={"engine": "megatron", "micro_batch_size": 2})
    assert check(tmp_path, megatron_one_gpu) == []


@pytest.mark.parametrize(("bad", "key"), IPC_REFUSED, ids=[k for _, k in IPC_REFUSED])
def test_cuda_ipc_refused(tmp_path: Path, bad: dict, key: str) -> None:
    issues = [(k, msg) for k, msg in check(tmp_path, ipc_recipe(**bad)) if "weight_transport" in msg]
    assert keys(issues) == {key}, issues
    assert all("rollout.weight_transport: files" in msg for _, msg in issues)


# ------------------------------------------------------------------ recipes that validated and failed later
WRITTEN = """\
name: t
model: {path: smollm2-135m-instruct, dtype: float32}
trainer:
  engine: hf
  optim: {lr: 2.0e-4}
rollout:
  n: 4
  temperature: 1.0
  max_prompt_tokens: 128
  max_response_tokens: 48
algorithm: {name: grpo}
data:
  train: {path: "builtin:arithmetic"}
  batch_size: 8
  template: "{prompt} Put the final answer after '####'."
reward:
  terms:
    - {fn: arithmetic, weight: 1.0}
    - {fn: format, weight: 0.2}
run: {steps: 30}
cluster: {nodes: 1, gpus_per_node: 1, device: cpu}
"""
"""A valid CPU recipe written out, so that each case below can assert the YAML line its issue points at."""
TEMPLATE = "template: \"{prompt} Put the final answer after '####'.\""

# (id, a line of WRITTEN, what replaces it, --set overrides, expected key, expected where, a fragment of the fix)
LIED = [
    ("lr inf", "lr: 2.0e-4", "lr: .inf", (), "trainer.optim.lr", "r.yaml:5", "finite number"),
    ("lr nan", "lr: 2.0e-4", "lr: .nan", (), "trainer.optim.lr", "r.yaml:5", "finite number"),
    ("lr negative", "lr: 2.0e-4", "lr: -1.0e-4", (), "trainer.optim.lr", "r.yaml:5", "> 0"),
    ("lr inf by --set", "", "", ("trainer.optim.lr=.inf",), "trainer.optim.lr",
     "--set trainer.optim.lr=.inf", "finite number"),
    ("steps 1e23 (a string to YAML)", "steps: 30", "steps: 1e23", (), "run.steps", "r.yaml:20",
     "whole number"),
    ("steps 10^23", "steps: 30", "steps: 100000000000000000000000", (), "run.steps", "r.yaml:20",
     "<= 2147483647"),
    ("steps 1.0e+23", "steps: 30", "steps: 1.0e+23", (), "run.steps", "r.yaml:20", "<= 2147483647"),
    ("prompt tokens 10^23", "max_prompt_tokens: 128", "max_prompt_tokens: 100000000000000000000000", (),
     "rollout.max_prompt_tokens", "r.yaml:9", "<= 2147483647"),
    ("prompt tokens past the model's positions", "max_prompt_tokens: 128", "max_prompt_tokens: 10000", (),
     "rollout.max_prompt_tokens", "r.yaml:9", "set rollout.max_prompt_tokens <= 8144"),
    ("temperature 0 under GRPO", "temperature: 1.0", "temperature: 0", (), "rollout.temperature", "r.yaml:8",
     "set rollout.temperature: 1.0"),
    ("template with literal braces", TEMPLATE, """template: '{prompt} Reply as {"answer": 1}.'""", (),
     "data.template", "r.yaml:15", '{prompt} Reply as {{"answer": 1}}.'),
    ("template with a lone brace", TEMPLATE, "template: '{prompt} }'", (), "data.template", "r.yaml:15",
     "{prompt} }}"),
    ("template naming a field the rows lack", TEMPLATE, "template: '{prompt} {hint}'", (), "data.template",
     "r.yaml:15", "question"),
    ("template with literal braces by --set", "", "", ("""data.template={prompt} Reply as {"answer": 1}.""",),
     "data.template", """--set data.template={prompt} Reply as {"answer": 1}.""", '{{"answer": 1}}'),
    ("--set past the end of a list", "", "", ("reward.terms.5.weight=0.5",), "reward.terms.5",
     "--set reward.terms.5.weight=0.5", "reward.terms.2"),
    ("--set a list by name", "", "", ("reward.terms.weight=0.5",), "reward.terms.weight",
     "--set reward.terms.weight=0.5", "reward.terms.0.weight"),
    ("--set below a value", "", "", ("run.steps.x=1",), "run.steps.x", "--set run.steps.x=1", "run.steps"),
    ("--set an unknown section", "", "", ("optim.lr=.inf",), "optim", "--set optim.lr=.inf", "allowed keys"),
    ("--set a wrong value in a list", "", "", ("reward.terms.1.weight=heavy",), "reward.terms.1.weight",
     "--set reward.terms.1.weight=heavy", "number"),
    ("--set a data file without the prompt column", "", "", ("data.train.path=ROWS",), "data.columns.prompt",
     "--set data.train.path=ROWS", "problem, solution"),
    ("a data file without the prompt column, a --set elsewhere", '{path: "builtin:arithmetic"}', "{path: ROWS}",
     ("run.steps=5", "data.train.limit=1"), "data.columns.prompt", "r.yaml:13", "problem, solution"),
    ("--set a data file the template's field is not in", TEMPLATE, "template: '{prompt} {hint}'",
     ("data.train.path=QA",), "data.template", "--set data.train.path=QA", "{answer}, {prompt}, {question}"),
]  # fmt: skip
"""ROWS and QA stand for data files the test writes: rows of problem and solution (no `question`, the default prompt
column), and of question and answer."""


def written(tmp_path: Path, old: str = "", new: str = "") -> Path:
    assert old in WRITTEN
    f = tmp_path / "r.yaml"
    f.write_text(WRITTEN.replace(old, new, 1) if old else WRITTEN)
    return f


def test_written_recipe_is_valid(tmp_path: Path) -> None:
    validate_recipe(written(tmp_path))


@pytest.mark.parametrize(
    ("desc", "old", "new", "sets", "key", "where", "fix"), LIED, ids=[c[0] for c in LIED]
)
def test_refused_with_key_line_and_fix(
    tmp_path: Path, desc: str, old: str, new: str, sets: tuple[str, ...], key: str, where: str, fix: str
) -> None:
    files = {"ROWS": tmp_path / "rows.jsonl", "QA": tmp_path / "qa.jsonl"}
    files["ROWS"].write_text('{"problem": "1+1?", "solution": "2"}\n')
    files["QA"].write_text('{"question": "1+1?", "answer": "2"}\n')
    for name, path in files.items():
        new = new.replace(f"path: {name}", f"path: {path}")
        sets = tuple(s.replace(f"path={name}", f"path={path}") for s in sets)
        where = where.replace(f"path={name}", f"path={path}")
    with pytest.raises(RecipeError) as e:
        validate_recipe(written(tmp_path, old, new), sets)
    found = {i.key: i for i in e.value.issues}
    assert key in found, f"{desc}: expected an issue on {key}, got {[str(i) for i in e.value.issues]}"
    issue = found[key]
    assert issue.where is not None and issue.where.endswith(where), str(issue)
    assert issue.fix is not None and fix in issue.fix, str(issue)


TRAIN = '  train: {path: "builtin:arithmetic"}'
"""WRITTEN's data.train line (13), which each SELECTED case replaces."""

# (id, what replaces TRAIN, --set overrides, expected key, expected where, a fragment of the fix)
SELECTED = [
    ("--set split to rows without the prompt column", "  train: {path: DICT}", ("data.train.split=test",),
     "data.columns.prompt", "--set data.train.split=test", "problem, solution"),
    ("split in the file to rows without the prompt column", "  train:\n    path: DICT\n    split: test", (),
     "data.columns.prompt", "r.yaml:15", "problem, solution"),
    ("split in the file, a --set elsewhere", "  train:\n    path: DICT\n    split: test",
     ("run.steps=5", "data.train.limit=1"), "data.columns.prompt", "r.yaml:15", "problem, solution"),
    ("--set split to rows the template's field is not in", "  train: {path: DICT}\n  template: '{prompt} ({question})'",
     ("data.train.split=test", "data.train.prompt_key=problem", "data.train.answer_key=solution"), "data.template",
     "--set data.train.split=test", "{problem}"),
    ("--set split to conversations under chat_template false", "  train: {path: DICT}\n  chat_template: false",
     ("data.train.split=chat",), "data.chat_template", "--set data.train.split=chat", "data.chat_template: true"),
    ("--set split to rows with no usable row", "  train: {path: DICT}", ("data.train.split=empty",),
     "data.train.path", "--set data.train.split=empty", "fix the rows"),
    ("--set a split the source lacks", "  train: {path: DICT}", ("data.train.split=dev",), "data.train.split",
     "--set data.train.split=dev", "train, test"),
    ("--set path to a source without the file's split", "  train:\n    path: DICT\n    split: test",
     ("data.train.path=TRAIN_ONLY",), "data.train.split", "--set data.train.path=TRAIN_ONLY", "train"),
    ("a split the source lacks in the file", "  train:\n    path: DICT\n    split: dev", (), "data.train.split",
     "r.yaml:15", "train, test"),
    ("--set config of a save_to_disk folder", "  train: {path: DICT}", ("data.train.config=main",),
     "data.train.config", "--set data.train.config=main", "remove data.train.config"),
    ("config of a save_to_disk folder in the file", "  train:\n    path: DICT\n    config: main", (),
     "data.train.config", "r.yaml:15", "remove data.train.config"),
    ("--set split of a saved Dataset (one split)", "  train: {path: ONE}", ("data.train.split=test",),
     "data.train.split", "--set data.train.split=test", "remove data.train.split"),
    ("--set config of a folder of data files", "  train: {path: FOLDER}", ("data.train.config=main",),
     "data.train.config", "--set data.train.config=main", "remove data.train.config"),
    ("--set split of a .jsonl file", "  train: {path: QA}", ("data.train.split=test",), "data.train.split",
     "--set data.train.split=test", "remove data.train.split"),
    ("--set config of a .jsonl file", "  train: {path: QA}", ("data.train.config=main",), "data.train.config",
     "--set data.train.config=main", "remove data.train.config"),
    ("config of a .json file in the file", "  train:\n    path: QA_JSON\n    config: main", (),
     "data.train.config", "r.yaml:15", "remove data.train.config"),
    ("--set split of builtin:arithmetic", TRAIN, ("data.train.split=test",), "data.train.split",
     "--set data.train.split=test", "remove data.train.split"),
    ("config of builtin:arithmetic in the file", '  train: {path: "builtin:arithmetic", config: main}', (),
     "data.train.config", "r.yaml:13", "remove data.train.config"),
]  # fmt: skip
"""DICT, ONE, TRAIN_ONLY and FOLDER stand for `datasets` sources the test writes (`sources`); QA and QA_JSON for a
.jsonl and a .json file of question and answer rows."""


def sources(tmp_path: Path) -> dict[str, Path]:
    """save_to_disk folders: DICT (train: question/answer, test: problem/solution, chat: conversations, empty:
    rows with empty prompts), TRAIN_ONLY (a DatasetDict of train only), ONE (a Dataset); FOLDER, a folder of
    data files (train.jsonl, test.jsonl); QA and QA_JSON, single files."""
    import json

    datasets = pytest.importorskip("datasets")
    qa = [{"question": f"{i} + 1?", "answer": str(i + 1)} for i in range(3)]
    chat = [{"question": [{"role": "user", "content": r["question"]}], "answer": r["answer"]} for r in qa]
    d = datasets.Dataset.from_list
    out = {n: tmp_path / n.lower() for n in ("DICT", "TRAIN_ONLY", "ONE", "FOLDER")}
    datasets.DatasetDict(
        {
            "train": d(qa),
            "test": d([{"problem": r["question"], "solution": r["answer"]} for r in qa]),
            "chat": d(chat),
            "empty": d([{"question": " ", "answer": "1"}]),
        }
    ).save_to_disk(str(out["DICT"]))
    datasets.DatasetDict({"train": d(qa)}).save_to_disk(str(out["TRAIN_ONLY"]))
    d(qa).save_to_disk(str(out["ONE"]))
    out["FOLDER"].mkdir()
    for name in ("train", "test"):
        (out["FOLDER"] / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in qa))
    out["QA"], out["QA_JSON"] = tmp_path / "qa.jsonl", tmp_path / "qa.json"
    out["QA"].write_text("".join(json.dumps(r) + "\n" for r in qa))
    out["QA_JSON"].write_text(json.dumps(qa))
    return out


@pytest.mark.parametrize(
    ("desc", "train", "sets", "key", "where", "fix"), SELECTED, ids=[c[0] for c in SELECTED]
)
def test_data_selection_blames_the_key_that_chose_the_rows(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    desc: str,
    train: str,
    sets: tuple[str, ...],
    key: str,
    where: str,
    fix: str,
) -> None:
    """An issue about a split's rows (or the split, or its config) is put on the `--set` that chose them: the
    split, the config or the path, whichever was set last; without one, on the recipe line of the key, or (a key
    the file does not write) of the split's most specific key the file writes."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    # longest names first: TRAIN_ONLY before TRAIN-free names, QA_JSON before QA
    for name, path in sorted(sources(tmp_path).items(), key=lambda item: -len(item[0])):
        train = train.replace(name, str(path))
        sets = tuple(s.replace(f"={name}", f"={path}") for s in sets)
        where = where.replace(f"={name}", f"={path}")
    f = tmp_path / "r.yaml"
    text = WRITTEN.replace(TRAIN, train, 1)
    if "\n  template:" in train:  # the case's template replaces WRITTEN's
        text = text.replace(f"\n  {TEMPLATE}", "", 1)
    f.write_text(text)
    with pytest.raises(RecipeError) as e:
        validate_recipe(f, sets)
    found = {i.key: i for i in e.value.issues}
    assert key in found, f"{desc}: expected an issue on {key}, got {[str(i) for i in e.value.issues]}"
    issue = found[key]
    assert issue.where is not None and issue.where.endswith(where), str(issue)
    assert issue.fix is not None and fix in issue.fix, str(issue)


def test_set_indexes_lists(tmp_path: Path) -> None:
    valid = validate_recipe(written(tmp_path), ["reward.terms.0.weight=0.5", "reward.terms.1.fn=arithmetic"])
    assert [(t.fn, t.weight) for t in valid.recipe.reward.resolved_terms()] == [
        ("arithmetic", 0.5),
        ("arithmetic", 0.2),
    ]
    appended = validate_recipe(written(tmp_path), ["reward.terms.2.fn=format"]).recipe.reward.resolved_terms()
    assert [t.fn for t in appended] == ["arithmetic", "format", "format"]


def test_temperature_zero_is_fine_without_groups(tmp_path: Path) -> None:
    f = written(tmp_path, "temperature: 1.0", "temperature: 0")
    issues = check(tmp_path, yaml.safe_load(f.read_text()) | {"algorithm": {"name": "ppo"}})
    assert "rollout.temperature" not in keys(issues)


def test_dataset_rows_are_read_at_validation(tmp_path: Path) -> None:
    rows = tmp_path / "train.jsonl"
    rows.write_text('{"problem": "1+1?", "solution": "2"}\n{"problem": "2+2?", "solution": "4"}\n')
    f = written(tmp_path, '{path: "builtin:arithmetic"}', f"{{path: {rows}}}")
    with pytest.raises(RecipeError) as e:
        validate_recipe(f)
    found = {i.key: i for i in e.value.issues}
    assert set(found) == {"data.columns.prompt"}, [str(i) for i in e.value.issues]  # the default column
    issue = found["data.columns.prompt"]
    assert issue.where == f"{f}:13" and "'question'" in issue.message and "line 1" in issue.message
    assert issue.fix is not None and "problem" in issue.fix and "solution" in issue.fix
    fixed = validate_recipe(f, ["data.train.prompt_key=problem", "data.train.answer_key=solution"])
    assert fixed.recipe.data.train.prompt_key == "problem"
    template = check(
        tmp_path,
        yaml.safe_load(f.read_text()) | {"data": {"train": {"path": str(rows), "prompt_key": "problem",
                                                            "answer_key": "solution"}, "template": "{prompt} {hint}"}},
    )  # fmt: skip
    assert keys(template) == {"data.template"} and "line 1" in template[0][1] and "hint" in template[0][1]


def test_memory_over_the_device_is_an_error_unless_forced(tmp_path: Path) -> None:
    full_ft_one_gpu = base(
        lora={"rank": 0},
        trainer__parallel={"tensor": 1},
        rollout__tensor_parallel=1,
        cluster__gpus_per_node=1,
    )
    issues = check(tmp_path, full_ft_one_gpu)
    assert keys(issues) == {"cluster.gpu_memory_gib"}, issues
    message, fix = issues[0][1].split(" | ")
    assert "GiB" in message and "80 GiB" in message
    assert "lora.rank" in fix and "--force" in fix
    f = tmp_path / "r.yaml"
    valid = validate_recipe(f, force=True)  # the estimate may be wrong: --force trains anyway
    assert valid.recipe.lora.rank == 0


def test_schema_and_check_problems_reported_together(tmp_path: Path) -> None:
    """A value the schema refuses (a list item among them) does not hide the checks' problems: those keys are
    dropped (their whole list for an item) and the checks run on the rest."""
    sets = (
        "trainer.optim.lr=.inf",
        "trainer.optim.betas=[0.9,1.5]",
        "rollout.temperature=0",
        "run.steps=1e23",
    )
    with pytest.raises(RecipeError) as e:
        validate_recipe(written(tmp_path), sets)
    assert {i.key for i in e.value.issues} == {
        "trainer.optim.lr",
        "trainer.optim.betas.1",
        "rollout.temperature",
        "run.steps",
    }
    assert all(i.where is not None and i.where.startswith("--set ") and i.fix for i in e.value.issues)


def test_gemma3_is_refused_by_megatron_with_the_reason_and_trains_on_hf(tmp_path: Path) -> None:
    """Megatron-Bridge's Gemma 3 layers exist only as Transformer Engine modules (engines/megatron/spec.py,
    REFUSED_MODELS); the hf engine trains it, LoRA included (its projections have the Llama names)."""
    gemma = {
        "model": {"path": "gemma3-270m", "dtype": "float32"},
        "rollout__tensor_parallel": 1,
        "cluster__gpus_per_node": 1,
        "cluster__device": "cpu",
        "data__batch_size": 2,
    }
    issues = check(tmp_path, base(**gemma, trainer={"engine": "megatron"}))
    assert keys(issues) == {"trainer.engine"}, issues
    message = dict(issues)["trainer.engine"]
    assert "Gemma3ForCausalLM" in message and "Transformer Engine" in message, message
    assert "sliding-window attention" in message and "set trainer.engine: hf" in message, message
    assert check(tmp_path, base(**gemma, trainer={"engine": "hf"})) == []
    # its sliding-window layers: the packed passes refused here, not when the engine loads the model
    issues = check(tmp_path, base(**gemma, trainer={"engine": "hf", "packed_passes": True}))
    assert keys(issues) == {"trainer.packed_passes"}, issues
    message = dict(issues)["trainer.packed_passes"]
    assert "15 of 18 layers with sliding-window attention" in message and "packed_passes: false" in message


@pytest.mark.parametrize(
    "config, sliding",
    [
        ({"layer_types": ["sliding_attention", "full_attention"] * 3}, 3),  # Gemma 2, transformers 5 configs
        ({"sliding_window": 512, "sliding_window_pattern": 6}, 10),  # older Gemma 3: each 6th layer full
        ({"sliding_window": 4096}, 12),  # Mistral v0.1, Phi-3: every layer
        (
            {"sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 28},
            0,
        ),  # Qwen2.5 as shipped
        (
            {"sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 8},
            4,
        ),  # Qwen2 switched on
        ({"sliding_window": None}, 0),  # Mistral v0.2+
        ({}, 0),  # Llama
    ],
)
def test_sliding_window_layers_by_the_keys_transformers_reads(config: dict, sliding: int) -> None:
    from rlbridge.model.info import sliding_window_layers

    assert sliding_window_layers(config, 12) == sliding


def test_memory_fix_offers_the_largest_budget_that_fits(tmp_path: Path) -> None:
    """The refusal's budget fix is the largest multiple of 1024 the plan fits, not half the refused budget (on an
    80 GiB device the 7B's 40960 was refused with 20480 offered while 36864 fit)."""
    from rlbridge.model.info import read_model_info
    from rlbridge.recipe.checks.training import plan_memory

    one_gpu = base(trainer__parallel={"tensor": 1}, rollout__tensor_parallel=1, cluster__gpus_per_node=1)
    f = tmp_path / "r.yaml"
    f.write_text(yaml.safe_dump(one_gpu))
    r = validate_recipe(f, ["trainer.max_tokens_per_micro_batch=65536"], force=True).recipe
    m = read_model_info(QWEN7B)

    def peak(budget: int) -> float:
        trainer = r.trainer.model_copy(update={"max_tokens_per_micro_batch": budget})
        return plan_memory(r.model_copy(update={"trainer": trainer}), m).peak

    capacity = (peak(20480) + peak(24576)) / 2  # 20480 fits such a device, 24576 does not
    issues = check(
        tmp_path,
        one_gpu,
        f"cluster.gpu_memory_gib={capacity:.4f}",
        "trainer.max_tokens_per_micro_batch=65536",
    )
    fix = dict(issues)["cluster.gpu_memory_gib"].split(" | ")[1]
    offered = int(fix.split("trainer.max_tokens_per_micro_batch: ")[1].split()[0])
    assert offered % 1024 == 0 and peak(offered) <= capacity < peak(offered + 1024), (offered, fix)
    assert offered > 65536 // 2 or 20480 <= offered < 24576, fix
