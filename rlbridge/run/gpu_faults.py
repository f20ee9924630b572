"""GPU memory faults, said in the recipe's terms: which key to change, to what, and why.

A worker that fails with vLLM's or PyTorch's out-of-memory text gets that text in its error (ray_cluster.Worker),
which is right but names vLLM's and PyTorch's knobs (`gpu_memory_utilization` when initializing the engine,
`PYTORCH_CUDA_ALLOC_CONF`), not the recipe keys that set them. `explain` reads the failure's text and returns a
sentence naming the recipe key, its value, the memory figures from the message and a value that fits, or None
for any other failure. Recognized (the message formats of vLLM 0.26 / 0.32 and torch 2.x):

- vLLM at start: less free memory on the device than `rollout.gpu_memory_utilization` asks for
  (`Free memory on device ... on startup is less than ...`), or too little left for the KV cache
  (`No available memory for the cache blocks`, `... GiB KV cache is needed, which is larger than ...`);
- vLLM at wake (colocated: its weights or KV cache come back after the update): `CUDA Error: out of memory`
  from its cumem allocator;
- the trainer (or a rollout step) out of memory: `CUDA out of memory. Tried to allocate ...`.

`device_size_problem`, before a run starts: the recipe's cluster.gpu_memory_gib against the GPUs the machine has.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlbridge.plan import Plan
    from rlbridge.recipe.schema import Recipe

_NUM = r"([0-9]+(?:\.[0-9]+)?)"
_SIZE = _NUM + r"\s*(GiB|MiB|KiB|B)\b"
_UNIT = {"GiB": 1.0, "MiB": 1 / 1024, "KiB": 1 / 1024**2, "B": 1 / 1024**3}

VLLM_START = re.compile(
    r"Free memory on device[^(]*\(" + _NUM + "/" + _NUM + r" GiB\) on startup is less than [^(]*\(" + _NUM
)
VLLM_NO_KV = re.compile(r"No available memory for the cache blocks")
VLLM_KV_SHORT = re.compile(
    r"max seq len \(([0-9]+)\), \("
    + _NUM
    + r" GiB KV cache is needed, which is larger than the available KV "
    r"cache memory \(" + _NUM + r" GiB\)"
)
VLLM_WAKE = re.compile(r"CUDA Error: out of memory at [^\s]*cumem")
TORCH_OOM = re.compile(
    r"CUDA out of memory\. Tried to allocate "
    + _SIZE
    + r"\. GPU (?:[0-9]+ )?has a total capacity of "
    + _SIZE
    + r" of which "
    + _SIZE
    + r" is free"
)
MARGIN_GIB = 1.0
"""Left free below a suggested gpu_memory_utilization (allocator slack, CUDA context of another process)."""


def _gib(value: str, unit: str) -> float:
    return float(value) * _UNIT[unit]


def _size(gib: float) -> str:
    """0.02 GiB reads as 0.00: below 1 GiB, MiB."""
    return f"{gib:.2f} GiB" if gib >= 1 else f"{gib * 1024:.0f} MiB"


def explain(text: str, role: str, recipe: Recipe, plan: Plan | None = None) -> str | None:
    """The recipe-level reading of a worker's failure `text` (role: "trainer" or "rollout"), or None."""
    util = recipe.rollout.gpu_memory_utilization
    if m := VLLM_START.search(text):
        free, total = float(m.group(1)), float(m.group(2))
        fits = math.floor(max(free - MARGIN_GIB, 0.0) / total * 100) / 100
        fix = (
            f"set rollout.gpu_memory_utilization: {fits:.2f} or lower"
            if fits >= 0.01
            else "free the GPU (nvidia-smi lists what holds it)"
        )
        return (
            f"vLLM could not start: rollout.gpu_memory_utilization is {util} ({util * total:.1f} GiB of the "
            f"device's {total:.1f} GiB) but only {free:.1f} GiB were free when it started (another process, or "
            f"the trainer beside it, holds the rest); {fix}"
        )
    if m := VLLM_KV_SHORT.search(text):
        max_len, needed, avail = int(m.group(1)), float(m.group(2)), float(m.group(3))
        total = recipe.cluster.gpu_memory_gib
        more = math.ceil((util + (needed - avail) / total) * 100 + 1) / 100
        return (
            f"vLLM has {avail:.2f} GiB for its KV cache but one sequence of rollout.max_prompt_tokens + "
            f"rollout.max_response_tokens = {max_len} tokens needs {needed:.2f} GiB; set "
            f"rollout.gpu_memory_utilization: {min(more, 0.95):.2f} (now {util}) or shorten "
            "rollout.max_prompt_tokens / rollout.max_response_tokens"
        )
    if VLLM_NO_KV.search(text):
        return (
            f"vLLM has no memory left for its KV cache after loading the weights: rollout.gpu_memory_utilization "
            f"({util}) leaves nothing beyond the model; raise it (the plan: `rlbridge plan` shows the rollout's "
            "weights and KV cache per device)"
        )
    if VLLM_WAKE.search(text):
        held = _trainer_line(plan)
        return (
            "vLLM ran out of GPU memory while waking up after the update (getting its weights or KV cache back "
            f"on the device it shares with the trainer{held}): lower rollout.gpu_memory_utilization (now {util}) "
            "or trainer.micro_batch_size, or give the rollout devices of its own (cluster.colocate: false)"
        )
    if m := TORCH_OOM.search(text):
        asked, total, free = (
            _gib(m.group(1), m.group(2)),
            _gib(m.group(3), m.group(4)),
            _gib(m.group(5), m.group(6)),
        )
        where = f"tried to allocate {_size(asked)} with {_size(free)} free of {total:.1f} GiB"
        if role == "rollout":
            return (
                f"the rollout ran out of GPU memory ({where}): lower rollout.gpu_memory_utilization (now {util}) "
                "or the batch it generates (data.batch_size x rollout.n)"
            )
        return f"the trainer ran out of GPU memory ({where}): " + _trainer_fix(recipe, plan, asked - free)
    return None


