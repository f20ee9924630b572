"""`rlbridge export-hf`: a checkpoint as a Hugging Face directory, merged or as a PEFT adapter.

One function, `export_hf`, whatever trained the checkpoint: it finds the checkpoint (a run directory's
newest complete one, its step N, or a checkpoint directory), reads the recipe saved with it, and asks the
exporter of the checkpoint's engine (its spec's `exporter`, engines/registry.py) for the weights:

- hf (now): the base model is loaded with transformers on CPU from the recipe's model.path (short names
  through rlbridge.model.cache), the checkpoint's trainable tensors are loaded into the same peft model the
  trainer used, and the hf engine exports them: LoRA folded in float32 with peft's arithmetic
  (weights/hf_files.merge_lora) and cast to model.dtype at the end, or peft's adapter tensors and
  adapter_config.json. No Ray, no vLLM.
- megatron (LoRA): the checkpoint's canonical Megatron adapter tensors (full, whatever TP/PP wrote them) are
  renamed to PEFT's (engines/megatron/hf_names.py, splitting the fused qkv and gate/up projections) and
  exported as above: the same CPU process, no Megatron, no Ray.
- megatron (full fine-tuning): the checkpoint holds every weight under Megatron names; the recipe's bridge
  (Megatron-Bridge or mbridge) builds the model once in this process (one rank, float32), loads them and
  exports HF names, as the trainer's weight sync does (engines/megatron/export.full_checkpoint_to_hf).

What is written (to a temporary sibling of --out, renamed into place when complete):

    merged   config.json (dtype of the tensors; tie_word_embeddings as the tensors say), model.safetensors
             or model-0000i-of-0000n.safetensors + model.safetensors.index.json, the tokenizer, generation
             config and other non-weight files of the base directory, README.md (recipe and step)
    adapter  adapter_config.json + adapter_model.safetensors (what peft's save_pretrained writes and vLLM's
             LoRA loader reads), README.md

Tied embeddings: the config's flag must agree with the tensors written. When the config ties the output
layer to the input embedding and the merged output weights still equal the embedding, only the embedding is
written (as save_pretrained does). If they diverged (impossible under LoRA on the projections, checked
anyway), the config is untied and the output weights written.

A non-empty --out is refused unless --force (which then replaces a directory holding only files; one with
sub-directories is refused, so that a mistyped --out cannot wipe a tree), and every file is placed with
checkpoint.safe_join, so nothing lands outside --out.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from rlbridge.engines.registry import trainer_engine
from rlbridge.errors import RlbridgeError
from rlbridge.recipe.schema import Recipe
from rlbridge.run import checkpoint as ckpt
from rlbridge.run.resume import ResumePoint, find_checkpoint
from rlbridge.weights import WeightExport, WeightSync

DEFAULT_SHARD_SIZE = "5GB"


@dataclass
class Exported:
    """What an exporter hands back: the weights and what the directory needs besides them."""

    weights: WeightExport
    config: dict[str, Any] | None = None
    """config.json content for a merged export (None for an adapter)."""
    base_dir: Path | None = None
    """The base model directory (tokenizer, generation config and the other non-weight files come from it)."""
    notes: list[str] = field(default_factory=list)


@dataclass
class ExportResult:
    out: Path
    kind: WeightSync
    step: int
    checkpoint: Path
    files: list[str]
    bytes: int
    seconds: float
    notes: list[str]


Exporter = Callable[[Recipe, ResumePoint, WeightSync, Callable[[str], None]], Exported]
"""(recipe, checkpoint, 'merged' or 'adapter', log) -> the weights: each trainer engine's (engines/spec.py)."""
ToPeft = Callable[[Recipe, Path, Any, dict[str, torch.Tensor]], dict[str, torch.Tensor]]
"""(recipe, base model directory, the hf engine's peft model, checkpoint tensors) -> them under peft's names."""


