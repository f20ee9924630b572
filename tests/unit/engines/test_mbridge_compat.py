"""mbridge 0.15 on a megatron-core without `ModelType.encoder_and_decoder` (>= 0.17): compat.mbridge_model_type()
makes mbridge's get_model take its decoder-only branch, as it did on 0.16, and changes nothing where the name
exists. Against stand-in modules here; the real mbridge 0.15.1 + megatron-core 0.19.2 run is
scripts/mbridge_megatron_core_cpu.sh (CPU) and tests/megatron/gpu_smoke.py --suite mbridge (GPU)."""

from __future__ import annotations

import enum
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlbridge.engines.megatron import compat
from rlbridge.recipe import validate_recipe


class ModelType017(enum.Enum):
    """megatron-core 0.17-0.19's enum."""

    encoder_or_decoder = 1


class ModelType016(enum.Enum):
    """megatron-core 0.16's enum: the removed name survives as a deprecated property."""

    encoder_or_decoder = 1

    @property
    def encoder_and_decoder(self) -> Any:
        raise ValueError("deprecated")


def fake_mbridge(monkeypatch: pytest.MonkeyPatch, model_type: type[enum.Enum]) -> types.ModuleType:
    """`mbridge.core.util` with get_model's comparison as mbridge 0.15.1 writes it (util.py, both branches)."""
    util = types.ModuleType("mbridge.core.util")
    util.ModelType = model_type  # type: ignore[attr-defined]
    exec(
        "def get_model(model_type=ModelType.encoder_or_decoder):\n"
        "    if model_type == ModelType.encoder_and_decoder:\n"
        "        return 'encoder and decoder', model_type\n"
        "    return 'decoder only', model_type\n",
        util.__dict__,
    )
    for name in ("mbridge", "mbridge.core"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "mbridge.core.util", util)
    return util


def test_without_the_name_get_model_fails_then_runs_decoder_only(monkeypatch: pytest.MonkeyPatch) -> None:
    util = fake_mbridge(monkeypatch, ModelType017)
    with pytest.raises(AttributeError, match="encoder_and_decoder"):
        util.get_model()  # what mbridge 0.15.1 does on megatron-core 0.19.2
    assert compat.mbridge_model_type() is True
    branch, model_type = util.get_model()
    assert branch == "decoder only" and model_type is ModelType017.encoder_or_decoder  # the real member
    assert util.get_model(ModelType017.encoder_or_decoder)[0] == "decoder only"
    stand_in = util.ModelType
    assert compat.mbridge_model_type() is True and util.ModelType is stand_in  # idempotent
    with pytest.raises(AttributeError, match="only encoder_or_decoder"):
        _ = stand_in.retro_encoder  # any other name still fails loudly


def test_with_the_name_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    util = fake_mbridge(monkeypatch, ModelType016)
    assert util.get_model()[0] == "decoder only"  # 0.16: a property object on the class, equal to nothing
    assert compat.mbridge_model_type() is False
    assert util.ModelType is ModelType016


def test_an_unrecognized_mbridge_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    util = fake_mbridge(monkeypatch, ModelType017)
    del util.ModelType
    assert compat.mbridge_model_type() is False and not hasattr(util, "ModelType")


def test_validate_accepts_mbridge_full_finetuning(tmp_path: Path) -> None:
    """No version rule at validation: the engine handles megatron-core >= 0.17 (LoRA stays refused)."""
    recipe = {
        "name": "t",
        "model": {
            "path": str(Path(__file__).resolve().parents[2] / "fixtures" / "configs" / "qwen2.5-7b-instruct")
        },
        "trainer": {
            "engine": "megatron",
            "bridge": "mbridge",
            "parallel": {"tensor": 4},
            "micro_batch_size": 2,
        },
        "rollout": {"tensor_parallel": 2, "gpu_memory_utilization": 0.3},  # full FT of 7B: tp 4, a small vLLM
        "data": {"train": {"path": "builtin:arithmetic"}, "batch_size": 8},
        "reward": {"fn": "arithmetic"},
        "cluster": {"gpus_per_node": 8},
    }
    f = tmp_path / "r.yaml"
    f.write_text(yaml.safe_dump(recipe))
    assert validate_recipe(f).recipe.trainer.bridge == "mbridge"


def test_version_parsing_reads_leading_digits() -> None:
    assert compat._as_tuple("0.19.2") == (0, 19, 2)
    assert compat._as_tuple("0.16.0rc1") == (0, 16, 0)  # not (0, 16, 1)
    assert compat._as_tuple("2.13.0+cpu") == (2, 13, 0)
    assert compat._as_tuple(None) == (0,)
