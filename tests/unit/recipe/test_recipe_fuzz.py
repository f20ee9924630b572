"""Thousands of malformed recipes: each ends in a clean RecipeError (CLI exit 2), never a traceback.

The default suite runs 3,000 cases (1500 structural mutations, 1000 garbage YAML texts, 500 garbage
`--set` overrides). The long run scales all three by RLBRIDGE_FUZZ_CASES (the total), e.g. 10,000 cases:

    RLBRIDGE_FUZZ_CASES=10000 .venv/bin/python -m pytest tests/unit/recipe/test_recipe_fuzz.py -v
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from rlbridge.cli import app
from rlbridge.errors import RecipeError
from rlbridge.recipe import validate_recipe

VALID = {
    "name": "fuzz",
    "model": {"path": "smollm2-135m-instruct", "dtype": "float32"},
    "lora": {"rank": 8},
    "trainer": {"engine": "hf", "micro_batch_size": 2},
    "rollout": {"engine": "vllm", "n": 2, "max_prompt_tokens": 64, "max_response_tokens": 32},
    "data": {"train": {"path": "builtin:arithmetic"}, "batch_size": 4},
    "reward": {"fn": "arithmetic"},
    "run": {"steps": 2},
    "cluster": {"nodes": 1, "gpus_per_node": 1, "device": "cpu"},
}
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.sampled_from(["megatron", "hf", "grpo", "ppo", "adapter", "cpu", "-1", "1e309"]),
)
values = st.recursive(
    scalars,
    lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text(max_size=8), c, max_size=3)),
    max_leaves=8,
)
paths = st.lists(
    st.sampled_from(
        [
            "name",
            "model",
            "path",
            "dtype",
            "lora",
            "rank",
            "trainer",
            "parallel",
            "tensor",
            "rollout",
            "n",
            "algorithm",
            "name",
            "kl",
            "data",
            "train",
            "batch_size",
            "reward",
            "fn",
            "run",
            "cluster",
            "gpus_per_node",
            "typo",
        ]
    ),
    min_size=1,
    max_size=4,
)


def mutate(recipe: dict, path: list[str], value: object, delete: bool) -> object:
    node: object = recipe
    for p in path[:-1]:
        if not isinstance(node, dict):
            return recipe
        node = node.setdefault(p, {})
    if isinstance(node, dict):
        if delete:
            node.pop(path[-1], None)
        else:
            node[path[-1]] = value
    return recipe


RUNNER = CliRunner()
CASES = int(os.environ.get("RLBRIDGE_FUZZ_CASES", "3000"))
"""Total cases over the three tests, split 50 / 33.3 / 16.7 % (3000: 1500 / 1000 / 500)."""
N_MUTATIONS, N_YAML = CASES // 2, CASES // 3
N_OVERRIDES = CASES - N_MUTATIONS - N_YAML


def run(tmp: Path, text: str) -> None:
    """Through the real CLI: exit 0 or 2, JSON output listing key + message, never an exception."""
    f = tmp / "fuzz.yaml"
    f.write_bytes(text.encode("utf-8", "replace"))
    res = RUNNER.invoke(app, ["validate-recipe", str(f), "--no-model-checks", "--json"])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert res.exit_code in (0, 2), res.output
    out = json.loads(res.stdout)
    assert out["valid"] == (res.exit_code == 0)
    assert all(e["key"] and e["message"] for e in out["errors"])


@settings(max_examples=N_MUTATIONS, deadline=None, suppress_health_check=list(HealthCheck))
@given(mutations=st.lists(st.tuples(paths, values, st.booleans()), min_size=1, max_size=4))
def test_structural_mutations(tmp_path_factory, mutations) -> None:  # type: ignore[no-untyped-def]
    import copy

    recipe: object = copy.deepcopy(VALID)
    for path, value, delete in mutations:
        recipe = mutate(recipe, path, value, delete)  # type: ignore[arg-type]
    run(tmp_path_factory.getbasetemp(), yaml.safe_dump(recipe, allow_unicode=True))


@settings(max_examples=N_YAML, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    text=st.lists(
        st.sampled_from(
            list("{}[]:-,!&*#|>'\"%@` \n\tabc12.\u00ff")
            + ["!!python/object:os.system ", "name: t\n", "model:", "rollout: {n: ", "- "]
        ),
        max_size=40,
    ).map("".join)
)
@example(text="'':")  # an empty key: its error once had an empty key name (found by this test, 2026-12-01)
def test_garbage_yaml(tmp_path_factory, text: str) -> None:  # type: ignore[no-untyped-def]
    run(tmp_path_factory.getbasetemp(), text)


@settings(max_examples=N_OVERRIDES, deadline=None, suppress_health_check=list(HealthCheck))
@given(key=st.text(max_size=20), value=st.text(max_size=20))
def test_garbage_overrides(tmp_path_factory, key: str, value: str) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path_factory.getbasetemp() / "ok.yaml"
    f.write_text(yaml.safe_dump(VALID))
    try:
        validate_recipe(f, [f"{key}={value}"], model_checks=False)
    except RecipeError as e:
        assert e.issues
