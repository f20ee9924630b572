"""bench/trl_grpo.py's extra rlbridge runs (--also-async, --also NAME:KEY=VALUE): the tool names and overrides each
run gets, and a malformed --also refused by name."""

from __future__ import annotations

import argparse

import pytest

from bench.trl_grpo import ASYNC, split_env, variant_sets


def test_variants_name_their_overrides_in_order() -> None:
    a = argparse.Namespace(
        also_async=True,
        also=["kl:algorithm.kl.coef=0.05", "kl:run.seed=2", "big:data.batch_size=64"],
    )
    assert variant_sets(a) == {
        "rlbridge-async": list(ASYNC),
        "rlbridge-kl": ["algorithm.kl.coef=0.05", "run.seed=2"],
        "rlbridge-big": ["data.batch_size=64"],
    }
    assert variant_sets(argparse.Namespace(also_async=False, also=[])) == {}


@pytest.mark.parametrize("spec", ["kl", ":a=1", "x:novalue"])
def test_a_malformed_variant_is_refused(spec: str) -> None:
    with pytest.raises(SystemExit, match="expected NAME:KEY=VALUE"):
        variant_sets(argparse.Namespace(also_async=False, also=[spec]))


def test_an_rlbridge_variable_goes_to_the_environment() -> None:
    a = argparse.Namespace(
        also_async=False, also=["nocudnn:RLBRIDGE_CUDNN_ATTENTION=0", *(f"nocudnn:{o}" for o in ASYNC)]
    )
    assert split_env(variant_sets(a)["rlbridge-nocudnn"]) == (list(ASYNC), {"RLBRIDGE_CUDNN_ATTENTION": "0"})
