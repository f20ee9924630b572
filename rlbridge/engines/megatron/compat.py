"""Run megatron-core and Megatron-Bridge where Transformer Engine (and possibly CUDA) is absent.

megatron-core assumes CUDA and Megatron-Bridge assumes Transformer Engine (TE). On the CPU machines (CI, the
pre-flight smoke run) and on GPUs without TE, `activate()` bridges the gap with the smallest set of changes
that was verified to be enough (see ENVIRONMENT.md, "Megatron on CPU"):

without CUDA only
  * the CUDA device / RNG / stream functions megatron-core calls (`current_device`, `get_rng_state`,
    `manual_seed`, `Stream`, `synchronize`, ...) are redirected to their CPU equivalents or made no-ops;
  * inside `device_scope()` (the engine enters it around every call into megatron), a
    `TorchFunctionMode` maps explicit CUDA devices (`device="cuda"`, `.cuda()`, `.to("cuda")`) to the
    CPU, and reports CPU tensors under their CUDA type names so megatron's `param.type() ==
    'torch.cuda.FloatTensor'` checks hold. It is scoped, so code outside the engine is unaffected;
  * the MoE all-to-all dispatcher turns its split sizes into numpy arrays only when they are CUDA tensors
    (`moe_utils.maybe_move_tensor_to_cpu`); on the CPU they stayed tensors, which gloo's `all_to_all_single`
    refuses (TypeError at expert parallel > 1). The stand-in converts CPU tensors too (`_moe_splits_on_cpu`);
  * Megatron-Bridge's `scatter_to_tp_ranks` hands gloo the TP splits as views (on GPU the `.to(cuda)`
    copy makes them contiguous; on CPU it is a no-op), and gloo's scatter reads a non-contiguous view's
    raw storage: row-parallel weights (linear_proj, linear_fc2) then load scrambled at TP > 1, while the
    export gathers them back "consistently" so a merged-export round trip does not notice. The splits are
    made contiguous first;
without TE (CPU or GPU)
  * every megatron.core module is imported first, so each caches `HAVE_TE = False` while TE is truly
    absent (megatron-core 0.19 otherwise asks the placeholder for a package version);
  * then a placeholder `transformer_engine` package is registered while Megatron-Bridge is imported,
    because it imports `transformer_engine.pytorch` unconditionally (peft/lora.py, peft/lora_layers.py);
    the placeholder is unregistered right after, so later `import transformer_engine` (accelerate, peft,
    vLLM probing for TE) fails as it should;
  * `HAVE_TE = False` is set again in the Megatron-Bridge modules that read it (peft.utils,
    peft.module_matcher and any loaded module probing `import transformer_engine`);
  * megatron-core 0.16.1's MoE router (`moe_utils.RouterGatingLinearFunction`) tests
    `te_general_gemm is not None`, a name its module binds only when the TE import succeeds, so every MoE
    forward without TE raised NameError. The TE-only names that module lacks are bound to None, which is
    what its own guards test for (`_bind_missing_moe_te_names`).

With TE installed, nothing is changed. The layer-spec side of the story (local spec, fusions off) lives in
provider.py, because it is a provider setting, not a library patch.

mbridge on megatron-core >= 0.17 (with or without TE; `mbridge_model_type()`, called by build.py before mbridge
builds a model)
  * mbridge 0.15.1's `get_model` (mbridge/core/util.py) asks `model_type == ModelType.encoder_and_decoder` in
    both its branches. megatron-core 0.16 kept that name as a deprecated *property* of the enum, so on the
    class it was a property object that equals no model type: the encoder-decoder branch never ran. 0.17.0
    removed the name (and encoder-decoder pipelines with it), so the lookup raises AttributeError. Where
    megatron-core's ModelType lacks the name, mbridge's module-level `ModelType` is replaced by a stand-in
    whose `encoder_or_decoder` is the real member and whose `encoder_and_decoder` equals nothing: exactly
    0.16's behaviour. The models still carry the real enum member (mbridge's default argument). Nothing else
    on mbridge's dense Qwen2 / Llama path needs a change (verified on CPU with megatron-core 0.19.2, see
    docs/engines/megatron.md).

Versions differ between machines (megatron-core 0.16.1 + Megatron-Bridge 0.3.1 here, 0.19.2 + 0.6.2 on the
GPU machine): `versions()` reports them and `features()` derives the behaviours the engine branches on.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import io
import logging
import pkgutil
import re
import sys
import types
import warnings
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

_TE_NAMES = ("transformer_engine", "transformer_engine_torch")
_state: dict[str, Any] = {"active": False, "te": None}


# ------------------------------------------------------------------------------------------- versions
@cache
def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def have_transformer_engine() -> bool:
    """Whether the real TE is installed (decided once, before any placeholder exists)."""
    if _state["te"] is None:
        _state["te"] = importlib.util.find_spec("transformer_engine") is not None
    return bool(_state["te"])


def versions() -> dict[str, str | None]:
    """Installed versions of the Megatron stack (None: not installed)."""
    return {
        "torch": str(torch.__version__),
        "megatron-core": _dist_version("megatron-core", "megatron_core"),
        "megatron-bridge": _dist_version("megatron-bridge", "megatron_bridge"),
        "mbridge": _dist_version("mbridge"),
        "transformer-engine": _dist_version("transformer-engine", "transformer_engine")
        if have_transformer_engine()
        else None,
    }


def _as_tuple(version: str | None) -> tuple[int, ...]:
    """`0.19.2` -> (0, 19, 2); the leading digits of each piece: `0.16.0rc1` -> (0, 16, 0); None -> (0,)."""
    if not version:
        return (0,)
    return tuple(int(re.sub(r"\D.*", "", piece) or 0) for piece in version.split(".")[:3])


@dataclass(frozen=True)
class Features:
    """Behaviours of the installed versions that the engine depends on."""

    bridge_recompute_fix: bool
    """Megatron-Bridge >= 0.3.0 makes the decoder input require grad inside PEFT.__call__ (recompute + LoRA)."""
    bridge_base_layer_names: bool
    """Unmerged export names base weights `...q_proj.base_layer.weight` (Megatron-Bridge 0.3.x)."""


def features() -> Features:
    v = versions()
    bridge = _as_tuple(v["megatron-bridge"])
    return Features(
        bridge_recompute_fix=bridge >= (0, 3, 0),
        bridge_base_layer_names=bridge >= (0, 3, 0),
    )


# ------------------------------------------------------------------------------------- CPU redirection
class _CpuEvent:
    """Stands in for torch.cuda.Event (the MoE all-to-all dispatcher synchronizes on one)."""

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True


class _CpuStream:
    """Stands in for torch.cuda.Stream: CPU work is synchronous, so every wait is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: Any = None) -> _CpuEvent:
        return _CpuEvent()


