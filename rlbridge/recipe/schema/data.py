"""The recipe's `data` section: where the prompts come from, which columns hold them, and how they are batched
and rendered."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from rlbridge.recipe.schema.base import PositiveInt, Section


class DatasetCfg(Section):
    path: str
    """Where the rows come from: a local file (.jsonl, .parquet, .json, .csv), a folder (written by Hugging Face
    datasets' `save_to_disk`, or holding data files), a Hugging Face Hub dataset name (`openai/gsm8k`; from the
    local datasets cache when offline), or `builtin:arithmetic` for the generated arithmetic task."""
    config: str | None = None
    """Configuration of a Hub dataset (`openai/gsm8k`: main or socratic)."""
    split: str | None = None
    """Split of a Hub dataset or a folder (default: train for data.train; validation, else test, for data.val).
    A single file has one split."""
    loader: Literal["auto", "datasets"] = "auto"
    """How rows are read. auto: a .jsonl or .parquet file row by row into memory (malformed rows skipped and
    counted), every other source through Hugging Face datasets. datasets: Hugging Face datasets for a .jsonl or
    .parquet file too: memory-mapped Arrow (converted once into the datasets cache), each row read and tokenized
    when it is sampled, so a file of millions of rows never sits in memory; rows unusable as prompts are skipped
    when sampled."""
    prompt_key: str | None = None
    """Column holding the prompt, for this split only (default: data.columns.prompt)."""
    answer_key: str | None = None
    """Column holding the reference answer, for this split only (default: data.columns.answer)."""
    limit: Annotated[int, Field(ge=1)] | None = None
    """Use only the first `limit` rows."""


class ColumnsCfg(Section):
    prompt: str = "question"
    """Column holding the prompt: a string, or a conversation (a list of `{role, content}` messages, TRL's
    conversational format), which the chat template renders as it is."""
    answer: str = "answer"
    """Column holding the reference answer (a string or a number): `sample["answer"]` of the reward functions.
    The row's other columns reach the rewards too (`sample`, or keyword lists of a batched reward)."""


class ArithmeticCfg(Section):
    digits: Annotated[int, Field(ge=1, le=6)] = 2
    """Digits per operand."""
    ops: list[Literal["+", "-", "*"]] = ["+"]
    """Operators drawn uniformly."""
    num_train: PositiveInt = 2000
    """Generated training problems."""
    num_val: PositiveInt = 200
    """Generated held-out problems (disjoint from the training set)."""


class DataCfg(Section):
    train: DatasetCfg
    val: DatasetCfg | None = None
    batch_size: PositiveInt = 8
    """Prompts per step (each sampled rollout.n times): the step's rollouts are batch_size x n. Larger batches
    give steadier gradients and use the devices better, at more time per step."""
    mini_batch_size: Annotated[int, Field(ge=1)] | None = None
    """Prompts per optimizer step; must divide batch_size (default: batch_size, one update per step)."""
    columns: ColumnsCfg = ColumnsCfg()
    """Which columns of the rows are the prompt and the answer (per split: data.train.prompt_key / answer_key)."""
    template: str = "{prompt}"
    """User message built from a row: `{prompt}` is the prompt field; other `{field}`s are row fields. Applies to
    string prompts; a conversation is rendered as it is."""
    system_prompt: str | None = None
    """Optional system message (put in front of a conversation that has none)."""
    chat_template: bool | str = True
    """Format prompts with the tokenizer's chat template (true), a Jinja chat template given here (a string, as
    in a tokenizer's `chat_template`), or encode the plain text (false; string prompts only)."""
    shuffle: bool = True
    """Shuffle every epoch (deterministic from run.seed and the epoch)."""
    arithmetic: ArithmeticCfg = ArithmeticCfg()
    """Settings of the `builtin:arithmetic` task."""

    def keys(self, ds: DatasetCfg, which: str) -> tuple[tuple[str, str], tuple[str, str]]:
        """((prompt column, the recipe key naming it), (answer column, its key)) of one split (train or val)."""
        prompt = (
            (ds.prompt_key, f"data.{which}.prompt_key")
            if ds.prompt_key
            else (self.columns.prompt, "data.columns.prompt")
        )
        answer = (
            (ds.answer_key, f"data.{which}.answer_key")
            if ds.answer_key
            else (self.columns.answer, "data.columns.answer")
        )
        return prompt, answer
