"""SDPAttention (rlbridge/engines/megatron/attention.py) against megatron-core's DotProductAttention.

    python tests/megatron/attention_check.py [--device cpu|cuda] [--time]

Random q/k/v in megatron's [s, b, heads, d] layout, GQA (4 query heads on 2 groups, and 6 on 3), through
both modules with the same boolean mask (True = masked): rlbridge's forward mask with left and right
padding, an exactly causal mask (SDPAttention's flash path), no mask with a causal mask type, and a
softmax_scale with apply_query_key_layer_scaling. Outputs and the gradients of q, k and v (of a random
linear function of the outputs at the real query rows) are compared; query rows with no key to attend to
(left padding) are excluded, by design (attention.py's docstring).

Tolerances: float64 on CPU, max abs error < 1e-10 (measured ~1e-15). On CUDA the reference is
DotProductAttention in float32 and SDPAttention runs in bfloat16 under the kernel it is meant to get
(flash for the causal cases, memory-efficient for the padded one: forcing that backend makes a silent
fallback fail); relative error (norm) < 2e-2 (bfloat16 rounding of inputs and output). Dropout: in training
mode with attention_dropout 0.5 the output differs from eval mode and stays finite; in eval mode it
matches.

With --time (CUDA), forward+backward time of both modules at the benchmark's shape is printed too. Prints
one JSON line and exits 1 if a check fails; tests/megatron/test_megatron_attention.py runs it on CPU. Not
collected by pytest (the GPU machine has no pytest).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import zlib
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]

import torch  # noqa: E402


def setup(device: str) -> Any:
    import torch.distributed as dist

    from rlbridge.engines.megatron import compat

    compat.activate()
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        backend = "nccl" if device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    with compat.device_scope():
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(0)
    return compat


def config(heads: int, groups: int, d: int, dtype: torch.dtype, **extra: Any) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=4,
        hidden_size=heads * d,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=d,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        **{"attention_dropout": 0.0, **extra},
    )


def modules(cfg: Any, layer: int = 3) -> tuple[Any, Any]:
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from rlbridge.engines.megatron.attention import SDPAttention

    kw = dict(
        config=cfg, layer_number=layer, attn_mask_type=AttnMaskType.causal, attention_type="self",
        softmax_scale=cfg.softmax_scale,
    )  # fmt: skip
    return DotProductAttention(**kw), SDPAttention(**kw)


def run(module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, w: torch.Tensor) -> Any:
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = module(q, k, v, mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None)
    (out.to(w.dtype) * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def case(
    name: str, device: str, heads: int, groups: int, valid: torch.Tensor | None, explicit: bool, **extra: Any
) -> dict[str, Any]:
    from rlbridge.engines.megatron.forward import attention_mask

    cuda = device == "cuda"
    d, (b, s) = 16, (valid.shape if valid is not None else (3, 12))
    ref_dtype = torch.float32 if cuda else torch.float64
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    q = torch.randn(s, b, heads, d, generator=g, dtype=torch.float64)
    k = torch.randn(s, b, groups, d, generator=g, dtype=torch.float64)
    v = torch.randn(s, b, groups, d, generator=g, dtype=torch.float64)
    w = torch.randn(s, b, heads * d, generator=g, dtype=torch.float64)
    if valid is None:
        valid = torch.ones(b, s, dtype=torch.long)
    mask = attention_mask(valid).to(device) if explicit else None
    # query rows that have at least one key: the rows the comparison covers
    real = (~attention_mask(valid)).any(-1)[:, 0].T  # [s, b]
    w = (w * real[..., None]).to(device, ref_dtype)
    dot, sdpa = modules(config(heads, groups, d, ref_dtype, **extra))
    ref = run(dot.to(device), *(t.to(device, ref_dtype) for t in (q, k, v)), mask, w)
    if cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = SDPBackend.FLASH_ATTENTION if valid.all() else SDPBackend.EFFICIENT_ATTENTION
        with sdpa_kernel([backend]):
            got = run(sdpa.to(device), *(t.to(device, torch.bfloat16) for t in (q, k, v)), mask, w)
    else:
        got = run(sdpa.to(device), *(t.to(device, ref_dtype) for t in (q, k, v)), mask, w)
    names = ("out", "dq", "dk", "dv")
    rm = real[..., None].to(device)
    result: dict[str, Any] = {"case": name}
    for n, a, e in zip(names, got, ref, strict=True):
        a, e = a.double(), e.double()
        if n == "out":
            a, e = a * rm, e * rm
        result[f"{n}_max_abs"] = float((a - e).abs().max())
        result[f"{n}_rel"] = float((a - e).norm() / e.norm().clamp(min=1e-30))
        result[f"{n}_finite"] = bool(torch.isfinite(a).all())
    keys = [k for k in result if k.endswith("_rel" if cuda else "_max_abs")]
    limit = 2e-2 if cuda else 1e-10
    result["ok"] = all(result[k] < limit for k in keys) and all(result[f"{n}_finite"] for n in names)
    return result


def dropout_case(device: str) -> dict[str, Any]:
    cfg = config(4, 2, 16, torch.float32, attention_dropout=0.5)
    _, sdpa = modules(cfg)
    sdpa = sdpa.to(device)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(10, 2, h, 16, generator=g).to(device) for h in (4, 2, 2))
    with torch.no_grad():
        sdpa.eval()
        a = sdpa(q, k, v, None)
        b = sdpa(q, k, v, None)
        sdpa.train()
        c = sdpa(q, k, v, None)
    differs = float((a - c).abs().max())
    return {
        "case": "dropout", "eval_repeat_max_abs": float((a - b).abs().max()), "train_vs_eval_max_abs": differs,
        "ok": float((a - b).abs().max()) == 0.0 and differs > 1e-3 and bool(torch.isfinite(c).all()),
    }  # fmt: skip


def spec_case() -> dict[str, Any]:
    from rlbridge.engines.megatron import attention
    from rlbridge.engines.megatron.provider import local_layer_spec

    cfg = config(4, 2, 16, torch.float32)
    picked = {}
    old = os.environ.get(attention.ENV)
    try:
        for value in ("sdpa", "unfused"):
            os.environ[attention.ENV] = value
            spec = local_layer_spec(cfg)
            picked[value] = spec.submodules.self_attention.submodules.core_attention.__name__
    finally:
        if old is None:
            os.environ.pop(attention.ENV, None)
        else:
            os.environ[attention.ENV] = old
    ok = picked == {"sdpa": "SDPAttention", "unfused": "DotProductAttention"}
    return {"case": "layer_spec", "picked": picked, "ok": ok}


def timing(device: str) -> dict[str, Any]:
    """Forward+backward of one layer's core attention at the benchmark's SmolLM2 shape (bfloat16)."""
    from rlbridge.engines.megatron.forward import attention_mask

    out: dict[str, Any] = {"case": "timing", "shape": "b=4 s=1024 heads=9 groups=3 d=64 bf16", "ok": True}
    dot, sdpa = modules(config(9, 3, 64, torch.bfloat16))
    s, b = 1024, 4
    q = torch.randn(s, b, 9, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(s, b, 3, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(s, b, 3, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    valid = torch.ones(b, s, dtype=torch.long)
    padded = valid.clone()
    padded[:, :100] = 0
    for label, mod in (("unfused", dot.to(device)), ("sdpa", sdpa.to(device))):
        for mname, vv in (("causal", valid), ("padded", padded)):
            mask = attention_mask(vv).to(device)
            times = []
            for i in range(13):
                torch.cuda.synchronize()
                t = time.perf_counter()
                mod(q, k, v, mask).float().sum().backward()
                torch.cuda.synchronize()
                if i >= 3:
                    times.append(time.perf_counter() - t)
            out[f"{label}_{mname}_ms"] = 1000 * sorted(times)[len(times) // 2]
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--time", action="store_true")
    args = ap.parse_args()
    compat = setup(args.device)
    if args.device == "cuda":
        torch.cuda.set_device(0)
    ragged = torch.tensor(
        [[0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1], [1] * 12, [0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0]]
    )
    results = []
    with compat.device_scope():
        results.append(case("padded_gqa2", args.device, 4, 2, ragged, True))
        results.append(case("causal_mask_gqa3", args.device, 6, 3, None, True))
        results.append(case("no_mask_causal_type", args.device, 4, 2, None, False))
        results.append(case("mha_padded", args.device, 4, 4, ragged, True))
        results.append(
            case("scale_and_layer_scaling", args.device, 4, 2, ragged, True, softmax_scale=0.3,
                 apply_query_key_layer_scaling=True, attention_softmax_in_fp32=True)
        )  # fmt: skip
        results.append(dropout_case(args.device))
        results.append(spec_case())
        if args.time and args.device == "cuda":
            results.append(timing(args.device))
    ok = all(r["ok"] for r in results)
    print("ATTENTION_CHECK " + json.dumps({"device": args.device, "ok": ok, "results": results}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