class _CudaToCpu(torch.overrides.TorchFunctionMode):
    """Maps explicit CUDA devices to the CPU; reports CPU tensor types under their CUDA names."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):  # type: ignore[no-untyped-def]  # torch/importlib hook signature, untyped upstream
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and "cuda" in str(device):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and "cuda" in str(args[1]):
            args = (args[0], "cpu", *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        return func(*args, **kwargs)


def _redirect_cuda_to_cpu() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]  # CPU stand-in for a torch.cuda function
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # type: ignore[assignment]  # CPU stand-in for a torch.cuda function
    cuda.random.get_rng_state = cuda.get_rng_state  # type: ignore[assignment]  # CPU stand-in for a torch.cuda function
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)  # type: ignore[assignment]  # CPU stand-in for a torch.cuda function
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(seed)  # type: ignore[assignment]  # CPU stand-in for a torch.cuda function
    cuda.manual_seed_all = lambda seed: None  # type: ignore[assignment]  # CPU stand-in for a torch.cuda function
    cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]  # CPU stand-in for a torch.cuda function
    cuda.empty_cache = lambda: None  # type: ignore[assignment]  # CPU stand-in for a torch.cuda function
    cuda.Stream = _CpuStream  # type: ignore[assignment,misc]  # CPU stand-in for torch.cuda.Stream
    cuda.current_stream = lambda *a, **k: _CpuStream()  # type: ignore[assignment]  # CPU stand-in for a torch.cuda function
    cuda.default_stream = lambda *a, **k: _CpuStream()  # type: ignore[assignment]  # CPU stand-in for a torch.cuda function
    cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]  # CPU stand-in for a torch.cuda function
    import megatron.core.tensor_parallel.random as mcore_random

    mcore_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # With the "CUDA" generator being the CPU one, every random op inside the tracker's fork changes the
    # CPU state by construction; megatron's warning about exactly that is noise here.
    logging.getLogger(mcore_random.__name__).addFilter(
        lambda record: "CPU RNG state changed within GPU RNG context" not in record.getMessage()
    )


def _moe_splits_on_cpu() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu
    if getattr(original, "_rlbridge", False):
        return

    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.detach().cpu().numpy().copy()  # on CPU .numpy() shares the tensor's storage
        return tensor

    maybe_move_tensor_to_cpu._rlbridge = True  # type: ignore[attr-defined]  # marker attribute on our own function
    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu  # imported by name there


def _contiguous_tp_scatter() -> None:
    from megatron.bridge.models.conversion import param_mapping

    cls = param_mapping.MegatronParamMapping
    original = cls.scatter_to_tp_ranks
    if getattr(original, "_rlbridge", False):
        return

    def scatter_to_tp_ranks(self: Any, splits: Any, *args: Any, **kwargs: Any) -> Any:
        if splits:
            splits = [s.contiguous() for s in splits]
        return original(self, splits, *args, **kwargs)

    scatter_to_tp_ranks._rlbridge = True  # type: ignore[attr-defined]  # marker / placeholder attribute set on a foreign object
    cls.scatter_to_tp_ranks = scatter_to_tp_ranks  # type: ignore[method-assign]  # patches megatron-bridge's method on purpose (see the docstring above)


def device_scope() -> contextlib.AbstractContextManager[Any]:
    """Around any call into megatron: maps CUDA devices to the CPU in CPU mode; a no-op otherwise."""
    if is_active() and cpu_mode():
        return _CudaToCpu()
    return contextlib.nullcontext()


# ------------------------------------------------------------------------------------ TE placeholder
class _PlaceholderMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder_class(name)


def _placeholder_class(name: str) -> type:
    return _PlaceholderMeta(name, (torch.nn.Module,), {"__module__": "transformer_engine"})


class _PlaceholderModule(types.ModuleType):
    """Any attribute is a fresh class no real module is an instance of, so `isinstance(m, te.X)` is False."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _placeholder_class(name)
        setattr(self, name, value)
        return value


