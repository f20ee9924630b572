"""The recipe: one typed, frozen description of a training run.

Every section is a pydantic model with `extra="forbid"` (a typo is an error with a suggestion, never
silently ignored) and attribute docstrings, so `rlbridge schema` and the docs come from this one file.
The recipe is validated once and then passed around typed; it is never turned back into a dict except
to save it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from rlbridge.weights import WeightSync

Dtype = Literal["float32", "bfloat16", "float16"]
PositiveInt = Annotated[int, Field(ge=1)]
MAX_INT = 2**31 - 1
"""The largest integer a recipe takes (any key): counts past it overflow the int32 indices and seeds of torch,
numpy and vLLM somewhere in a run, and a number that large is a typo (`steps: 100000000000000000000000`)."""


class Section(BaseModel):
    """Every recipe section: unknown keys are errors, values are frozen, floats are finite (`.inf` and `.nan`
    are refused: an infinite learning rate trains NaNs), integers lie within +-MAX_INT."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _bounded_ints(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
            raise PydanticCustomError(
                "int_too_large",
                "{value} is out of range: a recipe's integers lie within +-{max} (int32)",
                {"value": value, "max": MAX_INT},
            )
        return value


# --------------------------------------------------------------------------------------------- model
class ModelCfg(Section):
    path: str
    """Local Hugging Face model directory (config.json, safetensors, tokenizer), a short name that rlbridge
    materializes into its cache (`smollm2-135m-instruct`, `gemma3-270m`: docs/models.md), or a Hugging Face Hub id (`Qwen/Qwen2.5-0.5B-Instruct`)
    found in the Hugging Face cache (HF_HOME) or, when online, downloaded by `train` (HF_HUB_OFFLINE=1: the cache
    only; fetch with `hf download ORG/NAME`). An existing local path wins over a Hub id of the same spelling."""
    revision: str | None = None
    """Branch, tag or commit of a Hub id (default: main). Only for Hub ids."""
    dtype: Dtype = "bfloat16"
    """Parameter dtype for training and rollout. bfloat16 halves the memory and is the GPU choice; float32 gives
    tight trainer/rollout agreement (and is the CPU quickstart's choice), at twice the memory."""


class LoraCfg(Section):
    rank: Annotated[int, Field(ge=0)] = 0
    """LoRA rank. 0 means full fine-tuning (no adapters). Raise it when a LoRA run learns too little for its
    task; each step of rank adds trainable parameters, optimizer state and adapter-sync bytes (docs/lora.md)."""
    alpha: Annotated[float, Field(gt=0)] = 32.0
    """LoRA scaling numerator: the update is (alpha / rank) * B @ A."""
    dropout: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.0
    """Dropout on the LoRA input. RL post-training usually keeps it at 0: it makes the trainer's log-probs differ
    from the rollout's."""
    targets: list[str] = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    """Modules that get adapters. Megatron names (linear_qkv, linear_proj, linear_fc1, linear_fc2, linear_q,
    linear_k, linear_v, linear_fc1_gate, linear_fc1_up) or HF names (q_proj, k_proj, v_proj, o_proj,
    gate_proj, up_proj, down_proj), or `all-linear`. Mapped per engine."""
    type: Literal["lora", "dora", "canonical_lora"] = "lora"
    """Adapter type. canonical_lora puts separate adapters on q, k, v and gate, up (as HF PEFT does)."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0


# -------------------------------------------------------------------------------------------- trainer
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
    there: docs/defaults.md#shared-prompts); always: whenever the rows share
    prompts; never: plain passes only (not `off`: YAML reads it as false). Needs trainer.recompute.granularity none (else the plain passes run); the megatron
    engine always runs the plain passes. With always on a GPU, `rlbridge plan` estimates the plain passes and
    notes the higher trainer peak measured for the shared ones."""

    def width_multiple(self, device: str) -> int:
        """pass_width_multiple resolved for a trainer on `device` (a torch device type): null is
        AUTO_WIDTH_MULTIPLE for the hf engine on cuda (the engine's spec says), else 1."""
        from rlbridge.engines.registry import TRAINER_ENGINES

        if self.pass_width_multiple is not None:
            return self.pass_width_multiple
        return TRAINER_ENGINES[self.engine].auto_width_multiple_cuda if device == "cuda" else 1


