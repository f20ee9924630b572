"""Out-of-GPU-memory failures said in the recipe's terms (rlbridge/run/gpu_faults.py, issue 20 item 3).

The vLLM messages are produced by vLLM's own checks (the installed build's `request_memory` and
`_check_enough_kv_cache_memory`, called with the memory figures of a full H200); the PyTorch and cumem ones are
the formats torch 2.x's caching allocator and vLLM's cumem allocator print (no CUDA here to provoke them). Then a
real Ray actor fails with them and the error the user reads leads with the key to change. The GPU run that
provokes each fault for real: tests/gpu/test_gpu_faults.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import ray

from rlbridge.cluster.ray_cluster import Worker
from rlbridge.errors import RlbridgeError
from rlbridge.model.info import read_model_info
from rlbridge.plan import make_plan
from rlbridge.recipe.load import load_recipe
from rlbridge.run.gpu_faults import MARGIN_GIB, explain

GIB = 1024**3
H200_GIB = 139.81


def quickstart(*sets: str) -> Any:
    return load_recipe("recipes/quickstart-gpu.yaml", list(sets))


def vllm_start_error(free_gib: float, util: float) -> str:
    from vllm.v1.worker.utils import request_memory

    snapshot = SimpleNamespace(
        total_memory=int(H200_GIB * GIB), free_memory=int(free_gib * GIB), device_="cuda:0"
    )
    with pytest.raises(ValueError) as e:
        request_memory(snapshot, SimpleNamespace(gpu_memory_utilization=util))  # type: ignore[arg-type]
    return str(e.value)


def vllm_kv_error(available_gib: float, needed_gib: float, max_len: int) -> str:
    from vllm.v1.core.kv_cache_utils import _check_enough_kv_cache_memory

    with pytest.raises(ValueError) as e:
        _check_enough_kv_cache_memory(
            int(available_gib * GIB), lambda: int(needed_gib * GIB), max_len, lambda _: 0
        )
    return str(e.value)


TORCH_OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 6.00 GiB. GPU 0 has a total capacity of "
    "139.81 GiB of which 2.50 GiB is free. Including non-PyTorch memory, this process has 96.12 GiB memory in use. "
    "Of the allocated memory 90.01 GiB is allocated by PyTorch, and 3.02 GiB is reserved by PyTorch but "
    "unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
)
CUMEM_WAKE = "RuntimeError: CUDA Error: out of memory at /workspace/csrc/cumem_allocator.cpp:62"


def test_vllm_start_names_the_key_the_free_memory_and_a_value_that_fits() -> None:
    r = quickstart("rollout.gpu_memory_utilization=0.5")
    text = vllm_start_error(free_gib=30.0, util=0.5)
    assert "on startup is less than" in text  # vLLM's own wording, which the reading keys on
    got = explain(text, "rollout", r)
    assert got is not None
    fits = math.floor((30.0 - MARGIN_GIB) / H200_GIB * 100) / 100  # 0.20
    assert "rollout.gpu_memory_utilization is 0.5" in got and "only 30.0 GiB were free" in got
    assert f"set rollout.gpu_memory_utilization: {fits:.2f} or lower" in got
    nothing_free = explain(vllm_start_error(free_gib=0.5, util=0.5), "rollout", r)
    assert nothing_free is not None and "free the GPU" in nothing_free


def test_vllm_kv_cache_too_small_names_the_lengths_and_a_utilization() -> None:
    r = quickstart()  # gpu_memory_utilization 0.3, 128 + 48 tokens
    got = explain(vllm_kv_error(available_gib=0.5, needed_gib=2.0, max_len=176), "rollout", r)
    assert got is not None
    want = math.ceil((0.3 + 1.5 / r.cluster.gpu_memory_gib) * 100 + 1) / 100
    assert (
        "= 176 tokens needs 2.00 GiB" in got
        and f"rollout.gpu_memory_utilization: {want:.2f} (now 0.3)" in got
    )
    assert "rollout.max_response_tokens" in got
    none_left = explain(vllm_kv_error(available_gib=0.0, needed_gib=2.0, max_len=176), "rollout", r)
    assert none_left is not None and "no memory left for its KV cache" in none_left


def test_wake_out_of_memory_names_colocation_keys() -> None:
    r = quickstart()
    got = explain(CUMEM_WAKE, "rollout", r, make_plan(r, read_model_info(r.model.path)))
    assert got is not None and "waking up after the update" in got
    assert "rollout.gpu_memory_utilization (now 0.3)" in got and "cluster.colocate: false" in got
    assert "the plan puts the trainer at ~" in got


def test_trainer_out_of_memory_names_a_micro_batch_size_from_the_plan() -> None:
    r = quickstart("trainer.micro_batch_size=32")
    plan = make_plan(r, read_model_info(r.model.path))
    assert plan.memory is not None
    got = explain(TORCH_OOM, "trainer", r, plan)
    assert got is not None
    assert "tried to allocate 6.00 GiB with 2.50 GiB free of 139.8 GiB" in got
    per_seq = plan.memory.activations / 32
    fits = max(1, min(31, 32 - math.ceil((6.0 - 2.5 + MARGIN_GIB) / per_seq)))
    assert f"set trainer.micro_batch_size: {fits} (now 32;" in got
    assert explain(TORCH_OOM, "trainer", quickstart("trainer.micro_batch_size=1"), plan) is not None
    one = explain(TORCH_OOM, "trainer", quickstart("trainer.micro_batch_size=1"), plan)
    assert one is not None and "already 1" in one
    asynchronous = explain(TORCH_OOM, "trainer", quickstart("rollout.mode=async", *ASYNC_OK), plan)
    assert asynchronous is not None and "vLLM stays resident" in asynchronous
    rollout = explain(TORCH_OOM, "rollout", r)
    assert rollout is not None and "the rollout ran out of GPU memory" in rollout


ASYNC_OK = ("rollout.max_staleness=1", "rollout.gpu_memory_utilization=0.2")


def test_other_failures_are_left_alone() -> None:
    r = quickstart()
    for text in ("ValueError: bad thing", "CUDA error: an illegal memory access was encountered", ""):
        assert explain(text, "trainer", r) is None


# ------------------------------------------------------------------ through a real Ray actor
@ray.remote(num_cpus=0)
class FailsToStart:
    def __init__(self, text: str) -> None:
        raise ValueError(text)

    def ping(self) -> int:
        return 1


@ray.remote(num_cpus=0)
class FailsInStep:
    def update(self) -> None:
        raise RuntimeError(TORCH_OOM)


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_the_worker_error_leads_with_the_reading(local_ray: Any, tmp_path: Path) -> None:
    r = quickstart("trainer.micro_batch_size=32")
    plan = make_plan(r, read_model_info(r.model.path))
    log = tmp_path / "rollout.log"
    rollout = Worker("rollout", FailsToStart.remote(vllm_start_error(30.0, 0.5)), log)  # type: ignore[attr-defined]
    rollout.explain = lambda text: explain(text, "rollout", r, plan)
    with pytest.raises(RlbridgeError) as started:
        rollout.call("ping", timeout=60)
    lines = str(started.value).splitlines()
    assert lines[0] == f"rollout worker failed while starting (its log: {log}):"
    assert lines[1].startswith("vLLM could not start: rollout.gpu_memory_utilization is 0.3")
    assert "on startup is less than" in lines[2]  # vLLM's own last line stays below
    # the traceback is not printed (the reading says what to change) but kept beside the worker's log
    assert lines[3:] == [f"(the whole traceback: {log.with_suffix('.error.txt')})"], lines
    assert 'File "' in log.with_suffix(".error.txt").read_text()
    trainer = Worker("trainer", FailsInStep.remote())  # type: ignore[attr-defined]
    trainer.explain = lambda text: explain(text, "trainer", r, plan)
    with pytest.raises(RlbridgeError) as step:
        trainer.call("update", timeout=60)
    assert str(step.value).startswith("trainer worker failed: the trainer ran out of GPU memory")
    assert "trainer.micro_batch_size" in str(step.value).splitlines()[0]
    assert 'File "' not in str(step.value)
    plain = Worker("trainer", FailsInStep.remote())  # type: ignore[attr-defined]  # no reading set: as before
    with pytest.raises(RlbridgeError, match=r"^trainer worker failed: RuntimeError\("):
        plain.call("update", timeout=60)


# --------------------------------------------------------------------------- cluster.gpu_memory_gib vs the GPUs
def _planned(*sets: str) -> tuple[Any, Any]:
    r = quickstart(*sets)
    from rlbridge.model.cache import ensure_model

    return r, make_plan(r, read_model_info(str(ensure_model(r.model.path))))


def test_a_recipe_sized_for_a_bigger_gpu_is_refused_when_its_peak_does_not_fit() -> None:
    from rlbridge.run.gpu_faults import device_size_problem

    # the quickstart at 512 rollouts planned for 139 GiB (peak ~84.7 GiB) on a machine of 80 GB cards
    r, plan = _planned("data.batch_size=64", "rollout.n=8", "rollout.max_response_tokens=256")
    assert plan.memory is not None and plan.memory.peak > 79.6
    text, fatal = device_size_problem(r, plan, query=lambda: "81559\n81559\n") or ("", False)
    assert fatal, text
    assert "cluster.gpu_memory_gib is 139 but this machine's GPUs have 79.6 GiB" in text
    assert f"peak of {plan.memory.peak:.1f} GiB" in text and "set cluster.gpu_memory_gib: 79.6" in text


def test_a_recipe_sized_for_another_gpu_gets_a_warning_when_it_fits() -> None:
    from rlbridge.run.gpu_faults import device_size_problem

    r, plan = _planned()  # the quickstart's own size: a peak of a few GiB
    text, fatal = device_size_problem(r, plan, query=lambda: "81559") or ("", True)
    assert not fatal and "the plan's memory checks used 139" in text
    assert device_size_problem(r, plan, query=lambda: "143771") is None  # an H200's 140.4 GiB: within 5 %
    assert device_size_problem(r, plan, query=lambda: None) is None  # no nvidia-smi
    cpu, cpu_plan = _planned("cluster.device=cpu")
    assert device_size_problem(cpu, cpu_plan, query=lambda: "81559") is None