def base_model_name(recipe: Recipe, base_dir: Path) -> str:
    """What an exported adapter names as its base: a Hub id as written in the recipe (peft and vLLM load it from
    any machine's cache), else the local directory."""
    from rlbridge.model.hub import is_hub_id

    path = recipe.model.path
    return path if is_hub_id(path) and not Path(path).expanduser().exists() else str(base_dir)


def export_hf(
    source: Path,
    out: Path,
    *,
    merge: bool | None = None,
    step: int | None = None,
    force: bool = False,
    max_shard_size: str | int = DEFAULT_SHARD_SIZE,
    log: Callable[[str], None] = print,
) -> ExportResult:
    """Export checkpoint `source` (a run directory: its newest complete checkpoint, or `step`; or a checkpoint
    directory) to `out`. merge: True merged, False adapter-only, None merged (the default under LoRA and the
    only choice under full fine-tuning). See the module docstring."""
    start = time.perf_counter()
    out = Path(out)
    _check_out(out, force)
    point = find_checkpoint(Path(source), step=step, log=log)
    recipe = _recipe(point)
    kind = WeightSync.MERGED if merge or merge is None else WeightSync.ADAPTER
    if kind == WeightSync.ADAPTER and not recipe.lora.enabled:
        raise RlbridgeError(
            f"--adapter-only needs a LoRA run; {point.path} is full fine-tuning (lora.rank 0): "
            "export it merged"
        )
    engine = trainer_engine(recipe)
    log(
        f"exporting {point.path} (step {point.step}, {engine.name} engine) as {'a merged model' if kind == 'merged' else 'a PEFT adapter'}"
    )
    exported = engine.exporter(recipe, point, kind, log)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if kind == WeightSync.MERGED:
            _write_merged(tmp, exported, max_shard_size)
        else:
            _write_adapter(tmp, exported)
        _write_readme(tmp, recipe, point, kind, exported)
        for f in tmp.iterdir():
            os.chmod(f, 0o666 & ~_umask())  # safetensors writes 0600; an export is meant to be shared
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files = sorted(f.name for f in out.iterdir())
    size = sum((out / f).stat().st_size for f in files)
    for note in exported.notes:
        log(note)
    return ExportResult(
        out, kind, point.step, point.path, files, size, time.perf_counter() - start, exported.notes
    )


# ------------------------------------------------------------------------------------------- exporters
def hf_exporter(
    recipe: Recipe,
    point: ResumePoint,
    kind: WeightSync,
    log: Callable[[str], None],
    *,
    to_peft: ToPeft | None = None,
) -> Exported:
    """The checkpoint's trainable tensors loaded into the hf engine's peft model on CPU, exported from there.
    to_peft: renames an engine's checkpoint names to that model's (engines/megatron/spec.py)."""
    from rlbridge.engines.hf.engine import HFTrainEngine
    from rlbridge.model.cache import ensure_model
    from rlbridge.model.hf import hf_logging

    base_dir = ensure_model(recipe.model.path, recipe.model.revision)
    loaded = ckpt.load_checkpoint(point.path)
    if "trainable" not in loaded.tensors:
        raise RlbridgeError(f"{point.path} holds no trainable tensors (trainable.safetensors)")
    # an engine for export only: no frozen reference copy (algorithm.kl), no recompute hooks
    algo = recipe.algorithm.model_copy(update={"kl": recipe.algorithm.kl.model_copy(update={"coef": 0.0})})
    trainer = recipe.trainer.model_copy(
        update={"recompute": recipe.trainer.recompute.model_copy(update={"granularity": "none"})}
    )
    light = recipe.model_copy(update={"algorithm": algo, "trainer": trainer})
    log(f"loading the base model {recipe.model.path} ({base_dir}) on CPU in {recipe.model.dtype}")
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        engine = HFTrainEngine(light, base_dir, device="cpu")
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    trainable = loaded.tensors["trainable"]
    if to_peft is not None:
        trainable = to_peft(recipe, base_dir, engine.model, trainable)
    engine.load_trainable_state(trainable)
    if kind == WeightSync.ADAPTER:
        weights = engine.export_weights(WeightSync.ADAPTER)
        config = dict(weights.adapter_config or {})
        config["base_model_name_or_path"] = base_model_name(recipe, base_dir)
        if recipe.model.revision is not None:
            config["revision"] = recipe.model.revision
        config.setdefault("peft_type", "LORA")
        notes = ["the adapter is DoRA: peft loads it, vLLM does not"] if recipe.lora.type == "dora" else []
        return Exported(WeightExport(WeightSync.ADAPTER, weights.tensors, config), None, base_dir, notes)
    state = engine.merged_state(drop_tied=False)
    config = json.loads((base_dir / "config.json").read_text(encoding="utf-8"))
    notes = _settle_ties(engine.hf_model, state, config)
    return Exported(WeightExport(WeightSync.MERGED, state), config, base_dir, notes)