# -------------------------------------------------------------------------------------------- rollout
class RolloutCfg(Section):
    engine: Literal["vllm", "hf"] = "vllm"
    """Rollout engine: vllm (CUDA or CPU build) or hf (transformers.generate)."""
    n: PositiveInt = 4
    """Completions sampled per prompt (the group size of GRPO-family algorithms)."""
    tensor_parallel: PositiveInt = 1
    """Tensor-parallel size of each vLLM engine: raise it when one GPU cannot hold the model and its KV cache."""
    engines_per_device: PositiveInt = 1
    """Rollout engines sharing each rollout device (tensor_parallel 1 only). A small model's one engine can leave
    a large GPU's compute idle; two engines each take rollout.gpu_memory_utilization of the device, so lower it
    (e.g. 0.3 each) until all of them and, colocated, the trainer fit: `rlbridge plan` shows the peak."""
    temperature: Annotated[float, Field(ge=0)] = 1.0
    """Sampling temperature. 1.0 samples from the policy the trainer scores (its log-probs are not tempered);
    lower values explore less."""
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    """Nucleus sampling."""
    top_k: int = -1
    """Top-k sampling; -1 turns it off."""
    max_prompt_tokens: PositiveInt = 512
    """Prompts longer than this are filtered out (counted and reported)."""
    max_response_tokens: PositiveInt = 512
    """Maximum generated tokens per completion. Longer allows longer reasoning at a cost that grows with it in
    generation, the update and memory (`rlbridge plan` shows the memory)."""
    ignore_eos: bool = False
    """Training samples go on past the end-of-sequence token to max_response_tokens (vLLM's ignore_eos; the hf
    engine suppresses EOS until then): every response has exactly that length. For measuring step time and memory
    at a given response length (bench/growth.py); it changes what the policy learns from. Evaluation (greedy) still
    stops at EOS."""
    weight_sync: WeightSync = "merged"
    """How trained weights reach the rollout: merged full weights, or a LoRA adapter (needs lora.rank > 0)."""
    weight_transport: Literal["files", "cuda_ipc"] = "files"
    """How merged weights travel from the trainer to vLLM on the same node: files (a safetensors directory in
    /dev/shm that vLLM reloads) or cuda_ipc (a colocated CUDA trainer shares its GPU tensors with vLLM by CUDA IPC
    handles, no copy through host memory; needs cluster.device cuda, colocate, one node, rollout.engine vllm at
    tensor_parallel 1, weight_sync merged and a trainer of one process). Same log-probs as files, faster for large
    weights (tests/gpu/test_gpu_ipc_sync.py; docs/defaults.md#cuda-ipc)."""
    max_lora_rank: PositiveInt = 64
    """vLLM's max_lora_rank; must be >= lora.rank when weight_sync is adapter."""
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = 0.8
    """Fraction of GPU memory vLLM may take (weights + KV cache). On CPU see kv_cache_gib."""
    sleep: Literal["always", "auto", "never"] = "always"
    """Colocated GPUs, sync mode: whether vLLM sleeps through the update (weights offloaded, KV cache freed) and
    wakes for the weight sync. always: every step (the trainer gets the whole device). never: vLLM stays resident
    next to the trainer, which saves the sleep and wake (a tenth of a second or more a step; more for a large
    model's weights) and the trainer's cache release after each update. auto: resident when `rlbridge plan`'s
    peak with vLLM resident is at most 90 % of cluster.gpu_memory_gib, else as always. `rlbridge plan` says which
    it chose (tests/gpu/test_gpu_async.py::test_sync_mode_with_vllm_resident; async mode always keeps vLLM
    resident).
    Set auto or never on a single GPU where both fit (docs/defaults.md#vllm-resident)."""
    kv_cache_gib: Annotated[float, Field(gt=0)] = 1.0
    """CPU build of vLLM only: KV-cache size in GiB (VLLM_CPU_KVCACHE_SPACE)."""
    float32_head: bool = True
    """A 16-bit model's output layer (lm_head) computes in float32 in vLLM (`hf_overrides` head_dtype), as it does
    in both trainers: rounding logits in the tens to bf16 alone moves log p by hundredths, most of the
    trainer-vs-rollout gap (docs/defaults.md#float32-head). Costs a float32 copy of the
    output layer's weight; turn it off only to save that memory. A vLLM build without head_dtype for generation
    models keeps its bf16 head and says so in the rollout log."""
    routing_replay: bool = False
    """Mixture-of-experts models only: record the experts the rollout engine routed every token to (prompt and
    response, each MoE layer's top-k) and make the trainer's forwards (old, reference and training log-probs)
    use them instead of its own router's choice, so both sides route alike even where a rounding difference
    flips a near-tied expert (docs/moe.md). The router's weights over the given experts are still its own.
    Works with rollout.engine hf on any device and vllm on GPUs; vLLM's CPU build cannot return routed experts."""
    flashinfer_sampler: bool = False
    """vLLM's FlashInfer top-k/top-p sampling kernels (VLLM_USE_FLASHINFER_SAMPLER). They are compiled with nvcc
    the first time an engine starts on a machine, a silent step of minutes on a fresh machine
    (docs/defaults.md#vllm-start-up). Off: vLLM's PyTorch sampler, no compilation; with
    top_p = 1 and top_k = -1 (no filter) vLLM samples natively either way. An environment variable
    VLLM_USE_FLASHINFER_SAMPLER set by the user wins."""
    enforce_eager: bool | None = None
    """vLLM without torch.compile and CUDA graphs. null: eager on CPU, compiled on GPUs. true on a GPU starts
    the engine in seconds instead of minutes (torch.compile and CUDA-graph capture skipped) and generates slower;
    good for tests and short debugging runs (docs/defaults.md#vllm-start-up)."""
    gpus: Annotated[int, Field(ge=1)] | None = None
    """Devices for the rollout when cluster.colocate is false (default: as many as the trainer)."""
    mode: Literal["sync", "async"] = "sync"
    """sync: each step generates with the newest weights, then trains on them. async: the rollout generates the
    next steps' batches while the trainer updates, with weights at most max_staleness versions old
    (docs/async.md); on one GPU vLLM then stays resident next to the trainer (no sleep)."""
    max_staleness: Annotated[int, Field(ge=0)] = 1
    """async only: step j trains on samples generated with weight version j - 1 - max_staleness (the newest the
    rollout has while the trainer is max_staleness updates ahead); never older. Above 1 needs an off-policy
    correction (algorithm.rollout_correction)."""

    @property
    def ahead(self) -> int:
        """Steps the rollout generates ahead of the trainer: 0 (sync) or max_staleness (async)."""
        return self.max_staleness if self.mode == "async" else 0


