"""The recipe's `trainer` section: the training engine, its parallel layout, recompute, optimizer and the shape
of its forward/backward passes."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from rlbridge.recipe.schema.base import PositiveInt, Section


class ParallelCfg(Section):
    tensor: PositiveInt = 1
    """Tensor-parallel size (megatron engine). Raise it when one GPU cannot hold a layer's weights and activations;
    it must divide the attention heads (validate-recipe checks)."""
    pipeline: PositiveInt = 1
    """Pipeline-parallel size (megatron engine). Raise it when tensor parallelism within a node is not enough to
    fit the model; it must divide the layers."""
    virtual_pipeline: Annotated[int, Field(ge=1)] | None = None
    """Virtual pipeline stages per pipeline rank (interleaved schedule); needs pipeline > 1."""
    context: PositiveInt = 1
    """Context-parallel size (megatron engine): splits each sequence over ranks, for sequences too long for one
    GPU's activations."""
    expert: PositiveInt = 1
    """Expert-parallel size for MoE models."""
    expert_tensor: PositiveInt = 1
    """Expert tensor-parallel size for MoE models."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism; needs tensor > 1 and reduce-scatter (not on CPU/gloo)."""


class RecomputeCfg(Section):
    granularity: Literal["none", "selective", "full"] = "none"
    """Activation recompute: none, selective (attention core) or full (whole layers)."""
    method: Literal["uniform", "block"] | None = None
    """For full recompute: uniform (groups of num_layers) or block (the first num_layers per stage)."""
    num_layers: Annotated[int, Field(ge=1)] | None = None
    """For full recompute: layers per recompute group (uniform) or recomputed layers per stage (block)."""