def _settle_ties(model: Any, state: dict[str, torch.Tensor], config: dict[str, Any]) -> list[str]:
    """Make config.json's tie flag agree with the tensors: drop tied output weights that still equal the
    input embedding, or untie the config (and keep them) when they differ. Names come from the model's
    embedding modules, not from a hard-coded `lm_head.weight`."""
    tied = _tie_flag(config)
    names = {id(m): n for n, m in model.named_modules()}
    inp, outp = model.get_input_embeddings(), model.get_output_embeddings()
    if outp is None or not tied:
        return []
    in_key = _weight_key(names.get(id(inp)))
    out_key = _weight_key(names.get(id(outp)))
    if in_key not in state or out_key not in state or in_key == out_key:
        return []
    if torch.equal(state[out_key], state[in_key]):
        del state[out_key]
        return []
    _set_tie_flag(config, False)
    return [
        f"{out_key} differs from {in_key} after the merge: tie_word_embeddings set to false in config.json and "
        f"{out_key} written"
    ]


def _weight_key(module_name: str | None) -> str:
    name = (module_name or "").removesuffix(".base_layer")
    return f"{name}.weight".replace(".base_layer.", ".")


def _tie_flag(config: dict[str, Any]) -> bool:
    text = config.get("text_config")
    if "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    if isinstance(text, dict) and "tie_word_embeddings" in text:
        return bool(text["tie_word_embeddings"])
    return True  # transformers' default


def _set_tie_flag(config: dict[str, Any], value: bool) -> None:
    config["tie_word_embeddings"] = value
    if isinstance(config.get("text_config"), dict):
        config["text_config"]["tie_word_embeddings"] = value


# ------------------------------------------------------------------------------------------- writing
def _write_merged(tmp: Path, exported: Exported, max_shard_size: str | int) -> None:
    from huggingface_hub import save_torch_state_dict

    from rlbridge.weights.hf_files import _is_weight_file

    assert exported.base_dir is not None and exported.config is not None
    tensors = exported.weights.tensors
    for f in sorted(exported.base_dir.iterdir()):
        if (
            f.is_file()
            and not _is_weight_file(f)
            and not f.name.startswith(".")
            and f.name not in ("config.json", "README.md", "adapter_config.json")
        ):
            shutil.copyfile(f, ckpt.safe_join(tmp, f.name))
    config = dict(exported.config)
    dtype = next((t.dtype for t in tensors.values() if t.is_floating_point()), None)
    if dtype is not None:
        config["dtype"] = str(dtype).removeprefix("torch.")
        config.pop("torch_dtype", None)
    ckpt.safe_join(tmp, "config.json").write_text(
        json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )
    if not ckpt.safe_join(tmp, "generation_config.json").exists():  # the base had none: the config's tokens
        from rlbridge.model.hf import GenerationConfig

        ids = {
            k: config[k]
            for k in ("bos_token_id", "eos_token_id", "pad_token_id")
            if config.get(k) is not None
        }
        GenerationConfig(**ids).save_pretrained(tmp)
    save_torch_state_dict(
        {k: v.detach().contiguous() for k, v in tensors.items()},
        tmp,
        max_shard_size=max_shard_size,
        metadata={"format": "pt"},
    )
    for f in tmp.iterdir():  # every name the writer chose stays inside the directory
        ckpt.safe_join(tmp, f.name)