# ------------------------------------------------------------------------------------------ algorithm
class KlCfg(Section):
    coef: Annotated[float, Field(ge=0)] = 0.0
    """KL coefficient against the reference policy (the model with adapters off, or the initial weights)."""
    estimator: Literal["k1", "k2", "k3", "low_var_kl"] = "low_var_kl"
    """KL estimator: k1 = log ratio, k2 = half squared log ratio, k3 = low_var_kl (clamped, non-negative)."""
    where: Literal["loss", "reward"] = "loss"
    """Add the KL term to the loss, or subtract it from the token rewards."""


class ClipCfg(Section):
    low: Annotated[float, Field(ge=0, lt=1)] = 0.2
    """Ratio clipped below at 1 - low."""
    high: Annotated[float, Field(ge=0)] = 0.2
    """Ratio clipped above at 1 + high (DAPO's clip-higher sets it above low)."""
    dual: Annotated[float, Field(gt=1)] | None = None
    """Dual clip constant c > 1 bounding the loss for negative advantages; null turns it off."""


class RejectCfg(Section):
    divergence: Literal["k1", "k2", "k3"] = "k3"
    """Per-token divergence between rollout and trainer, with log w = trainer - rollout log-prob: k1 = |log w|,
    k2 = 0.5 (log w)^2, k3 = w - 1 - log w (each >= 0; 0 when both agree)."""
    level: Literal["token", "sequence_mean", "sequence_max"] = "token"
    """What is rejected: each token whose divergence exceeds the threshold, or each whole sequence whose mean
    (sequence_mean) or largest (sequence_max) token divergence does."""
    threshold: Annotated[float, Field(gt=0)]
    """Rejection threshold (nats for k1; e.g. 0.5 for k1, 0.1 for k2 / k3)."""


