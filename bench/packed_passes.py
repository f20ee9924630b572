"""Packed passes against padded ones: one step's forward + backward over the same rows, model, LoRA, output layer
and loss in two layouts, to size the lever of issue 47 item 3 before the hf engine changes.

- padded: the hf engine's layout under a token budget (rlbridge/engines/micro.py): rows sorted by length, passes
  of at most `--max-tokens` computed positions, each trimmed to its own prompt and response widths, SDPA with the
  padding mask;
- packed: each pass's real tokens concatenated into one row (no padding), position ids restarting per row, and
  varlen attention over the rows' boundaries (`cu_seqlens`): torch's `varlen_attn` (FlashAttention-2 in torch) on
  CUDA, one SDPA per row on the CPU (bench/trl_async.py's stand-in, as TRL's packed trainer runs here), passes of at
  most `--max-tokens` real tokens.

Both run the output layer on the response positions only, in float32, and the GRPO token-mean loss of random
advantages over the step's response tokens, so a step's gradient is the same in both (checked here on every run:
the log-probs of the first pass and the LoRA gradients, `--check`; tests/unit/bench/test_packed_passes.py on CPU
in float32). The batch: `--batch` rows with prompt and response lengths uniform in their ranges (random ids,
seeded; bench/update_padding.py's), random weights of bench/trainer_gpu.py's shapes, peft LoRA on every linear
layer. Layouts alternate step by step; no optimizer step (the same in both).

    python bench/packed_passes.py [--model smollm2-135m] [--layers N] [--device cuda] [--batch 512]
        [--max-tokens 32768] [--lora-rank 16] [--warmup 1] [--steps 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.trainer_gpu import SHAPES  # noqa: E402
from bench.update_padding import add_model_args, lengths_batch, save_model  # noqa: E402

VARLEN = "rlbridge_bench_varlen"
"""The attention implementation name the packed layout registers with transformers."""
VARLEN_CALLS = [0]
"""Layer calls of the VARLEN attention so far: the check that the packed passes ran it (transformers would
otherwise fall back silently to a block mask from the position ids)."""


def register_varlen() -> None:
    """transformers attention `VARLEN`: the layer's queries, keys and values of one packed row [1, heads, T, dim]
    through bench/trl_async.py's flash_attn_varlen_func stand-in with the pass's cu_seqlens (model kwargs
    cu_seq_lens_q / max_length_q, which transformers hands to the attention function); no mask is built."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    from bench.trl_async import varlen_stand_in

    varlen = varlen_stand_in().flash_attn_varlen_func

    def attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kw: Any) -> Any:
        cu, longest = kw["cu_seq_lens_q"], kw["max_length_q"]
        VARLEN_CALLS[0] += 1
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, dim]
        out = varlen(q, k, v, cu, cu, longest, longest, softmax_scale=kw.get("scaling"), causal=True)
        return out.unsqueeze(0), None  # [1, T, heads, dim], as sdpa_attention_forward returns

    AttentionInterface.register(VARLEN, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(VARLEN, flash_attention_mask)  # None without a padding mask


def build_model(args: argparse.Namespace, dtype: Any) -> Any:
    """peft LoRA (rank, alpha 2 x rank, every linear layer, no dropout) on random weights of args.model's shape."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        save_model(args.model, args.layers, Path(tmp))
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype, attn_implementation="sdpa")
    cfg = LoraConfig(
        r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules="all-linear", lora_dropout=0.0
    )
    torch.manual_seed(1)
    model = get_peft_model(model, cfg).to(args.device)
    for name, p in model.named_parameters():  # B = 0 would leave A's gradient 0: nothing to compare
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


def padded_passes(batch: Any, max_tokens: int) -> list[tuple[list[int], Any]]:
    """(rows, trimmed SeqBatch) of each padded pass: the hf engine's token-budget layout."""
    from rlbridge.engines.micro import micro_batch_rows

    return [
        (g.tolist(), batch.select(g).trimmed()) for g in micro_batch_rows(batch, 1, max_tokens=max_tokens)
    ]


def packed_passes(batch: Any, max_tokens: int) -> list[list[int]]:
    """Rows (index order) of each packed pass: as many as fit `max_tokens` real tokens, at least one."""
    lengths = batch.attention_mask.sum(dim=1).tolist()
    passes: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(lengths):
        if passes[-1] and used + n > max_tokens:
            passes.append([])
            used = 0
        passes[-1].append(i)
        used += n
    return passes


def head_logprobs(model: Any, hidden: Any, targets: Any) -> Any:
    """Log-probs of `targets` [n] from `hidden` [n, h] through the output layer in float32."""
    import torch

    head = model.get_output_embeddings()
    logits = torch.nn.functional.linear(hidden.float(), head.weight.float())
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]


def run_padded(model: Any, sub: Any, device: str) -> tuple[Any, Any]:
    """(log-probs [rows, R] masked by the response mask, the mask) of one padded pass."""
    body = model.get_base_model().model
    ids = sub.input_ids.to(device)
    out = body(
        input_ids=ids, attention_mask=sub.attention_mask.to(device), position_ids=sub.position_ids.to(device)
    ).last_hidden_state
    p, r = sub.prompt_width, sub.response_width
    hidden = out[:, p - 1 : p - 1 + r]  # position t predicts token t + 1
    lp = head_logprobs(model, hidden.reshape(-1, hidden.shape[-1]), ids[:, p : p + r].reshape(-1))
    return lp.view(sub.size, r), sub.response_mask.to(device)


