"""Loading: safe YAML only, dotted keys with lines, suggestions for typos, overrides, all errors at once."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from rlbridge.errors import RecipeError
from rlbridge.recipe import load_recipe
from rlbridge.recipe.schema import DapoCfg, Recipe

MINIMAL = """\
name: t
model: {path: /m}
data:
  train: {path: "builtin:arithmetic"}
reward: {fn: arithmetic}
"""
NO_REWARD = MINIMAL.replace("reward: {fn: arithmetic}\n", "")


def write(tmp_path: Path, text: str) -> Path:
    f = tmp_path / "r.yaml"
    f.write_text(text)
    return f


def issues_of(path: Path, *sets: str) -> list:
    with pytest.raises(RecipeError) as e:
        load_recipe(path, sets)
    return e.value.issues


def test_minimal_recipe_gets_defaults(tmp_path: Path) -> None:
    r = load_recipe(write(tmp_path, MINIMAL))
    assert isinstance(r, Recipe) and r.trainer.engine == "hf" and r.algorithm.name == "grpo"
    with pytest.raises(ValidationError):
        r.run.steps = 3  # type: ignore[misc]  (frozen)


def test_python_tag_is_refused_not_executed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    text = MINIMAL + f"extra: !!python/object/apply:os.system ['touch {marker}']\n"
    issues = issues_of(write(tmp_path, text))
    assert not marker.exists()
    assert issues[0].key == "<file>" and "tag" in issues[0].message and issues[0].where.endswith(":6")


def test_unknown_key_suggests_and_gives_line(tmp_path: Path) -> None:
    text = MINIMAL + "trainer:\n  micro_batch_sise: 2\n  paralel: {tensor: 2}\n"
    issues = {i.key: i for i in issues_of(write(tmp_path, text))}
    assert issues["trainer.micro_batch_sise"].fix == "did you mean 'micro_batch_size'?"
    assert issues["trainer.micro_batch_sise"].where.endswith(":7")
    assert issues["trainer.paralel"].fix == "did you mean 'parallel'?"


def test_wrong_types_and_missing_keys_all_reported(tmp_path: Path) -> None:
    text = "name: t\nrollout: {n: many, temperature: -1}\n"
    keys = {i.key for i in issues_of(write(tmp_path, text))}
    assert {"model", "data", "reward", "rollout.n", "rollout.temperature"} <= keys


def test_no_reward_is_implied(tmp_path: Path) -> None:
    """A recipe without a reward section, or with an empty one, is an error that lists the builtins."""
    for text in (NO_REWARD, MINIMAL.replace("{fn: arithmetic}", "{}")):
        (issue,) = issues_of(write(tmp_path, text))
        assert issue.key == "reward"
        assert "arithmetic, gsm8k, format, length" in f"{issue.message} {issue.fix}"


def test_algorithm_union_keys_and_unknown_name(tmp_path: Path) -> None:
    issues = issues_of(write(tmp_path, MINIMAL + "algorithm: {name: grpo, gamma: 0.9}\n"))
    assert [i.key for i in issues] == ["algorithm.gamma"]  # gamma belongs to ppo only
    issues = issues_of(write(tmp_path, MINIMAL + "algorithm: {name: gpro}\n"))
    assert issues[0].key == "algorithm.name" and "grpo" in issues[0].fix
    r = load_recipe(write(tmp_path, MINIMAL + "algorithm: {name: dapo}\n"))
    assert isinstance(r.algorithm, DapoCfg) and r.algorithm.clip.high == 0.28


def test_algorithm_section_without_name_is_grpo(tmp_path: Path) -> None:
    """`--set algorithm.KEY=...` on a recipe without an algorithm section (or one without `name`) is GRPO's
    section; before, pydantic could not pick the section type ("Unable to extract tag using discriminator")."""
    r = load_recipe(write(tmp_path, MINIMAL), ["algorithm.rollout_correction.weights=token"])
    assert r.algorithm.name == "grpo" and r.algorithm.rollout_correction.weights == "token"
    r = load_recipe(write(tmp_path, MINIMAL + "algorithm: {kl: {coef: 0.1}}\n"))
    assert r.algorithm.name == "grpo" and r.algorithm.kl.coef == 0.1
    issues = issues_of(write(tmp_path, MINIMAL), "algorithm.gamma=0.9")
    assert [i.key for i in issues] == ["algorithm.gamma"]  # a key GRPO does not have: named, no tag error


def test_overrides_are_yaml_scalars_and_validated(tmp_path: Path) -> None:
    f = write(tmp_path, MINIMAL)
    r = load_recipe(
        f, ["rollout.n=8", "trainer.parallel.tensor=2", "lora.targets=[linear_qkv]", "run.dir=null"]
    )
    assert (
        r.rollout.n == 8
        and r.trainer.parallel.tensor == 2
        and r.lora.targets == ["linear_qkv"]
        and r.run.dir is None
    )
    issues = issues_of(f, "rollout.n=zero", "rollout.nn=3")
    assert {i.key: i.where for i in issues} == {
        "rollout.n": "--set rollout.n=zero",
        "rollout.nn": "--set rollout.nn=3",
    }
    assert issues_of(f, "rollout.n")[0].key == "--set"


@pytest.mark.parametrize(
    "text", ["", "- a\n- b\n", "just a string", "a: [1, 2\n", "\tname: x\n", "name: t\nname: u\n"]
)
def test_malformed_files(tmp_path: Path, text: str) -> None:
    assert issues_of(write(tmp_path, text))


def test_duplicate_key_is_an_error(tmp_path: Path) -> None:
    issues = issues_of(write(tmp_path, MINIMAL + "name: again\n"))
    assert issues[0].key == "name" and "duplicate" in issues[0].message


def test_missing_and_binary_files(tmp_path: Path) -> None:
    assert "not found" in issues_of(tmp_path / "nope.yaml")[0].message
    f = tmp_path / "bin.yaml"
    f.write_bytes(b"\xff\xfe\x00garbage")
    assert issues_of(f)


def test_reward_fn_or_terms(tmp_path: Path) -> None:
    r = load_recipe(
        write(tmp_path, NO_REWARD + "reward: {terms: [{fn: arithmetic}, {fn: format, weight: 0.5}]}\n")
    )
    assert [t.fn for t in r.reward.resolved_terms()] == ["arithmetic", "format"]
    issues = issues_of(write(tmp_path, NO_REWARD + "reward: {fn: gsm8k, terms: [{fn: format}]}\n"))
    assert issues[0].key == "reward" and "either" in issues[0].message


def test_schema_has_field_docs() -> None:
    schema = Recipe.model_json_schema()
    lora = schema["$defs"]["LoraCfg"]["properties"]["rank"]
    assert "full fine-tuning" in lora["description"]
