"""A reward model as a reward term: a tiny random sequence-classification Llama built in the test scores prompt +
completion in right-padded batches exactly as one unpadded text at a time does, with TRL's text (a conversation
through the chat template); in the reward pool one worker of its own holds it, its seconds and failures are counted
apart; validation refuses a model without a classification head and a GPU device on a CPU cluster; the plan counts
one on the GPU (float32 weights, a batch, a CUDA context) and refuses it past the device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from rlbridge.data.reward_pool import ModelSpec, RewardPool, _batch_fn
from rlbridge.errors import RecipeError
from rlbridge.model.reward_model import RewardModel, model_problem
from rlbridge.recipe import validate_recipe
from rlbridge.recipe.schema import RewardCfg, RewardTerm
from tests.fixtures.tiny_models import _common, build_tiny_llama_tied
from tests.fixtures.tiny_tokenizer import build_tiny_tokenizer


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForSequenceClassification

    out = tmp_path_factory.mktemp("rm")
    tokenizer = build_tiny_tokenizer()
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(LlamaConfig(**_common(tokenizer), num_labels=1))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_scores_match_one_text_at_a_time(reward_dir: Path) -> None:
    rm = _batch_fn(ModelSpec(str(reward_dir), batch_size=2))  # what the models' worker builds for the term
    assert isinstance(rm, RewardModel) and rm.batch_size == 2 and rm.device == torch.device("cpu")
    conversation = [{"role": "user", "content": "What is 1 + 1 ?"}]
    prompts = ["What is 2 + 2 ?", "What is", conversation]
    completions = [" 4", " 5 + 5 is 10 and 3", [{"role": "assistant", "content": "2"}]]
    got = rm(prompts=prompts, completions=completions, completion_ids=[[], [], []], solution=["4", "10", "2"])
    texts = rm.texts(prompts, completions)
    assert texts[0] == "What is 2 + 2 ? 4" and texts[2] == rm.tokenizer.apply_chat_template(
        [*conversation, {"role": "assistant", "content": "2"}], tokenize=False
    )
    with torch.inference_mode():
        want = [
            float(rm.model(**rm.tokenizer(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0])
            for t in texts
        ]
    assert got == pytest.approx(want, abs=1e-5) and len(set(got)) == 3


def test_a_config_pad_id_other_than_the_tokenizers_does_not_change_padded_scores(
    reward_dir: Path, tmp_path: Path
) -> None:
    """A model whose config.json names another pad token than its tokenizer pads with (found on a GPU machine whose
    transformers left the tokenizer without one): the model pools its rightmost token that is not
    config.pad_token_id, so padded rows would be scored at a pad position. The reward model follows the tokenizer,
    as TRL does: batched scores equal one text at a time."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(str(reward_dir))
    tokenizer = AutoTokenizer.from_pretrained(str(reward_dir))
    assert tokenizer.pad_token_id == 0
    model.config.pad_token_id = tokenizer.eos_token_id  # not what the tokenizer pads with
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    prompts = ["What is 2 + 2 ?", "What is", "What is 1 + 1 ?"]
    completions = [" 4", " 5 + 5 is 10 and 3 and 7", " 2"]
    batched = RewardModel(str(tmp_path), batch_size=3)(prompts=prompts, completions=completions)
    alone = RewardModel(str(tmp_path), batch_size=1)(prompts=prompts, completions=completions)
    assert batched == pytest.approx(alone, abs=1e-5)


def test_validation_wants_a_classification_head(reward_dir: Path, tmp_path: Path) -> None:
    assert model_problem(str(reward_dir)) is None
    causal = build_tiny_llama_tied(tmp_path / "lm")
    assert "not a sequence-classification model (architectures: LlamaForCausalLM)" in str(
        model_problem(str(causal))
    )
    assert "config.json" in str(model_problem(str(tmp_path / "nowhere")))
    cfg = RewardCfg.model_validate(
        {"terms": [{"fn": "arithmetic"}, {"model": str(reward_dir), "weight": 0.1}]}
    )
    assert [t.name for t in cfg.resolved_terms()] == ["arithmetic", f"model:{reward_dir}"]
    with pytest.raises(ValueError, match="either fn .* or model"):
        RewardTerm(fn="arithmetic", model="x")


