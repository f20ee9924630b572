"""Recipe + model shape -> Plan: who runs where, how the batch splits, and what each GPU must hold.

Placement and the rank layout are here; the batch arithmetic is in batches.py, the memory estimate and its
notes in memory_estimate.py, and every name the rest of the code uses is imported from `rlbridge.plan`.
Pure arithmetic, no GPU, no heavy import: the plan of a 64-GPU run prints on a laptop in milliseconds,
and everything the cluster layer and the loop need (bundles, rank coordinates, micro-batch counts) is
read from here rather than re-derived.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from rlbridge.model.info import ModelInfo
from rlbridge.plan.batches import (
    Batches,
    batches,
    num_micro_batches,
    num_mini_batches,
    total_optimizer_steps,
)
from rlbridge.plan.memory_estimate import (
    ALLOCATOR_RESERVE,
    CONTEXT_GIB,
    DTYPE_BYTES,
    GIB,
    RESIDENT_SHARE,
    Memory,
    lora_params,
    memory,
    memory_notes,
    reward_model_gib,
    rollout_engine_groups,
)
from rlbridge.recipe.schema import Recipe
from rlbridge.rollout.registry import rollout_engine, rollout_engines_that
from rlbridge.rollout.spec import ENGINE_KEYS

__all__ = [
    "ALLOCATOR_RESERVE",
    "CONTEXT_GIB",
    "DTYPE_BYTES",
    "GIB",
    "Batches",
    "Memory",
    "Plan",
    "RankCoord",
    "batches",
    "lora_params",
    "make_plan",
    "memory",
    "num_micro_batches",
    "num_mini_batches",
    "rank_coords",
    "resolved_sleep",
    "reward_model_gib",
    "rollout_sleeps",
    "total_optimizer_steps",
]


@dataclass(frozen=True)
class RankCoord:
    rank: int
    node: int
    local: int
    dp: int
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int


@dataclass(frozen=True)
class Plan:
    world_size: int
    device: str
    dp: int
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    vpp: int
    colocate: bool
    bundles_per_node: list[list[dict[str, float]]]
    """Ray bundles of the trainer (and of the colocated rollout), one list per node."""
    rollout_bundles: list[dict[str, float]]
    """Extra bundles of a rollout that is not colocated, one per engine holding its rollout.tensor_parallel
    devices (so that vLLM's tensor-parallel workers share a node); empty when colocated."""
    trainer_ranks: list[RankCoord]
    rollout_engines: int
    rollout_tp: int
    rollout_devices: list[list[int]]
    """Each rollout engine's devices. Colocated: the trainer devices (ranks) it shares, engine i on ranks
    i*tp .. i*tp+tp-1, on their node. Separate: its own devices, numbered 0.. after the trainer's (engine i on
    devices i*tp .. i*tp+tp-1, in bundle len(trainer bundles) + i, on whichever node Ray finds room). With
    rollout.engines_per_device k > 1 (tensor_parallel 1) engines k*d .. k*d+k-1 share device d."""

    @property
    def engines_per_device(self) -> int:
        """Rollout engines on each rollout device (rollout.engines_per_device; 1 at tensor_parallel > 1)."""
        return max(sum(1 for d in self.rollout_devices if d == self.rollout_devices[0]), 1)

    batches: Batches
    memory: Memory | None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def engine_places(self) -> list[str]:
        """Where each rollout engine sits, one phrase per engine: colocated on trainer devices (and their node),
        or on rollout devices of its own (any node)."""
        nodes = {c.rank: c.node for c in self.trainer_ranks}
        out = []
        for i, devices in enumerate(self.rollout_devices):
            span = f"{devices[0]}" if len(devices) == 1 else f"{devices[0]}-{devices[-1]}"
            if self.engines_per_device > 1:
                span += f" (shared by {self.engines_per_device} engines)"
            if self.colocate:
                on = sorted({nodes.get(d, 0) for d in devices})
                out.append(f"engine {i}: trainer device(s) {span} (node {', '.join(map(str, on))})")
            else:
                out.append(f"engine {i}: rollout device(s) {span} of its own")
        return out


def rank_coords(r: Recipe) -> list[RankCoord]:
    """Megatron's default order: tp fastest, then cp, dp, pp (experts: etp, ep, edp, pp)."""
    p, c = r.trainer.parallel, r.cluster
    world = r.world_size
    tp, cp, pp = p.tensor, p.context, p.pipeline
    dp = world // (tp * cp * pp)
    etp, ep = p.expert_tensor, p.expert
    per_stage = world // pp
    out = []
    for rank in range(world):
        tp_r, rest = rank % tp, rank // tp
        cp_r, rest = rest % cp, rest // cp
        dp_r, pp_r = rest % dp, rest // dp
        in_stage = rank % per_stage
        etp_r = in_stage % etp
        ep_r = (in_stage // etp) % ep
        out.append(
            RankCoord(
                rank, rank // c.gpus_per_node, rank % c.gpus_per_node, dp_r, tp_r, pp_r, cp_r, ep_r, etp_r
            )
        )
    return out


def _sleep_applies(r: Recipe) -> bool:
    """rollout.sleep matters only for vLLM colocated with the trainer on GPUs in sync mode."""
    c = r.cluster
    return (
        c.colocate and c.device == "cuda" and rollout_engine(r).reserves_memory and r.rollout.mode == "sync"
    )


def unread_rollout_keys(r: Recipe) -> list[str]:
    """A note for each engine-tuning rollout key (rollout/spec.ENGINE_KEYS) the recipe sets away from its default
    that its rollout.engine does not read: the value changes nothing, which the user should know."""
    spec, fields = rollout_engine(r), type(r.rollout).model_fields

    def readers(key: str) -> str:
        return rollout_engines_that(lambda e: key in e.reads)

    return [
        f"rollout.{key} {getattr(r.rollout, key)} changes nothing: rollout.engine {spec.name} does not read it "
        f"({readers(key)} does)"
        for key in ENGINE_KEYS
        if key not in spec.reads and getattr(r.rollout, key) != fields[key].default
    ]


def rollout_sleeps(r: Recipe, plan: Plan) -> bool:
    """Whether vLLM sleeps through each update: only where rollout.sleep applies, then as it says (auto: as the
    plan's memory decided; without the model's shape, as always)."""
    if not _sleep_applies(r):
        return False
    if plan.memory is None:
        return r.rollout.sleep != "never"
    return plan.memory.rollout_sleeps


def resolved_sleep(r: Recipe, sleeps: bool) -> Recipe:
    """The recipe with rollout.sleep auto replaced by what the plan decided (`rollout_sleeps`): 'always' where
    vLLM sleeps through the update, else 'never' (what a worker without the plan acts on)."""
    rollout = r.rollout.model_copy(update={"sleep": "always" if sleeps else "never"})
    return r.model_copy(update={"rollout": rollout})


SHORT_TIME_LIMIT_S = 600.0
"""run.time_limit_s below this gets a note: start-up alone took 35-180 s in measured runs, and a limit meant in
minutes but written as seconds would stop a job minutes in (saved, but not what was asked)."""


def make_plan(r: Recipe, m: ModelInfo | None) -> Plan:
    p, c = r.trainer.parallel, r.cluster
    world = r.world_size
    tp, pp, cp = p.tensor, p.pipeline, p.context
    dp = max(world // (tp * pp * cp), 1)
    unit = "GPU" if c.device == "cuda" else "CPU"
    bundle = {"GPU": 1.0, "CPU": 1.0} if unit == "GPU" else {"CPU": 1.0}
    bundles = [[dict(bundle) for _ in range(c.gpus_per_node)] for _ in range(c.nodes)]
    rtp = r.rollout.tensor_parallel
    # one group per rtp devices, `per_device` engines on each
    engine_groups, per_device = rollout_engine_groups(r)
    num_engines = engine_groups * per_device
    rollout_bundles = (
        [] if c.colocate else [{k: v * rtp for k, v in bundle.items()} for _ in range(engine_groups)]
    )
    b = batches(r, dp)
    notes = []
    if c.device == "cpu":
        notes.append("cpu device: each 'GPU' is a CPU worker process; collectives use gloo")
    if r.rollout.mode == "async":
        where = (
            "on the trainer's devices, resident next to it (no sleep)"
            if c.colocate
            else f"on {r.rollout_devices} device(s) of its own"
        )
        notes.append(
            f"async: the rollout generates up to {r.rollout.max_staleness} step(s) ahead of the trainer, {where}"
        )
    per_engine = -(-b.rollouts_per_step // num_engines)
    seqs = r.rollout.max_num_seqs if "max_num_seqs" in rollout_engine(r).reads else None
    if seqs is not None and seqs < per_engine:
        notes.append(
            f"rollout.max_num_seqs {seqs} is below the {per_engine} rollouts each engine "
            f"generates per step: it generates them in waves ({per_engine} or more decodes them at once)"
        )
    limit = r.run.time_limit_s
    if limit is not None and limit < SHORT_TIME_LIMIT_S:
        notes.append(
            f"run.time_limit_s is {limit:g} seconds ({limit / 60:.1f} min), start-up included (a cluster job's limit "
            "less a margin, in seconds): where start-up takes most of it, each run saves after its first step and stops"
        )
    notes += unread_rollout_keys(r)
    mem = memory(r, m, dp, b) if m is not None else None
    if _sleep_applies(r) and r.rollout.sleep == "auto" and mem is not None:
        notes.append(
            "rollout.sleep auto: vLLM stays resident through the update (no sleep or wake)"
            if not mem.rollout_sleeps
            else f"rollout.sleep auto: vLLM sleeps through the update (resident, the peak would pass "
            f"{RESIDENT_SHARE:.0%} of the {mem.capacity:.0f} GiB)"
        )
    if mem is not None and m is not None:
        notes += memory_notes(r, m, dp, b, mem)
    return Plan(
        world_size=world,
        device=c.device,
        dp=dp,
        tp=tp,
        pp=pp,
        cp=cp,
        ep=p.expert,
        etp=p.expert_tensor,
        vpp=p.virtual_pipeline or 1,
        colocate=c.colocate,
        bundles_per_node=bundles,
        rollout_bundles=rollout_bundles,
        trainer_ranks=rank_coords(r),
        rollout_engines=num_engines,
        rollout_tp=rtp,
        rollout_devices=[
            list(range(g * rtp, (g + 1) * rtp)) for g in range(engine_groups) for _ in range(per_device)
        ],
        batches=b,
        memory=mem,
        notes=notes,
    )