class _PlaceholderFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]  # torch/importlib hook signature, untyped upstream
        if fullname.split(".")[0] in _TE_NAMES:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):  # type: ignore[no-untyped-def]  # torch/importlib hook signature, untyped upstream
        module = _PlaceholderModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+placeholder"  # type: ignore[attr-defined]  # marker / placeholder attribute set on a foreign object
        return module

    def exec_module(self, module):  # type: ignore[no-untyped-def]  # torch/importlib hook signature, untyped upstream
        pass


def _import_all_megatron_core() -> None:
    import megatron.core

    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for info in pkgutil.walk_packages(megatron.core.__path__, "megatron.core."):
            try:
                importlib.import_module(info.name)
            except Exception:  # optional extras (flask, nvidia modules) may be missing; that is fine
                continue


def _import_bridge_with_te_placeholder() -> None:
    _import_all_megatron_core()
    finder = _PlaceholderFinder()
    sys.meta_path.insert(0, finder)
    try:
        import megatron.bridge  # noqa: F401  (imports peft and the model bridges against the placeholder)
        import megatron.bridge.peft.canonical_lora
        import megatron.bridge.peft.dora
        import megatron.bridge.peft.lora
        import megatron.bridge.peft.module_matcher
        import megatron.bridge.peft.utils  # noqa: F401
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n.split(".")[0] in _TE_NAMES]:
            del sys.modules[name]  # modules that imported it keep their reference; new imports fail
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.bridge") and getattr(module, "HAVE_TE", None) is True:
            module.HAVE_TE = False  # type: ignore[attr-defined]  # marker / placeholder attribute set on a foreign object