class RolloutCorrectionCfg(Section):
    """Correction for the gap between the rollout engine's and the trainer's log-probs (docs/rollout-correction.md).
    The defaults change nothing: no weights, no masks, old log-probs from the trainer."""

    weights: Literal["none", "token", "sequence"] = "none"
    """Importance weights w = pi_trainer / pi_rollout of the sampled tokens, detached, multiplied into the per-token
    policy loss: none, per token, or per sequence (the geometric mean exp(mean_t log w_t), on every token)."""
    clamp_high: Annotated[float, Field(gt=1)] | None = 2.0
    """Truncated importance sampling: weights above this are set to it; null keeps them untruncated. Only used with
    weights token or sequence."""
    mask_band: tuple[Annotated[float, Field(ge=0)], Annotated[float, Field(gt=0)]] | None = None
    """[low, high] with low < 1 < high (IcePop-style): tokens (or sequences, see mask_level) whose importance ratio
    lies outside are left out of the policy loss; null masks nothing."""
    mask_level: Literal["token", "sequence"] = "token"
    """Unit that mask_band judges: each token's ratio, or each sequence's geometric-mean ratio (the whole sequence
    is masked)."""
    reject: RejectCfg | None = None
    """Leave out tokens or sequences whose divergence between rollout and trainer exceeds a threshold; null: none."""
    bypass: bool = False
    """Take the old log-probs from the rollout instead of a trainer forward: the PPO ratio is then against the
    rollout policy (which corrects the mismatch inside the clip) and a step with several optimizer updates
    (data.mini_batch_size < batch_size or trainer.ppo_epochs > 1) runs one forward fewer. Excludes weights,
    mask_band and reject."""

    @property
    def active(self) -> bool:
        """Whether the policy loss changes (weights, masks or rejection): bypass changes the old log-probs instead."""
        return self.weights != "none" or self.mask_band is not None or self.reject is not None


LossAgg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


class _AlgoBase(Section):
    kl: KlCfg = KlCfg()
    clip: ClipCfg = ClipCfg()
    rollout_correction: RolloutCorrectionCfg = RolloutCorrectionCfg()
    entropy_coef: Annotated[float, Field(ge=0)] = 0.0
    """Entropy bonus coefficient: above 0 it rewards keeping the policy's entropy up (against early collapse of
    exploration); it also computes the entropy's gradient."""
    loss_agg: LossAgg = "token-mean"
    """How token losses are aggregated into one number."""

    @property
    def has_critic(self) -> bool:
        """Whether the algorithm trains a value model (PPO's critic) next to the policy."""
        return False


class GrpoCfg(_AlgoBase):
    name: Literal["grpo"] = "grpo"
    norm_std: bool = True
    """Divide group-centred rewards by the group standard deviation."""


class DrGrpoCfg(_AlgoBase):
    name: Literal["dr_grpo"]
    loss_agg: LossAgg = "seq-mean-token-sum-norm"


class OverlongCfg(Section):
    buffer: Annotated[int, Field(ge=0)] = 0
    """Soft overlong penalty zone (tokens before max_response_tokens); 0 turns the penalty off."""
    penalty: Annotated[float, Field(ge=0)] = 1.0
    """Penalty at max_response_tokens; grows linearly through the buffer."""


class DapoCfg(_AlgoBase):
    name: Literal["dapo"]
    clip: ClipCfg = ClipCfg(low=0.2, high=0.28)
    loss_agg: LossAgg = "token-mean"
    dynamic_sampling: bool = True
    """Drop groups whose rewards are all equal and refill the batch."""
    max_refill_rounds: PositiveInt = 3
    """Extra generation rounds allowed per step to refill dropped groups."""
    overlong: OverlongCfg = OverlongCfg()


class GspoCfg(_AlgoBase):
    name: Literal["gspo"]
    clip: ClipCfg = ClipCfg(low=3.0e-4, high=4.0e-4)
    loss_agg: LossAgg = "seq-mean-token-mean"


class RlooCfg(_AlgoBase):
    name: Literal["rloo"]


class ReinforcePPCfg(_AlgoBase):
    name: Literal["reinforce_pp"]
    baseline: bool = False
    """Subtract the group mean before batch normalization (REINFORCE++-baseline)."""


class CriticCfg(Section):
    lr: Annotated[float, Field(gt=0)] = 1.0e-5
    """Critic learning rate."""
    value_clip: Annotated[float, Field(gt=0)] | None = 0.2
    """Value-loss clipping around the old values; null turns it off."""
    loss_coef: Annotated[float, Field(gt=0)] = 0.5
    """Weight of the value loss."""