def test_the_pool_scores_it_in_a_worker_of_its_own(reward_dir: Path) -> None:
    """Two function workers and one models' worker: the functions' workers never load the model (a per-sample
    function there says so), the scores are the model's own, its seconds and failures are counted apart; a batch
    past its time limit (reward.timeout_s per sample) fails the model term on every sample and a fresh models'
    worker scores the next call."""
    terms = [
        {"model": str(reward_dir), "weight": 1.0, "batch_size": 3},
        {"fn": "tests.fixtures.reward_fns:no_reward_model_here", "weight": 0.0},
        {"fn": "format", "weight": 0.0},
    ]
    cfg = RewardCfg.model_validate({"terms": terms, "workers": 2})
    prompts = ["What is 2 + 2 ?", "What is", "What is 1 + 1 ?", "What"]
    completions = [" 4", " 5 + 5 is 10", " 2 #### 2", " 3"]
    rows = [{"question": p, "answer": "4"} for p in prompts]
    want = RewardModel(str(reward_dir))(prompts=prompts, completions=completions)
    name = f"model:{reward_dir}"
    with RewardPool(cfg) as pool:
        assert sorted(w.models for w in pool._workers) == [False, False, True]
        res = pool.score(prompts, completions, rows)
        assert res.num_errors == 0 and res.model_errors == 0, res.errors
        assert res.terms[name] == pytest.approx(want, abs=1e-5) and res.scores == pytest.approx(
            want, abs=1e-5
        )
        assert res.terms["tests.fixtures.reward_fns:no_reward_model_here"] == [1.0] * 4
        assert 0 < res.model_seconds < 30
    alone = RewardCfg.model_validate({"terms": terms[:1], "workers": 2})
    with RewardPool(alone) as pool:
        assert [w.models for w in pool._workers] == [True]  # no function: no function workers
        pool.cfg = alone.model_copy(update={"timeout_s": 1e-6})  # the batch's limit: 4 us
        late = pool.score(prompts, completions, rows)
        assert late.model_errors == late.num_errors == 4 and late.terms[name] == [None] * 4
        assert "TimeoutError: a batched reward call" in str(late.last_traceback) and late.model_seconds < 5
        pool.cfg = alone
        again = pool.score(prompts, completions, rows)
        assert again.model_errors == 0 and again.terms[name] == pytest.approx(want, abs=1e-5)
        assert [w.models for w in pool._workers] == [True]


def test_device_and_batch_size_are_validated(reward_dir: Path, tmp_path: Path) -> None:
    raw = yaml.safe_load((Path(__file__).parents[3] / "recipes" / "quickstart.yaml").read_text())
    raw["reward"]["terms"].append(
        {"model": str(reward_dir), "weight": 0.1, "device": "cuda", "batch_size": 4}
    )
    f = tmp_path / "r.yaml"
    f.write_text(yaml.safe_dump(raw))
    with pytest.raises(RecipeError) as e:
        validate_recipe(f)
    issue = {i.key: i for i in e.value.issues}["reward.terms.2.device"]
    assert "cluster.device is cpu" in issue.message and "reward.terms.2.device: cpu" in str(issue.fix)
    term = validate_recipe(f, ["reward.terms.2.device=cpu"]).recipe.reward.resolved_terms()[2]
    assert (term.device, term.batch_size) == ("cpu", 4)
    with pytest.raises(ValueError, match="device belong to a reward model term"):
        RewardTerm(fn="arithmetic", device="cuda")
    # a resolved recipe carries every field of every term: the defaults on a function term are accepted
    again = RewardTerm.model_validate(RewardTerm(fn="arithmetic").model_dump())
    assert (again.fn, again.device, again.batch_size) == ("arithmetic", "cpu", 16)