class OptimCfg(Section):
    lr: Annotated[float, Field(gt=0)] = 1.0e-6
    """Peak learning rate."""
    min_lr: Annotated[float, Field(ge=0)] = 0.0
    """Final learning rate of the cosine/linear schedule."""
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Learning-rate schedule after warm-up."""
    warmup_steps: Annotated[int, Field(ge=0)] = 0
    """Linear warm-up steps (optimizer steps) from 0 to lr."""
    weight_decay: Annotated[float, Field(ge=0)] = 0.0
    """AdamW weight decay."""
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.999)
    """AdamW betas."""
    eps: Annotated[float, Field(gt=0)] = 1.0e-8
    """AdamW epsilon."""
    clip_grad: Annotated[float, Field(gt=0)] | None = 1.0
    """Gradient-norm clipping threshold; null turns clipping off."""


AUTO_WIDTH_MULTIPLE = 16
"""trainer.pass_width_multiple null for the hf engine on a CUDA device: at multiples of 16 a run meets few widths,
so cuDNN attention rarely builds new plans (docs/defaults.md#pass-widths)."""


MAX_PASS_TOKENS = 8192
"""trainer.cuda_graphs: the largest pass (rows x width) recorded (engines/hf/graphs.py)."""
MAX_GRAPHS = 32
"""trainer.cuda_graphs: pass shapes kept recorded at once (the least recently used dropped beyond)."""


def round_width(width: int, multiple: int) -> int:
    """The width a pass of `width` columns runs at under trainer.pass_width_multiple `multiple` (resolved:
    TrainerCfg.width_multiple): the next multiple."""
    return -(-width // multiple) * multiple


class TrainerCfg(Section):
    engine: Literal["megatron", "hf"] = "hf"
    """Training engine: megatron (Megatron-core via Megatron-Bridge/mbridge) or hf (transformers + peft)."""
    bridge: Literal["megatron-bridge", "mbridge"] = "megatron-bridge"
    """How the megatron engine loads HF checkpoints. mbridge supports full fine-tuning only."""
    parallel: ParallelCfg = ParallelCfg()
    recompute: RecomputeCfg = RecomputeCfg()
    optim: OptimCfg = OptimCfg()
    micro_batch_size: PositiveInt = 1
    """Sequences per forward/backward pass on one data-parallel rank; it must divide each rank's mini-batch
    (validate-recipe lists the values that do). Lower it when the trainer runs out of memory (the error names it);
    on a GPU prefer max_tokens_per_micro_batch, which `rlbridge plan` suggests when many small passes would make
    the update host-bound."""
    max_tokens_per_micro_batch: PositiveInt | None = None
    """Form the training passes (forward/backward, policy and critic) by a token budget instead of
    micro_batch_size: hf engine, and megatron engine at trainer.parallel.pipeline = context = 1 (refused
    otherwise: those send micro-batches of one fixed shape). Rows sorted by length are put together while rows x
    (longest prompt + longest response among them) stays within the budget (a longer row gets a pass of its
    own), so short rows share larger passes. The update's gradient is unchanged (the loss closure returns each
    pass's share of the mini-batch loss); per-pass metrics are averaged over the passes actually run. Log-prob
    and value passes follow it too unless logprob_chunk_size is set. null: micro_batch_size sequences per pass."""
    pass_width_multiple: PositiveInt | None = None
    """Round each forward pass's width (prompt + response columns, after trimming to its rows) up to a multiple
    of this with masked columns (hf engine: left of the prompts; megatron: on the right), so a run meets few
    distinct pass shapes. Why: on a GPU, torch's cuDNN attention builds its plans on the host for every new
    shape, about a second of a small model's update with the GPU idle. Exact (the added columns are masked); a pass
    costs up to pass_width_multiple - 1 more positions per row. null: 16 for the hf engine on a GPU, else 1 (each
    pass at its own widths: on a CPU the added columns cost compute; the megatron engine's GPU cost is not measured
    yet). Change it to trade those extra positions against fewer new shapes (docs/defaults.md#pass-widths).
    Not applied to trainer.shared_prompts' passes."""
    packed_passes: bool = False
    """hf engine: run each pass's rows as one row of their real tokens, with no padding and variable-length
    attention over the rows' boundaries (torch's varlen_attn on CUDA), instead of the rows at their pass's widths
    with a padding mask; the token budget (max_tokens_per_micro_batch) then counts real tokens. Exact (the same
    log-probs and gradients up to float summation order: docs/engines/hf.md#packed-passes-trainerpacked_passes).
    Where trainer.shared_prompts shares (always, or auto on a CPU), each distinct prompt's tokens run once per pass
    and its rows' responses attend to them (no KV cache kept: recompute allowed). Not with trainer.cuda_graphs,
    rollout.routing_replay or sliding-window models; the PPO critic keeps padded passes. Off by default: faster
    in the engine's own bench and on the CPU, its gain inside a GPU step is not settled yet (docs/engines/hf.md)."""
    cuda_graphs: bool = False
    """hf engine on a GPU: record each training pass's forward and backward as CUDA graphs, one pair per pass shape,
    and replay them for later passes of that shape: one launch instead of tens of thousands of host-side calls,
    for updates that are host-bound (small models, small passes: the GPU quickstart's update several times faster,
    docs/defaults.md#cuda-graphs). Each pass's prompt and response widths are each rounded up to
    trainer.pass_width_multiple (masked columns), so a run meets few shapes; passes of up to 8192 positions are
    recorded, at most 32 shapes kept. The first pass of each shape runs eagerly and is then recorded (about one
    more pass of host time). Memory: one more pass's activations and a set of gradients per shape, which `rlbridge
    plan` counts. Exact: a replay computes what the eager pass computes. Needs trainer.engine hf, cluster.device
    cuda, trainer.recompute.granularity none, no rollout.routing_replay, and float32 trainable parameters (LoRA, or
    full fine-tuning of a float32 model)."""
    ppo_epochs: PositiveInt = 1
    """Passes over each step's rollouts (each mini-batch an optimizer step). Above 1 the later passes are
    off-policy and the clipped ratio limits them; GRPO recipes usually keep 1."""

    distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (megatron engine; needs reduce-scatter, so GPUs). Its
    checkpoints are not implemented yet, and every run writes checkpoints, so validation refuses true."""
    grad_reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """Precision of the gradient all-reduce (megatron engine)."""
    logprob_chunk_size: PositiveInt | None = None
    """Sequences per pass of the no-gradient passes (old and reference log-probs, PPO's values). null: the
    training passes' groups (micro_batch_size rows, or max_tokens_per_micro_batch), which hold more memory with
    their gradients than these passes do without; set a number to bound these passes on their own."""
    shared_prompts: Literal["auto", "always", "never"] = "auto"
    """hf engine: run each distinct prompt once per pass, not once per sample, its keys and values shared by
    the responses of its rows (exact: docs/engines/hf.md). auto: on a CPU, where that computes at most 80 % of
    the positions of the plain passes (GRPO's n > 1 responses per prompt), plain passes on a GPU (measured slower
    there: docs/defaults.md#shared-prompts); always: whenever the rows share prompts; never: plain passes only
    (not `off`: YAML reads it as false). In padded passes it needs trainer.recompute.granularity none (else the
    plain passes run); trainer.packed_passes share without a KV cache, recompute or not. The megatron engine
    always runs the plain passes. With always on a GPU in padded passes, `rlbridge plan` estimates the plain
    passes and notes the higher trainer peak measured for the shared ones."""

    def width_multiple(self, device: str) -> int:
        """pass_width_multiple resolved for a trainer on `device` (a torch device type): null is
        AUTO_WIDTH_MULTIPLE for the hf engine on cuda (the engine's spec says), else 1."""
        from rlbridge.engines.registry import TRAINER_ENGINES

        if self.pass_width_multiple is not None:
            return self.pass_width_multiple
        return TRAINER_ENGINES[self.engine].auto_width_multiple_cuda if device == "cuda" else 1