class PpoCfg(_AlgoBase):
    name: Literal["ppo"]
    gamma: Annotated[float, Field(ge=0, le=1)] = 1.0
    """Discount factor for GAE."""
    lam: Annotated[float, Field(ge=0, le=1)] = 0.95
    """GAE lambda."""
    critic: CriticCfg = CriticCfg()
    adaptive_kl_target: Annotated[float, Field(gt=0)] | None = None
    """Target KL per sequence (nats, summed over the response tokens) of the adaptive KL controller (Ziegler et
    al. 2019): after each step kl.coef is multiplied by 1 + clip(kl / target - 1, -0.2, 0.2) * rollouts /
    adaptive_kl_horizon, starting from kl.coef. Needs kl.where: reward and kl.coef > 0; null keeps kl.coef fixed."""
    adaptive_kl_horizon: PositiveInt = 10000
    """Horizon of the adaptive KL controller in rollouts (Ziegler et al. 2019 and TRL use 10000): the larger, the
    slower kl.coef moves (at most x1.2 per horizon rollouts)."""

    @property
    def has_critic(self) -> bool:
        return True


AlgorithmCfg = Annotated[
    GrpoCfg | DrGrpoCfg | DapoCfg | GspoCfg | RlooCfg | ReinforcePPCfg | PpoCfg,
    Field(discriminator="name"),
]
GROUP_ALGORITHMS = frozenset({"grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp"})


# ----------------------------------------------------------------------------------------------- data
class DatasetCfg(Section):
    path: str
    """Where the rows come from: a local file (.jsonl, .parquet, .json, .csv), a folder (written by Hugging Face
    datasets' `save_to_disk`, or holding data files), a Hugging Face Hub dataset name (`openai/gsm8k`; from the
    local datasets cache when offline), or `builtin:arithmetic` for the generated arithmetic task."""
    config: str | None = None
    """Configuration of a Hub dataset (`openai/gsm8k`: main or socratic)."""
    split: str | None = None
    """Split of a Hub dataset or a folder (default: train for data.train; validation, else test, for data.val).
    A single file has one split."""
    loader: Literal["auto", "datasets"] = "auto"
    """How rows are read. auto: a .jsonl or .parquet file row by row into memory (malformed rows skipped and
    counted), every other source through Hugging Face datasets. datasets: Hugging Face datasets for a .jsonl or
    .parquet file too: memory-mapped Arrow (converted once into the datasets cache), each row read and tokenized
    when it is sampled, so a file of millions of rows never sits in memory; rows unusable as prompts are skipped
    when sampled."""
    prompt_key: str | None = None
    """Column holding the prompt, for this split only (default: data.columns.prompt)."""
    answer_key: str | None = None
    """Column holding the reference answer, for this split only (default: data.columns.answer)."""
    limit: Annotated[int, Field(ge=1)] | None = None
    """Use only the first `limit` rows."""


class ColumnsCfg(Section):
    prompt: str = "question"
    """Column holding the prompt: a string, or a conversation (a list of `{role, content}` messages, TRL's
    conversational format), which the chat template renders as it is."""
    answer: str = "answer"
    """Column holding the reference answer (a string or a number): `sample["answer"]` of the reward functions.
    The row's other columns reach the rewards too (`sample`, or keyword lists of a batched reward)."""


class ArithmeticCfg(Section):
    digits: Annotated[int, Field(ge=1, le=6)] = 2
    """Digits per operand."""
    ops: list[Literal["+", "-", "*"]] = ["+"]
    """Operators drawn uniformly."""
    num_train: PositiveInt = 2000
    """Generated training problems."""
    num_val: PositiveInt = 200
    """Generated held-out problems (disjoint from the training set)."""