def run_packed(model: Any, batch: Any, rows: list[int], device: str) -> list[Any]:
    """Per row of `rows`: the log-probs [R_i] of its real response tokens, from one packed pass."""
    import torch

    body = model.get_base_model().model
    ids, pos, starts, picks, targets, spans = [], [], [0], [], [], []
    for i in rows:
        real = batch.attention_mask[i] > 0
        seq = batch.input_ids[i][real]
        n_resp = int(real[batch.prompt_width :].sum())
        base = starts[-1]
        ids.append(seq)
        pos.append(torch.arange(len(seq)))
        picks.append(torch.arange(len(seq) - n_resp - 1, len(seq) - 1) + base)
        targets.append(seq[len(seq) - n_resp :])
        spans.append(n_resp)
        starts.append(base + len(seq))
    cu = torch.tensor(starts, dtype=torch.int32, device=device)
    longest = int((cu[1:] - cu[:-1]).max())
    out = body(
        input_ids=torch.cat(ids)[None].to(device),
        position_ids=torch.cat(pos)[None].to(device),
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=longest,
        max_length_k=longest,
    ).last_hidden_state[0]
    lp = head_logprobs(model, out[torch.cat(picks).to(device)], torch.cat(targets).to(device))
    return list(lp.split(spans))


def step(model: Any, batch: Any, layout: str, max_tokens: int, adv: Any, device: str) -> dict[int, Any]:
    """Forward + backward of the step's GRPO token-mean loss (-adv x log-prob over every response token, divided by
    their count) in `layout`; the gradients accumulate in the LoRA parameters. Returns the log-probs per row (only
    the first pass's rows are kept, for the check)."""
    total = float(batch.response_mask.sum())
    kept: dict[int, Any] = {}
    if layout == "padded":
        model.set_attn_implementation("sdpa")
        for k, (rows, sub) in enumerate(padded_passes(batch, max_tokens)):
            lp, mask = run_padded(model, sub, device)
            loss = -(lp * mask * adv[rows].to(device)[:, None]).sum() / total
            loss.backward()
            if k == 0:
                kept = {i: lp[j][mask[j] > 0].detach() for j, i in enumerate(rows)}
    else:
        model.set_attn_implementation(VARLEN)
        for k, rows in enumerate(packed_passes(batch, max_tokens)):
            lps = run_packed(model, batch, rows, device)
            loss = -sum((lp * adv[i].to(device)).sum() for i, lp in zip(rows, lps, strict=True)) / total
            loss.backward()
            if k == 0:
                kept = {i: lp.detach() for i, lp in zip(rows, lps, strict=True)}
    return kept


def lora_grads(model: Any) -> dict[str, Any]:
    """The LoRA parameters' gradients (float32 copies), zeroing them for the next step."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            out[name] = p.grad.detach().float().clone()
            p.grad = None
    return out


def compare(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Largest |a - b| over every tensor, relative to the largest |a| of that tensor."""
    return max(float((a[k] - b[k]).abs().max() / a[k].abs().max().clamp(min=1e-30)) for k in a)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32768)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--prompt-min", type=int, default=60)
    ap.add_argument("--prompt-max", type=int, default=200)
    ap.add_argument("--response-min", type=int, default=20)
    ap.add_argument("--response-max", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="folder for packed_passes.json")
    args = ap.parse_args(argv)

    import torch

    dtype = getattr(torch, args.dtype or ("float32" if args.device == "cpu" else "bfloat16"))
    register_varlen()
    model = build_model(args, dtype)
    batch = lengths_batch(args, int(SHAPES[args.model]["vocab_size"]))
    adv = torch.randn(batch.size, generator=torch.Generator().manual_seed(args.seed + 1))
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    layouts = ("padded", "packed")
    times: dict[str, list[float]] = {name: [] for name in layouts}
    peaks = dict.fromkeys(layouts, 0.0)
    gaps: dict[str, float] = {}
    for k in range(args.warmup + args.steps):
        got = {}
        for name in layouts:  # alternating: both see the same machine load
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            kept = step(model, batch, name, args.max_tokens, adv, args.device)
            sync()
            if k >= args.warmup:
                times[name].append(time.perf_counter() - start)
            if cuda:
                peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated() / 2**30)
            got[name] = (kept, lora_grads(model))
        if k == 0:  # the same step's numbers in both layouts: rows of both first passes, every LoRA gradient
            (kp, gp), (kq, gq) = got["padded"], got["packed"]
            common = sorted(set(kp) & set(kq))
            gaps = {
                "logprob_max_abs": max(float((kp[i] - kq[i]).abs().max()) for i in common),
                "logprob_rows_compared": len(common),
                "grad_max_rel": compare(gp, gq),
            }
    real = int(batch.attention_mask.sum())
    computed = sum(sub.input_ids.numel() for _, sub in padded_passes(batch, args.max_tokens))
    result = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "dtype": str(dtype),
        "device_name": torch.cuda.get_device_name() if cuda else "cpu",
        "real_tokens": real,
        "padded_positions": computed,
        "passes": {
            "padded": len(padded_passes(batch, args.max_tokens)),
            "packed": len(packed_passes(batch, args.max_tokens)),
        },
        "step_times_s": times,
        "step_s_median": {n: statistics.median(t) for n, t in times.items()},
        "tokens_per_s": {n: real / statistics.median(t) for n, t in times.items()},
        "speedup_packed": statistics.median(times["padded"]) / statistics.median(times["packed"]),
        "peak_gib": peaks,
        "check": gaps,
        "varlen_layer_calls": VARLEN_CALLS[0],
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "packed_passes.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