def _write_adapter(tmp: Path, exported: Exported) -> None:
    from rlbridge.weights.hf_files import save_hf

    save_hf(tmp, exported.weights)


def _write_readme(
    tmp: Path, recipe: Recipe, point: ResumePoint, kind: WeightSync, exported: Exported
) -> None:
    r = recipe
    lora = (
        f"LoRA rank {r.lora.rank}, alpha {r.lora.alpha}, targets {', '.join(r.lora.targets)} ({r.lora.type})"
        if r.lora.enabled
        else "full fine-tuning"
    )
    what = (
        "the base model with the adapters merged in (float32 merge, cast to " + r.model.dtype + ")"
        if kind == WeightSync.MERGED
        else "a PEFT adapter for the base model"
    )
    if kind == WeightSync.MERGED:
        load = (
            "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
            'model = AutoModelForCausalLM.from_pretrained("PATH")\ntokenizer = AutoTokenizer.from_pretrained("PATH")\n'
            '# vLLM: LLM(model="PATH")\n```'
        )
    else:
        load = (
            "```python\nfrom peft import PeftModel\nfrom transformers import AutoModelForCausalLM\n"
            f'base = AutoModelForCausalLM.from_pretrained("{exported.base_dir}")\n'
            'model = PeftModel.from_pretrained(base, "PATH")\n'
            '# vLLM: LLM(model=BASE, enable_lora=True) and LoRARequest("adapter", 1, "PATH")\n```'
        )
    text = (
        f"# {r.name}, step {point.step}\n\n"
        f"Exported by rlbridge from `{point.path}` (step {point.step} of run.steps {r.run.steps}): {what}.\n\n"
        f"- base model: `{r.model.path}` (`{exported.base_dir}`)\n- training: {r.algorithm.name}, {lora}, "
        f"trainer.engine {r.trainer.engine}\n- checkpoint created {point.manifest.get('created')}, "
        f"recipe sha256 {point.manifest.get('recipe_sha256')}\n\n## Load\n\n{load}\n\n"
        f"## Recipe\n\n```yaml\n{point.recipe_yaml.rstrip()}\n```\n"
    )
    ckpt.safe_join(tmp, "README.md").write_text(text, encoding="utf-8")


def _recipe(point: ResumePoint) -> Recipe:
    data = yaml.safe_load(point.recipe_yaml)
    try:
        return Recipe.model_validate(data)
    except Exception as e:  # pydantic's ValidationError: the saved recipe is from another rlbridge version
        raise RlbridgeError(f"{point.path}/recipe.yaml does not validate with this rlbridge: {e}") from None


# ------------------------------------------------------------------------------------------- --out
def _check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise RlbridgeError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise RlbridgeError(
                f"--out {out} is not empty; choose an empty or new directory, or pass --force to "
                "replace its contents"
            )
        subdirs = [p.name for p in out.iterdir() if p.is_dir() and not p.is_symlink()]
        if subdirs:
            raise RlbridgeError(
                f"--out {out} holds directories ({', '.join(sorted(subdirs)[:3])}): --force only "
                "replaces a directory of plain files (a previous export); choose another --out"
            )


def _publish(tmp: Path, out: Path) -> None:
    """Move the finished export into place: a rename when --out is absent or empty; with --force, the old
    directory is renamed aside first and deleted after."""
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        if old is not None and not out.exists():
            os.rename(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
