"""Prompts: load them (load.py), render and tokenize them (encode.py), and sample them (sampler.py). The rest of
the code imports every name from `rlbridge.data.datasets`.

Two ways in. A .jsonl or .parquet file of at most WHOLE_FILE_BYTES (data.<split>.loader auto; any size with loader
memory) and `builtin:arithmetic` are read whole into a list of `Prompt`s, forgiving per row and strict per file: a
malformed row (not an object, a missing key, an empty or non-string prompt, invalid JSON or UTF-8) is skipped and
counted, with the line numbers of the first few, but a file with no usable row, a missing file or a missing
column is an `RlbridgeError` naming the recipe key to change. Every other source (Hub datasets, .json, .csv,
folders, a larger .jsonl or .parquet file; or any file with loader datasets) goes through Hugging Face datasets
(hf_datasets.py) and stays on disk, memory-mapped: `LazyEncoded` reads and tokenizes a row when the sampler
reaches it, and the sampler passes over rows that cannot be prompts.

A prompt is a string (rendered with data.template into a user message) or a conversation (a list of
`{role, content}` messages, TRL's conversational format), given to the chat template as it is.

`PromptSampler` shuffles per epoch from (seed, epoch) alone, so its whole state is four integers and a resumed
run sees exactly the batches the uninterrupted one would have.
"""

from rlbridge.data.datasets.encode import (
    LazyEncoded,
    encode_prompt,
    encode_prompts,
    escape_template,
    render_messages,
    template_problem,
)
from rlbridge.data.datasets.load import (
    Columns,
    Prompt,
    Skipped,
    Split,
    conversation,
    load_dataset,
    open_prompts,
    preview,
    read_dataset,
    to_prompt,
    uses_datasets,
)
from rlbridge.data.datasets.sampler import PromptSampler, fingerprint

__all__ = [
    "Columns",
    "LazyEncoded",
    "Prompt",
    "PromptSampler",
    "Skipped",
    "Split",
    "conversation",
    "encode_prompt",
    "encode_prompts",
    "escape_template",
    "fingerprint",
    "load_dataset",
    "open_prompts",
    "preview",
    "read_dataset",
    "render_messages",
    "template_problem",
    "to_prompt",
    "uses_datasets",
]