def _gpu_recipe(tmp_path: Path, term: dict[str, object] | None, **cluster: object) -> Path:
    """The GPU quickstart (validated here without a GPU: validation reads config.json files only) with `term`
    as a third reward term."""
    raw = yaml.safe_load((Path(__file__).parents[3] / "recipes" / "quickstart-gpu.yaml").read_text())
    if term is not None:
        raw["reward"]["terms"].append(term)
    raw["cluster"].update(cluster)
    f = tmp_path / "gpu.yaml"
    f.write_text(yaml.safe_dump(raw))
    return f


def test_the_plan_counts_a_reward_model_on_the_gpu(reward_dir: Path, tmp_path: Path) -> None:
    """Its float32 weights are the built model's own parameter count (from its config.json, as the policy's), its
    activations grow with batch_size; the peak (GPU 0 of node 0) holds them and a CUDA context, a CPU one adds
    nothing; `rlbridge plan` prints it on a line of its own."""
    from transformers import AutoModelForSequenceClassification
    from typer.testing import CliRunner

    from rlbridge.cli import app
    from rlbridge.plan import CONTEXT_GIB, GIB, make_plan, reward_model_gib

    numel = sum(
        p.numel() for p in AutoModelForSequenceClassification.from_pretrained(reward_dir).parameters()
    )
    term = {"model": str(reward_dir), "weight": 0.1, "device": "cuda", "batch_size": 4}
    plain = validate_recipe(_gpu_recipe(tmp_path, None))
    valid = validate_recipe(_gpu_recipe(tmp_path, term))
    plan = make_plan(valid.recipe, valid.model)
    weights, act = reward_model_gib(valid.recipe, plan.batches)
    assert weights == pytest.approx(numel * 4 / GIB, rel=1e-9)
    wider = {**term, "batch_size": 8}
    assert reward_model_gib(
        validate_recipe(_gpu_recipe(tmp_path, wider)).recipe, plan.batches
    ) == pytest.approx((weights, 2 * act), rel=1e-9)
    base = make_plan(plain.recipe, plain.model).memory
    mem = plan.memory
    assert base is not None and mem is not None and base.reward_model_total == 0.0
    assert mem.reward_model_total == pytest.approx(weights + act + CONTEXT_GIB, abs=1e-3)
    assert mem.peak == pytest.approx(base.peak + mem.reward_model_total, abs=2e-3)
    on_cpu = validate_recipe(_gpu_recipe(tmp_path, {**term, "device": "cpu"}))
    assert make_plan(on_cpu.recipe, on_cpu.model).memory == base
    res = CliRunner().invoke(app, ["plan", str(_gpu_recipe(tmp_path, term))], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert (
        "reward model (GPU 0)" in res.output
        and f"reward model {mem.reward_model_total:.2f} on GPU 0" in res.output
    )


def test_a_reward_model_past_the_device_is_refused(tmp_path: Path) -> None:
    """A 14B-shaped reward model (its config.json alone: validation reads no weights) in float32 beside the GPU
    quickstart on a 64 GiB device: the peak is over the device, refused with the move to the CPU among the fixes;
    on the CPU (or without it) the same recipe validates."""
    big = tmp_path / "rm14b"
    big.mkdir()
    (big / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen2ForSequenceClassification"], "model_type": "qwen2", "hidden_size": 5120,
                "intermediate_size": 13824, "num_hidden_layers": 48, "num_attention_heads": 40,
                "num_key_value_heads": 8, "vocab_size": 152064, "tie_word_embeddings": False, "num_labels": 1,
            }
        )
    )  # fmt: skip
    term = {"model": str(big), "weight": 0.1, "device": "cuda"}
    validate_recipe(_gpu_recipe(tmp_path, None, gpu_memory_gib=64))
    with pytest.raises(RecipeError) as e:
        validate_recipe(_gpu_recipe(tmp_path, term, gpu_memory_gib=64))
    issue = {i.key: i for i in e.value.issues}["cluster.gpu_memory_gib"]
    assert "exceeds the 64 GiB" in issue.message and "reward.terms.2.device: cpu (~" in str(issue.fix)
    validate_recipe(_gpu_recipe(tmp_path, {**term, "device": "cpu"}, gpu_memory_gib=64))