class DataCfg(Section):
    train: DatasetCfg
    val: DatasetCfg | None = None
    batch_size: PositiveInt = 8
    """Prompts per step (each sampled rollout.n times): the step's rollouts are batch_size x n. Larger batches
    give steadier gradients and use the devices better, at more time per step."""
    mini_batch_size: Annotated[int, Field(ge=1)] | None = None
    """Prompts per optimizer step; must divide batch_size (default: batch_size, one update per step)."""
    columns: ColumnsCfg = ColumnsCfg()
    """Which columns of the rows are the prompt and the answer (per split: data.train.prompt_key / answer_key)."""
    template: str = "{prompt}"
    """User message built from a row: `{prompt}` is the prompt field; other `{field}`s are row fields. Applies to
    string prompts; a conversation is rendered as it is."""
    system_prompt: str | None = None
    """Optional system message (put in front of a conversation that has none)."""
    chat_template: bool | str = True
    """Format prompts with the tokenizer's chat template (true), a Jinja chat template given here (a string, as
    in a tokenizer's `chat_template`), or encode the plain text (false; string prompts only)."""
    shuffle: bool = True
    """Shuffle every epoch (deterministic from run.seed and the epoch)."""
    arithmetic: ArithmeticCfg = ArithmeticCfg()
    """Settings of the `builtin:arithmetic` task."""

    def keys(self, ds: DatasetCfg, which: str) -> tuple[tuple[str, str], tuple[str, str]]:
        """((prompt column, the recipe key naming it), (answer column, its key)) of one split (train or val)."""
        prompt = (
            (ds.prompt_key, f"data.{which}.prompt_key")
            if ds.prompt_key
            else (self.columns.prompt, "data.columns.prompt")
        )
        answer = (
            (ds.answer_key, f"data.{which}.answer_key")
            if ds.answer_key
            else (self.columns.answer, "data.columns.answer")
        )
        return prompt, answer


# --------------------------------------------------------------------------------------------- reward
class RewardTerm(Section):
    fn: str | None = None
    """Builtin reward name or `package.module:function` (or `model` instead)."""
    model: str | None = None
    """A reward model instead of a function: a sequence-classification model (local directory or Hub id in the
    Hugging Face cache) whose first logit scores prompt + completion, as TRL's GRPOTrainer scores with one; it runs
    on the CPU of a reward worker, in batches. Its name in eval.metrics: `model:<this value>`."""
    weight: float = 1.0
    """Weight in the sum."""
    batched: bool | None = None
    """The function scores the whole batch in one call as TRL's reward_funcs do (`fn(prompts=..., completions=...,
    **columns) -> list[float]`) rather than one sample (`fn(prompt, completion, sample) -> float`). Default:
    batched when its signature has a `prompts`, `completions` or `completion_ids` parameter."""

    @model_validator(mode="after")
    def _fn_or_model(self) -> RewardTerm:
        if (self.fn is None) == (self.model is None):
            raise ValueError("a reward term names either fn (a function) or model (a reward model)")
        return self

    @property
    def name(self) -> str:
        """The term's name: its fn, or model:<model> (RewardResult.terms keys, eval.metrics terms)."""
        return self.fn if self.fn is not None else f"model:{self.model}"


REWARD_BUILTINS = ("arithmetic", "gsm8k", "format", "length")
"""The builtin reward names (rlbridge.data.rewards.BUILTINS), for messages: no reward is implied."""
NO_REWARD = (
    "every recipe names its reward: reward: {fn: NAME} with a builtin ("
    + ", ".join(REWARD_BUILTINS)
    + "), a package.module:function (per sample, or batched as TRL's reward_funcs), or reward.terms for a "
    "weighted sum"
)


class RewardCfg(Section):
    fn: str | None = None
    """Builtin reward (arithmetic, gsm8k, format, length) or `package.module:function`. Use `terms` for a weighted sum.
    There is no default: a recipe names its reward."""
    terms: list[RewardTerm] | None = None
    """Weighted sum of reward functions (instead of fn)."""
    timeout_s: Annotated[float, Field(gt=0)] = 10.0
    """Per-sample time limit; a call past it counts as a reward_error."""
    workers: PositiveInt = 2
    """Reward worker processes. Raise it when a slow reward function (not the model) makes the reward phase
    long."""
    error_budget: Annotated[int, Field(ge=0)] = 100
    """Reward errors tolerated over the run before it stops with the function's traceback."""

    @model_validator(mode="before")
    @classmethod
    def _terms_replace_the_default_fn(cls, data: Any) -> Any:
        # with terms, fn is None rather than its default: the resolved recipe (run dir, checkpoints) then
        # loads again, which `rlbridge resume` relies on
        if isinstance(data, dict) and data.get("terms") is not None and "fn" not in data:
            return {**data, "fn": None}
        return data

    @model_validator(mode="after")
    def _one_of(self) -> RewardCfg:
        if self.terms is not None and self.fn is not None and "fn" in self.model_fields_set:
            raise ValueError("set either reward.fn or reward.terms, not both")
        if self.terms is None and self.fn is None:
            raise ValueError(NO_REWARD)
        return self

    def resolved_terms(self) -> list[RewardTerm]:
        return list(self.terms) if self.terms is not None else [RewardTerm(fn=str(self.fn))]


