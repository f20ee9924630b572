"""Weight sync on one GPU, trainer side: LoRA adapter only against merged full weights, megatron engine.

The GPU machine has no vLLM, so this measures what the trainer does for a sync, through rlbridge's real
path: `TrainerRole.export_weights(kind, as_files=True)` (rlbridge/trainer/role.py), which calls the megatron
engine's `export_weights(kind)` (Megatron-Bridge's exporters: gather, for 'merged' fold the adapters into
the base weights on the GPU, copy to the host) and then writes the RAM-backed directory a same-node vLLM
would load (rlbridge/weights/directory.py: merged = an HF directory cast to the model dtype, adapter = a
PEFT directory; when /dev/shm has under 4 GiB free, as in a container's default 64 MB, the temp dir
instead, named in the result's `weights_dir`). The engine's `export_weights` is wrapped with a timer, so
one call gives both parts: `export_s` (inside the engine) and `write_s` (the rest: files, dtype cast,
checks). What vLLM then does with the directory (CPU numbers: bench/weight_sync.py) is not measured here.

Models and training setup are bench/trainer_gpu.py's (imported): random-weight SmolLM2-135M- and
Qwen2.5-0.5B-shaped checkpoints in bfloat16, the megatron engine (local spec, default core attention), LoRA
rank 16 / alpha 32 on linear_qkv, linear_proj, linear_fc1, linear_fc2, batch `--batch` x (`--prompt` +
`--response`) tokens in micro-batches of `--micro`. One process per model. After the engine is built, the
adapters' B matrices (zero at init) are set to random values (std 0.01) so the merge does real work and
the check below is not vacuous. Then `--warmup` rounds and `--repeats` timed rounds of
train_step -> sync(adapter) -> sync(merged) (the two kinds alternate order between rounds); medians are
reported. `share_of_step` = sync_s / (train_step_s + sync_s): the sync's share of a trainer step (no
generation, reward or log-prob phases: in a whole RL step the share is smaller).

Equality check (merged export): for the middle layer, each of q/k/v/o/gate/up/down, the merged weight
against base + (alpha / r) * B @ A computed here in float64 from the checkpoint's base weight (the HF file
the engine loaded) and the adapter export's lora_A / lora_B (of the same model state). The merged tensor is
bfloat16, so it may differ by rounding: at most two bf16 roundings (u = 2^-8 each: the product and the sum)
allows |merged - ref| <= 2^-7 * (|ref| + s * |B| @ |A|) elementwise (`tol`); reported as the worst ratio
err / that bound (pass <= 1). Also: the merged names equal the checkpoint's, the non-adapted tensors
(embedding, norms) are bit-equal to the checkpoint, and the merged-minus-base difference has the norm of
the reference delta (so a dropped or mis-scaled merge fails).

    python bench/weight_sync_gpu.py [--models smollm2-135m,qwen2.5-0.5b] [--warmup 1] [--repeats 5]
        [--batch 8] [--prompt 512] [--response 512] [--micro 4] [--job-timeout 300] [--out DIR]
    (CPU dry run: --models tiny --batch 2 --prompt 16 --response 16 --micro 1 --repeats 2)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.trainer_gpu import GIB, SHAPES, build_engine, save_model, train_inputs  # noqa: E402

PROJS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]  # fmt: skip
BF16_U = 2.0**-8  # unit roundoff of bfloat16 (8 significant bits)


def dir_bytes(path: str | None) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) if path else 0


def merge_check(model_dir: str, layer: int, merged: dict[str, Any], adapter: dict[str, Any],
                config: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """The merged export against base + s * B @ A in float64, for one layer (module docstring)."""
    import torch
    from safetensors.torch import load_file

    base = load_file(str(Path(model_dir) / "model.safetensors"))
    scale = float(config["lora_alpha"]) / float(config["r"])
    per: dict[str, Any] = {}
    for proj in PROJS:
        name = f"model.layers.{layer}.{proj}"
        a = adapter[f"base_model.model.{name}.lora_A.weight"].double()
        b = adapter[f"base_model.model.{name}.lora_B.weight"].double()
        w0 = base[f"{name}.weight"].double()
        delta = scale * (b @ a)
        ref = w0 + delta
        got = merged[f"{name}.weight"]
        bound = 2 * BF16_U * (ref.abs() + scale * (b.abs() @ a.abs())) + 1e-30
        err = (got.double() - ref).abs()
        per[proj] = {
            "dtype": str(got.dtype).split(".")[-1],
            "max_abs_err": float(err.max()),
            "worst_err_over_tol": float((err / bound).max()),
            "rel_err": float(err.norm() / ref.norm()),
            "delta_rel_to_base": float(delta.norm() / w0.norm()),
            # ||merged - base|| / ||delta||: 1 when the merge is applied with the right scale
            "applied_delta_ratio": float((got.double() - w0).norm() / delta.norm()),
        }
    untouched = [n for n in base if n in merged and not any(n.endswith(f".{p}.weight") for p in PROJS)]
    unequal = [n for n in untouched if not torch.equal(merged[n].to(base[n].dtype), base[n])]
    names_equal = set(merged) == set(base) - ({"lm_head.weight"} if "lm_head.weight" not in merged else set())
    worst = max(v["worst_err_over_tol"] for v in per.values())
    applied = all(abs(v["applied_delta_ratio"] - 1) < 0.05 for v in per.values())
    return {"layer": layer, "scale": scale, "tol": "|merged - ref| <= 2^-7 * (|ref| + s*|B|@|A|) elementwise",
            "worst_err_over_tol": worst, "max_rel_err": max(v["rel_err"] for v in per.values()),
            "names_equal": names_equal, "untouched_tensors": len(untouched), "untouched_unequal": unequal[:5],
            "delta_applied": applied, "ok": worst <= 1.0 and names_equal and not unequal and applied,
            "per_projection": per}  # fmt: skip


# ----------------------------------------------------------------------------------------------- job
def run_job(spec: dict[str, Any]) -> dict[str, Any]:
    import shutil

    import torch

    from rlbridge.trainer.role import TrainerRole
    from rlbridge.weights import directory as weights_dir
    from rlbridge.weights.directory import remove_dir

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    # the real path writes into /dev/shm; a container's default /dev/shm (64 MB) cannot hold a merged
    # model, and then rollout would fail the same way: fall back to the temp dir and say so in the result
    shm_free = shutil.disk_usage("/dev/shm").free if Path("/dev/shm").is_dir() else 0
    where = f"/dev/shm ({shm_free / GIB:.1f} GiB free)"
    if shm_free < 4 * GIB:
        weights_dir.ram_tempdir = lambda prefix: Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-"))
        where = f"{tempfile.gettempdir()} (not /dev/shm: {shm_free / GIB:.2f} GiB free there)"
    engine, recipe, build_s = build_engine(spec)
    trainer = TrainerRole(recipe, spec["model_dir"], engine_factory=lambda: engine)
    batch, loss_fn, num_micro = train_inputs(spec)
    names = {type(mod).__name__ for chunk in engine.model for mod in chunk.modules()}
    attention = ",".join(sorted(names & {"SDPAttention", "DotProductAttention"}))

    # adapters as after some training: B (zero at init) random, so the merge moves every adapted weight
    gen = torch.Generator().manual_seed(1)
    state = engine.trainable_state()
    engine.load_trainable_state({k: v + 0.01 * torch.randn(v.shape, generator=gen).to(v.device, v.dtype)
                                 if ".linear_out." in k else v for k, v in state.items()})  # fmt: skip

    inner = engine.export_weights
    probe: dict[str, float] = {}

    def timed_export(kind: str) -> Any:
        sync()
        before = torch.cuda.memory_allocated() if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        out = inner(kind)
        sync()
        probe["export_s"] = time.perf_counter() - t
        probe["export_gpu_extra_gib"] = ((torch.cuda.max_memory_allocated() - before) / GIB) if cuda else 0.0
        return out

    engine.export_weights = timed_export  # TrainerRole calls it; the instance attribute shadows the method

    def one_sync(kind: str) -> dict[str, Any]:
        t = time.perf_counter()
        export = trainer.export_weights(kind, as_files=True)
        total = time.perf_counter() - t
        row = {"sync_s": total, "export_s": probe["export_s"], "write_s": total - probe["export_s"],
               "export_gpu_extra_gib": probe["export_gpu_extra_gib"], "tensor_bytes": trainer.last_export_bytes(),
               "file_bytes": dir_bytes(export.path), "files": sorted(p.name for p in Path(str(export.path)).iterdir())}  # fmt: skip
        remove_dir(Path(str(export.path)))
        return row

    kinds = ["adapter", "merged"]
    steps: list[float] = []
    syncs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    for i in range(spec["warmup"] + spec["repeats"]):
        sync()
        t = time.perf_counter()
        m = engine.train_step(batch, loss_fn, num_micro_batches=num_micro)
        sync()
        step_s = time.perf_counter() - t
        rows = {k: one_sync(k) for k in (kinds if i % 2 == 0 else kinds[::-1])}
        if i >= spec["warmup"]:
            steps.append(step_s)
            for k in kinds:
                syncs[k].append(rows[k])
        print(f"round {i}: step {step_s:.3f} s, " + ", ".join(f"{k} {rows[k]['sync_s']:.3f} s" for k in kinds),
              file=sys.stderr, flush=True)  # fmt: skip

    # the equality check: one adapter and one merged export of the same state (no step in between)
    engine.export_weights = inner
    adapter = engine.export_weights("adapter")
    merged = engine.export_weights("merged")
    check = merge_check(spec["model_dir"], SHAPES[spec["model"]]["num_hidden_layers"] // 2, merged.tensors,
                        adapter.tensors, adapter.adapter_config or {})  # fmt: skip

    med = statistics.median
    step_s = med(steps)
    out: dict[str, Any] = {"model": spec["model"], "core_attention": attention, "build_s": build_s, "weights_dir": where,
                           "train_step_s": step_s, "train_step_s_all": steps, "grad_norm": float(m["grad_norm"]),
                           "trainable_params": sum(v.numel() for v in state.values()), "kinds": {},
                           "merge_check": check}  # fmt: skip
    for k in kinds:
        rs = syncs[k]
        s = med(r["sync_s"] for r in rs)
        out["kinds"][k] = {
            "tensor_bytes": rs[-1]["tensor_bytes"], "file_bytes": rs[-1]["file_bytes"], "files": rs[-1]["files"],
            "export_s": med(r["export_s"] for r in rs), "write_s": med(r["write_s"] for r in rs), "sync_s": s,
            "sync_s_min": min(r["sync_s"] for r in rs), "sync_s_max": max(r["sync_s"] for r in rs),
            "export_gpu_extra_gib": max(r["export_gpu_extra_gib"] for r in rs),
            "sync_per_train_step": s / step_s, "share_of_step": s / (step_s + s), "per_sync": rs,
        }  # fmt: skip
    return out


# ------------------------------------------------------------------------------------------ driver
def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-0.5b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--response", type=int, default=512)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds (train_step + both syncs)")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds")
    ap.add_argument("--job-timeout", type=float, default=300.0, help="seconds per model process")
    ap.add_argument(
        "--out", default=None, help="Also write the JSON and the table here (default: bench/results/)."
    )
    ap.add_argument("--job", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.job:
        print("RESULT " + json.dumps(run_job(json.loads(args.job))), flush=True)
        return 0
    import torch

    work = Path(tempfile.mkdtemp(prefix="weight_sync_gpu_"))
    details, failures = [], []
    for model in args.models.split(","):
        save_model(model, work / model)
        spec = {"model": model, "model_dir": str(work / model), "engine": "megatron", "mode": "lora",
                "batch": args.batch, "prompt": args.prompt, "response": args.response, "micro": args.micro,
                "warmup": args.warmup, "repeats": args.repeats}  # fmt: skip
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        if torch.cuda.is_available():
            env.setdefault("CUDA_VISIBLE_DEVICES", "0")
        started = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, __file__, "--job", json.dumps(spec)], env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=args.job_timeout)  # fmt: skip
            log, rc = proc.stdout, proc.returncode
        except subprocess.TimeoutExpired as exc:
            log, rc = (exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""), -9
        lines = [line[7:] for line in log.splitlines() if line.startswith("RESULT ")]
        if rc == 0 and lines:
            details.append(json.loads(lines[-1]))
            print(f"done ({time.perf_counter() - started:.0f} s): {model}", file=sys.stderr, flush=True)
            if args.out:  # rows so far, in case the whole run is cut short
                Path(args.out).mkdir(parents=True, exist_ok=True)
                with open(Path(args.out) / "weight_sync_gpu.partial.jsonl", "a") as f:
                    f.write(json.dumps(details[-1]) + "\n")
        else:
            failures.append({"model": model, "rc": rc, "log": log[-3000:]})
            print(f"FAILED ({rc}): {model}\n{log[-3000:]}", file=sys.stderr, flush=True)
    table_rows = []
    for d in details:
        for kind, k in d["kinds"].items():
            table_rows.append({
                "model": d["model"], "kind": kind, "tensor_MB": k["tensor_bytes"] / 1e6, "file_MB": k["file_bytes"] / 1e6,
                "export_ms": 1000 * k["export_s"], "write_ms": 1000 * k["write_s"], "sync_ms": 1000 * k["sync_s"],
                "train_step_ms": 1000 * d["train_step_s"], "sync/step": k["sync_per_train_step"],
                "share_of_step": k["share_of_step"],
                "merge_check": (f"ok, worst err/tol {d['merge_check']['worst_err_over_tol']:.2f}" if d["merge_check"]["ok"]
                                else "FAILED") if kind == "merged" else "",
            })  # fmt: skip
    from importlib.metadata import version

    from bench.common import machine, markdown, report

    versions: dict[str, str | None] = {}
    for name in ("torch", "transformers", "megatron-core", "megatron-bridge"):
        try:
            versions[name] = version(name)
        except Exception:  # noqa: BLE001
            versions[name] = None
    result = {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "versions": versions,
              "settings": {k: getattr(args, k) for k in ("batch", "prompt", "response", "micro", "warmup", "repeats")},
              "failures": failures, "details": details}  # fmt: skip
    report("weight_sync_gpu", result, table_rows, save=args.out is None)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        doc = {"benchmark": "weight_sync_gpu", "command": " ".join(["python", *sys.argv]), "machine": machine(),
               **result, "rows": table_rows}  # fmt: skip
        (out / "weight_sync_gpu.json").write_text(json.dumps(doc, indent=2) + "\n")
        (out / "weight_sync_gpu.md").write_text(markdown(table_rows) + "\n")
    return 1 if failures or not all(d["merge_check"]["ok"] for d in details) else 0


if __name__ == "__main__":
    sys.exit(main())
