"""What the installed Megatron stack can run, read from package metadata alone.

`validate-recipe` must stay fast and import no heavy library, yet some recipes only fail hours later inside a
library that has moved on. The facts needed to refuse them early are version facts, so they live here, read
with `importlib.metadata` (no import of torch or megatron), and the engine (compat.py, build.py) asks the
same functions: one decision, one place.

mbridge and megatron-core: mbridge 0.15.1 (the newest) builds every model through `mbridge.core.util.get_model`,
which compares the model type against `ModelType.encoder_and_decoder` on every call (the interleaved and the
plain branch alike). megatron-core 0.16 kept that name as a deprecated property; 0.17.0 removed it, so from
0.17 on `get_model` stops with `AttributeError: encoder_and_decoder` before any layer is built (seen with
0.19.2 on the GPU machine and on CPU). The last megatron-core mbridge runs on is therefore 0.16.1.
"""

from __future__ import annotations

import importlib.metadata
import re

MBRIDGE_LAST_CORE = "0.16.1"
"""The newest megatron-core release that still has `ModelType.encoder_and_decoder` (removed in 0.17.0)."""
MBRIDGE_KNOWN = "0.15.1"
"""The newest mbridge checked against that removal; a newer mbridge may no longer need the name."""


def installed_version(dist: str) -> str | None:
    """The installed version of a distribution (None: not installed)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def version_tuple(version: str | None) -> tuple[int, ...]:
    """`0.19.2` -> (0, 19, 2); `0.16.0rc1` -> (0, 16, 0); None -> (0,)."""
    if not version:
        return (0,)
    # leading digits of each piece: "0rc1" -> 0, not 1
    return tuple(int(re.sub(r"\D.*", "", piece) or 0) for piece in version.split(".")[:3])


def mbridge_problem() -> str | None:
    """Why `trainer.bridge: mbridge` cannot build a model with the installed megatron-core (None: no known reason).

    Silent when megatron-core is not installed here (the recipe may be meant for another machine) or when an
    mbridge newer than the one checked is installed."""
    core = installed_version("megatron-core")
    if core is None or version_tuple(core) <= version_tuple(MBRIDGE_LAST_CORE):
        return None
    mbridge = installed_version("mbridge")
    if mbridge is not None and version_tuple(mbridge) > version_tuple(MBRIDGE_KNOWN):
        return None
    return (f"mbridge {mbridge or MBRIDGE_KNOWN} builds models through megatron-core's ModelType.encoder_and_decoder, "
            f"which megatron-core 0.17 removed (installed: megatron-core {core}); get_model would stop with "
            "AttributeError before building a layer")


MBRIDGE_FIX = (f"set trainer.bridge: megatron-bridge (full fine-tuning and LoRA), or install megatron-core<={MBRIDGE_LAST_CORE} "
               "for mbridge")
