"""The recipe's `run` and `cluster` sections: steps, checkpoints, evaluation cadence, health checks and loggers;
the devices and Ray cluster the run is placed on."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from rlbridge.recipe.schema.base import PositiveInt, Section


class HealthCfg(Section):
    first_step: bool = True
    """After the first update: grad norm finite and > 0, every trainable tensor changed, no frozen one did."""
    max_logprob_diff: Annotated[float, Field(gt=0)] | None = 0.5
    """Stop when the mean |trainer - rollout| log-prob of sampled tokens exceeds this; null turns it off."""
    max_logprob_diff_growth: Annotated[float, Field(gt=1)] | None = 2.0
    """Warn (or stop, with on_mismatch: stop) when the trainer-vs-rollout log-prob gap grows: the median of
    logprob_diff_mean over the last 3 on-policy steps above this many times its median over the run's first 3, and at
    least 0.01 above it. A gap that grows as the weights move is the mark of one side computing with weights the other
    does not have (a sync that did not reach the rollout, a trainer graph holding old weights); bf16 noise stays
    flat. Null turns it off."""
    max_nonfinite_steps: Annotated[int, Field(ge=0)] = 3
    """Steps with non-finite loss/gradients that are skipped before the run stops."""
    is_weight_range: tuple[Annotated[float, Field(gt=0)], Annotated[float, Field(gt=0)]] = (0.5, 2.0)
    """A step whose mean importance weight (trainer / rollout probability of the sampled tokens, metric
    rc_weight_mean) leaves [low, high] gets a warning, or stops the run with on_mismatch: stop."""
    min_ess: Annotated[float, Field(ge=0, le=1)] = 0.3
    """A step whose normalized effective sample size of the importance weights (rc_ess) falls below this gets a
    warning, or stops the run with on_mismatch: stop."""
    on_mismatch: Literal["warn", "stop"] = "warn"
    """What a step outside is_weight_range or min_ess, or past max_logprob_diff_growth, does: print a warning (at the
    first step out, then every 10th while the gap lasts, and when it ends), or stop the run."""
    stall_factor: Annotated[float, Field(gt=1)] = 5.0
    """A phase of a step (generate, reward, update, sync, eval, checkpoint, ...) that has run this many times its
    median in earlier steps, and at least stall_floor_s, is stalled: a warning names the phase and its likely
    cause, measured (CPU or GPU contention, a hung reward function or worker, a dead peer), again after each
    further such stretch. A phase's first run is not watched."""
    stall_floor_s: Annotated[float, Field(ge=0)] = 60.0
    """No stall warning before a phase has run this long (short phases vary a lot)."""
    stall_stop_s: Annotated[float, Field(gt=0)] | None = 1800.0
    """A stalled phase that has run this long stops the run, which resumes from its last complete checkpoint
    (the command is printed); null: stalls only warn."""


class WandbCfg(Section):
    project: str = "rlbridge"
    """Weights & Biases project (the environment variable WANDB_PROJECT, when set, overrides it)."""
    entity: str | None = None
    """W&B entity, a user or a team (WANDB_ENTITY overrides it); null: the account's default entity."""
    name: str | None = None
    """W&B run name (WANDB_NAME overrides it); null: the run directory's name."""
    tags: list[str] = []
    """W&B run tags (WANDB_TAGS, comma-separated, overrides them)."""


class RunCfg(Section):
    steps: PositiveInt = 100
    """Training steps (one step = generate, reward, update, sync)."""
    seed: int = 42
    """Seed for data order, sampling and initialization."""
    save_every: Annotated[int, Field(ge=0)] = 0
    """Checkpoint every N steps (0: only at the end and on SIGTERM)."""
    time_limit_s: Annotated[float, Field(gt=0)] | None = None
    """Wall-clock seconds this command may run, start-up included (a cluster job's limit, less a margin): after a
    step, when the next step and a save (the last one's seconds; before one, estimated from the checkpoint's size)
    would end past it, the run saves and stops with exit code 75 and the
    `rlbridge resume` command, which starts a new limit. Under 600 s the plan notes it (seconds, not minutes).
    Null: no limit."""
    keep: PositiveInt = 3
    """Complete checkpoints kept; the newest good one is never deleted."""
    dir: str | None = None
    """Run directory (default: runs/<name>-<timestamp>)."""
    eval_every: Annotated[int, Field(ge=0)] = 0
    """Evaluate on data.val every N steps (0: only before and after training)."""
    eval_samples: PositiveInt = 100
    """Validation prompts per evaluation (greedy)."""
    save_rollouts: bool = False
    """Write every step's samples to RUN_DIR/rollouts/step_<N>.jsonl, one line per sample in the batch's order:
    its prompt group, response token ids and text, finish reason, reward and weight version (what was trained
    on, to read or compare between runs)."""
    loggers: list[Literal["console", "jsonl", "wandb", "tensorboard"]] = ["console", "jsonl"]
    """Metric sinks; jsonl is always written."""
    wandb: WandbCfg = WandbCfg()
    """Where the wandb logger files the run (used when run.loggers lists wandb)."""
    health: HealthCfg = HealthCfg()


# -------------------------------------------------------------------------------------------- cluster
class ClusterCfg(Section):
    nodes: PositiveInt = 1
    """Nodes in the Ray cluster."""
    gpus_per_node: PositiveInt = 1
    """Devices per node. With device: cpu, each device is a CPU worker process (gloo)."""
    device: Literal["cuda", "cpu"] = "cuda"
    """Accelerator: cuda, or cpu (runs the same wiring with gloo; for smoke runs and CI)."""
    gpu_memory_gib: Annotated[float, Field(gt=0)] = 80.0
    """Memory per device, used by the plan's memory estimate. `rlbridge train` on a machine with GPUs (no
    cluster.address) compares it with nvidia-smi's figure first: a run whose planned peak exceeds the real GPUs
    is refused, and a difference over 5 % gets a warning."""
    colocate: bool = True
    """Trainer and rollout share the same devices (vLLM sleeps during the update)."""
    address: str | None = None
    """Address of an existing Ray cluster; null starts a local one."""
    placement_timeout_s: Annotated[float, Field(gt=0)] = 300.0
    """How long to wait for Ray resources before failing with what is missing."""
    startup_timeout_s: Annotated[float, Field(gt=0)] = 900.0
    """How long the trainer and rollout workers may take to start (load the model; vLLM: compile, capture CUDA
    graphs) before the run stops, naming the worker, what its log file shows and where that file is. A cold
    start of a large model on GPUs can take many minutes; while waiting, a line every 30 s says what is still
    starting."""
    collective_timeout_s: Annotated[float, Field(gt=0)] = 1800.0
    """Longest one call into a multi-rank trainer (an update, log-probs, a weight export) may take before
    the run stops, naming the ranks that did not answer (a stuck collective). Also the torch.distributed
    timeout. A rank that dies stops the run at once, whatever this says."""