def _trainer_line(plan: Plan | None) -> str:
    if plan is None or plan.memory is None:
        return ""
    return f"; the plan puts the trainer at ~{plan.memory.trainer_total:.1f} GiB"


def _trainer_fix(recipe: Recipe, plan: Plan | None, short_gib: float) -> str:
    """A micro-batch size that frees `short_gib` (and a margin) of activations by the plan's estimate."""
    mbs = recipe.trainer.micro_batch_size
    act = plan.memory.activations if plan is not None and plan.memory is not None else None
    async_note = (
        "; in rollout.mode async vLLM stays resident next to the trainer: a lower rollout.gpu_memory_utilization "
        "leaves it more"
        if recipe.rollout.mode == "async" and recipe.cluster.colocate
        else ""
    )
    if mbs <= 1:
        return (
            "trainer.micro_batch_size is already 1: shorten rollout.max_response_tokens, set "
            "trainer.recompute.granularity: full, or use more devices (trainer.parallel)" + async_note
        )
    if not act:
        return f"set trainer.micro_batch_size: {mbs // 2} (now {mbs})" + async_note
    per_seq = act / mbs
    fits = max(1, min(mbs - 1, mbs - math.ceil((short_gib + MARGIN_GIB) / per_seq)))
    return (
        f"set trainer.micro_batch_size: {fits} (now {mbs}; the plan estimates {act:.2f} GiB of activations at "
        f"{mbs}, {per_seq * fits:.2f} GiB at {fits}), or trainer.recompute.granularity: full" + async_note
    )


DEVICE_SIZE_TOLERANCE = 0.05
"""cluster.gpu_memory_gib may differ this much (relative) from the GPUs' memory before a run says so."""


def device_size_problem(
    recipe: Recipe, plan: Plan, *, query: Callable[[], str | None] | None = None
) -> tuple[str, bool] | None:
    """Before a run starts on a local GPU cluster: cluster.gpu_memory_gib (what the plan's memory checks assumed)
    against the memory nvidia-smi reports for this machine's GPUs (the smallest). (text, fatal): fatal when the
    plan's device peak does not fit the real GPUs (the run would run out of memory), else a warning when they
    differ by more than DEVICE_SIZE_TOLERANCE. None when they agree, off CUDA, on a cluster given by
    cluster.address (the driver may run on another kind of machine) or without nvidia-smi. `query` returns
    nvidia-smi's memory.total list in MiB (tests pass their own)."""
    c = recipe.cluster
    if c.device != "cuda" or c.address is not None:
        return None
    sizes = []
    for line in ((query or _gpu_totals)() or "").splitlines():
        try:
            sizes.append(float(line.strip()) / 1024)
        except ValueError:
            continue
    if not sizes:
        return None
    real = min(sizes)
    if abs(real - c.gpu_memory_gib) <= DEVICE_SIZE_TOLERANCE * real:
        return None
    said = f"cluster.gpu_memory_gib is {c.gpu_memory_gib:g} but this machine's GPUs have {real:.1f} GiB"
    fix = f"set cluster.gpu_memory_gib: {math.floor(real * 10) / 10:g} (`rlbridge plan` then shows what fits)"
    peak = None if plan.memory is None else plan.memory.peak
    if peak is not None and peak > real:
        return f"{said}: the plan's peak of {peak:.1f} GiB per device does not fit them; {fix}", True
    return f"{said}: the plan's memory checks used {c.gpu_memory_gib:g}; {fix}", False


def nvidia_smi(*args: str) -> str | None:
    """`nvidia-smi ARGS`' standard output; None without nvidia-smi or when it fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        return subprocess.run([exe, *args], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def _gpu_totals() -> str | None:
    return nvidia_smi("--query-gpu=memory.total", "--format=csv,noheader,nounits")