_MOE_TE_NAMES = (
    "fused_compute_score_for_moe_aux_loss",
    "fused_moe_aux_loss",
    "fused_permute",
    "fused_permute_with_probs",
    "fused_sort_chunks_by_index",
    "fused_sort_chunks_by_index_with_probs",
    "fused_topk_with_score_function",
    "fused_unpermute",
    "te_general_gemm",
)


def _bind_missing_moe_te_names() -> list[str]:
    """Bind the TE-only names megatron-core's moe_utils lacks without TE to None (module docstring). Returns
    the names bound."""
    from megatron.core.transformer.moe import moe_utils

    missing = [n for n in _MOE_TE_NAMES if n not in vars(moe_utils)]
    for name in missing:
        setattr(moe_utils, name, None)
    return missing


# -------------------------------------------------------------------------------------------- mbridge
class _ModelTypeWithoutEncoderDecoder:
    """What mbridge reads as `ModelType` where megatron-core has no encoder-decoder models (>= 0.17)."""

    def __init__(self, model_type: Any) -> None:
        self.encoder_or_decoder = model_type.encoder_or_decoder
        self.encoder_and_decoder = object()  # equals no model type, as 0.16's deprecated property did

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"ModelType.{name} (megatron-core has only encoder_or_decoder)")


def mbridge_model_type() -> bool:
    """Let mbridge's get_model run on a megatron-core without `ModelType.encoder_and_decoder` (module docstring).
    Idempotent; returns whether mbridge's ModelType is the stand-in (False: nothing needed or recognized)."""
    import mbridge.core.util as mbridge_util

    current = getattr(mbridge_util, "ModelType", None)
    if isinstance(current, _ModelTypeWithoutEncoderDecoder):
        return True
    if (
        current is None
        or hasattr(current, "encoder_and_decoder")
        or not hasattr(current, "encoder_or_decoder")
    ):
        return False
    mbridge_util.ModelType = _ModelTypeWithoutEncoderDecoder(current)
    return True


# ------------------------------------------------------------------------------------------- activate
def cpu_mode() -> bool:
    """True when megatron runs on the CPU (no CUDA device)."""
    return not torch.cuda.is_available()


def activate() -> None:
    """Make megatron-core / Megatron-Bridge usable here. Idempotent; a no-op when TE is installed."""
    if _state["active"]:
        return
    _state["active"] = True
    if have_transformer_engine():
        return
    on_cpu = cpu_mode()
    warnings.warn(
        "Transformer Engine is not installed: rlbridge activates its megatron compatibility layer "
        f"({'CPU redirection of CUDA calls, ' if on_cpu else ''}TE placeholder, local layer specs). "
        f"Versions: {versions()}",
        RuntimeWarning,
        stacklevel=2,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core  # noqa: F401

        if on_cpu:
            _redirect_cuda_to_cpu()
        _import_bridge_with_te_placeholder()
        _bind_missing_moe_te_names()
        if on_cpu:
            _contiguous_tp_scatter()
            _moe_splits_on_cpu()


def is_active() -> bool:
    """Whether the compatibility layer changed anything in this process."""
    return bool(_state["active"]) and not have_transformer_engine()