# ----------------------------------------------------------------------------------------------- eval
class EvalMetric(Section):
    term: str = "reward"
    """What is measured: a reward term's fn as the reward section writes it (`arithmetic`, `pkg.mod:fn`), or `reward`
    for the weighted sum of the terms."""
    threshold: float | None = None
    """None: the mean of the term over the evaluation's completions. A number: the pass rate, the share of prompts
    whose completion scores >= threshold (a failed or unscored completion does not pass)."""
    k: PositiveInt = 1
    """1: one greedy completion per prompt. k > 1: pass@k, k completions per prompt sampled as the rollout samples
    (rollout.temperature, top_p, top_k); a prompt passes when one of them reaches the threshold (needed)."""
    name: str | None = None
    """The metric's name: metrics.jsonl and the console show it as eval_<name>. Default: the term's name (a user
    function's name after the colon), with _pass_rate or _pass@k added for a threshold."""

    @model_validator(mode="after")
    def _pass_at_k_needs_a_threshold(self) -> EvalMetric:
        if self.k > 1 and self.threshold is None:
            raise ValueError(
                f"pass@{self.k} needs a threshold (what counts as a pass); set threshold, or k: 1"
            )
        return self

    @property
    def key(self) -> str:
        """The metric's key in the eval records (eval_...)."""
        if self.name:
            return f"eval_{self.name}"
        base = self.term.rsplit(":", 1)[-1].rsplit(".", 1)[-1]
        if self.threshold is None:
            return f"eval_{base}"
        return f"eval_{base}_pass@{self.k}" if self.k > 1 else f"eval_{base}_pass_rate"

    @property
    def is_rate(self) -> bool:
        """A share of prompts (printed as a percentage) rather than a mean reward."""
        return self.threshold is not None


class EvalCfg(Section):
    metrics: list[EvalMetric] = [EvalMetric()]
    """What each evaluation (run.eval_every, and the first and last step, on run.eval_samples prompts of data.val)
    measures, printed in this order. The first pass rate (a threshold, k 1) is also the `accuracy` of every training
    step's samples (console `acc`). Default: the mean of the weighted reward (eval_reward). E.g.
    `[{term: arithmetic, threshold: 1.0, name: accuracy}, {term: format}, {term: arithmetic, threshold: 1.0, k: 4}]`."""


# ------------------------------------------------------------------------------------------------ run
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
    keep: PositiveInt = 3
    """Complete checkpoints kept; the newest good one is never deleted."""
    dir: str | None = None
    """Run directory (default: runs/<name>-<timestamp>)."""
    eval_every: Annotated[int, Field(ge=0)] = 0
    """Evaluate on data.val every N steps (0: only before and after training)."""
    eval_samples: PositiveInt = 100
    """Validation prompts per evaluation (greedy)."""
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
    """Memory per device, used by the plan's memory estimate."""
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


# --------------------------------------------------------------------------------------------- recipe
class Recipe(Section):
    name: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
    """Run name (letters, digits, dot, dash, underscore)."""
    model: ModelCfg
    lora: LoraCfg = LoraCfg()
    trainer: TrainerCfg = TrainerCfg()
    rollout: RolloutCfg = RolloutCfg()
    algorithm: AlgorithmCfg = GrpoCfg()
    data: DataCfg
    reward: RewardCfg
    """The reward (required: nothing is implied)."""
    eval: EvalCfg = EvalCfg()
    run: RunCfg = RunCfg()
    cluster: ClusterCfg = ClusterCfg()

    @model_validator(mode="before")
    @classmethod
    def _default_algorithm_name(cls, data: Any) -> Any:
        """An algorithm section without `name` is GRPO's, the default (e.g. only `--set algorithm.kl.coef=0.1`
        on a recipe without the section): without this pydantic could not pick the section's type."""
        if (
            isinstance(data, dict)
            and isinstance(data.get("algorithm"), dict)
            and "name" not in data["algorithm"]
        ):
            return {**data, "algorithm": {"name": "grpo", **data["algorithm"]}}
        return data

    @property
    def world_size(self) -> int:
        return self.cluster.nodes * self.cluster.gpus_per_node

    @property
    def mini_batch_size(self) -> int:
        return self.data.mini_batch_size or self.data.batch_size
