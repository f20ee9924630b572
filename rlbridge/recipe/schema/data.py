"""The recipe's `data` section: where the prompts come from, which columns hold them, and how they are batched
and rendered."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from rlbridge.recipe.schema.base import PositiveInt, Section


class DatasetCfg(Section):
    path: str
    """Where the rows come from: a local file (.jsonl, .parquet, .json, .csv), a folder (written by Hugging Face
    datasets' `save_to_disk`, or holding data files), a Hugging Face Hub dataset name (`openai/gsm8k`; from the
    local datasets cache when offline), or `builtin:arithmetic` for the generated arithmetic task."""
    config: str | None = None
    """Configuration of a Hub dataset (`openai/gsm8k`: main or socratic). A single file and a `save_to_disk` folder
    have none (setting one is an error)."""
    split: str | None = None
    """Split of a Hub dataset or a folder (default: train for data.train; validation, else test, for data.val).
    A single file has one split."""
    loader: Literal["auto", "datasets", "memory"] = "auto"
    """How rows are read. memory: a .jsonl or .parquet file row by row into memory (malformed rows skipped and
    counted, every prompt tokenized at start). datasets: Hugging Face datasets: memory-mapped Arrow (a file is
    converted once into the datasets cache; a .json file of one JSON array first to JSON Lines, one element at a
    time), each row read and tokenized when it is sampled, so a file of millions of rows never sits in memory; rows
    unusable as prompts are skipped when sampled. auto: memory for a .jsonl or
    .parquet file up to 64 MiB, datasets for a larger one and for every other source. A run resumes with the
    loader it started with (set it explicitly to resume a run started under another rule)."""
    prompt_key: str | None = None
    """Column holding the prompt, for this split only (default: data.columns.prompt)."""
    answer_key: str | None = None
    """Column holding the reference answer, for this split only (default: data.columns.answer)."""
    limit: Annotated[int, Field(ge=1)] | None = None
    """Use only the first `limit` rows."""

    @model_validator(mode="after")
    def _memory_reads_files(self) -> DatasetCfg:
        if self.loader == "memory" and Path(self.path).suffix.lower() not in (".jsonl", ".parquet"):
            raise ValueError(
                f"loader memory reads a .jsonl or .parquet file, not {self.path}; remove loader (auto) or set "
                "it to datasets"
            )
        return self


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
