"""Formatting: a prompt rendered into chat messages (data.template, data.system_prompt) and tokenized (the chat
template, or the plain text), dropping prompts longer than rollout.max_prompt_tokens. `LazyEncoded` does the same
row by row for a source read through Hugging Face datasets, when the sampler reaches a row."""

from __future__ import annotations

import logging
import re
import string
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rlbridge.data.datasets.load import MAX_EXAMPLES, Prompt, Skipped
from rlbridge.errors import RlbridgeError
from rlbridge.recipe.schema import DataCfg

if TYPE_CHECKING:
    from rlbridge.data.hf_datasets import LazyPrompts

log = logging.getLogger(__name__)


def template_problem(template: str) -> str | None:
    """Why str.format cannot fill `template` from a row's fields by name (a lone brace, a placeholder that is
    not a field name such as the `{"answer": 1}` of a JSON example, a positional `{}`), or None."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        return f"str.format cannot read it ({e})"
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        base = re.split(r"[.\[]", name, maxsplit=1)[0]
        if not base.isidentifier():
            text = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            return (
                f"str.format reads {text!r} as a placeholder for a field named {base!r}, which no row has "
                "(placeholders are {prompt} and {field} of the row)"
            )
    return None


_PLACEHOLDER = re.compile(r"\{\{|\}\}|\{[A-Za-z_][A-Za-z0-9_]*\}|[{}]")


def escape_template(template: str) -> str:
    """`template` with every brace doubled except those of `{field}` placeholders and already doubled ones: what
    a template with literal braces (a JSON example) should say."""
    return _PLACEHOLDER.sub(lambda m: m.group(0) * 2 if m.group(0) in "{}" else m.group(0), template)


def render_messages(prompt: Prompt, data_cfg: DataCfg) -> list[dict[str, str]]:
    """[system (if data.system_prompt)], user = data.template with {prompt} and the row's fields; a conversation
    as it is (data.system_prompt in front when it has no system message)."""
    system = [{"role": "system", "content": data_cfg.system_prompt}] if data_cfg.system_prompt else []
    if prompt.messages is not None:
        has_system = any(m["role"] == "system" for m in prompt.messages)
        return [*([] if has_system else system), *prompt.messages]
    fields = {**prompt.row, "prompt": prompt.text}
    try:
        user = data_cfg.template.format_map(fields)
    except KeyError as e:
        raise RlbridgeError(
            f"data.template names the field {e} but the row has only {', '.join(sorted(fields))}"
        ) from e
    except (IndexError, ValueError, AttributeError) as e:
        raise RlbridgeError(
            f"data.template {data_cfg.template!r} is not a valid format string: {e}; "
            "use {prompt} and {field} placeholders (double braces for literal ones)"
        ) from e
    return [*system, {"role": "user", "content": user}]


def _chat_ids(tokenizer: Any, messages: list[dict[str, str]], template: str | None = None) -> list[int]:
    kwargs = {} if template is None else {"chat_template": template}
    try:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    except ValueError as e:  # transformers: "Cannot use chat template functions because ... not set"
        raise RlbridgeError(
            f"data.chat_template: the tokenizer cannot apply a chat template ({e}); set data.chat_template to "
            "a Jinja chat template, or to false to encode the plain text (string prompts only)"
        ) from e
    except Exception as e:  # jinja2's TemplateError family, from a recipe's own template
        if template is None:
            raise
        raise RlbridgeError(f"data.chat_template: the template fails on {messages!r}: {e}") from e
    ids = out["input_ids"] if isinstance(out, Mapping) else out  # transformers 5 may return a BatchEncoding
    if len(ids) and isinstance(ids[0], list | tuple):
        ids = ids[0]
    return [int(t) for t in ids]


def encode_prompt(tokenizer: Any, prompt: Prompt, data_cfg: DataCfg) -> list[int]:
    """Token ids of one prompt: the chat template (the tokenizer's, or data.chat_template's) with the generation
    prompt, or the plain text with the system prompt and a blank line in front."""
    messages = render_messages(prompt, data_cfg)
    if data_cfg.chat_template is True:
        return _chat_ids(tokenizer, messages)
    if isinstance(data_cfg.chat_template, str):
        return _chat_ids(tokenizer, messages, data_cfg.chat_template)
    if prompt.messages is not None:
        raise RlbridgeError(
            "data.chat_template is false but the prompts are conversations (lists of messages); set "
            "data.chat_template: true (the tokenizer's) or to a Jinja chat template"
        )
    return [int(t) for t in tokenizer.encode("\n\n".join(m["content"] for m in messages))]


def encode_prompts(
    tokenizer: Any, prompts: Sequence[Prompt], data_cfg: DataCfg, max_prompt_tokens: int
) -> tuple[list[list[int]], list[Prompt], int]:
    """Token ids of each prompt (`encode_prompt`), dropping those longer than max_prompt_tokens.

    Returns (ids of the kept prompts, the kept prompts, how many were dropped)."""
    ids_kept: list[list[int]] = []
    kept: list[Prompt] = []
    for prompt in prompts:
        ids = encode_prompt(tokenizer, prompt, data_cfg)
        if len(ids) <= max_prompt_tokens:
            ids_kept.append(ids)
            kept.append(prompt)
    return ids_kept, kept, len(prompts) - len(kept)


class LazyEncoded:
    """The prompts of a Hugging Face datasets source with their token ids, each row read and encoded when first
    asked for (the most recent `cache_rows` kept). `prompts[i]` / `ids[i]` index like the lists of a file read
    whole; `usable(i)` says whether row i is a prompt within max_prompt_tokens, which the sampler asks before
    taking it. The first few unusable rows are logged with the reason."""

    def __init__(
        self,
        source: LazyPrompts,
        tokenizer: Any,
        data_cfg: DataCfg,
        max_prompt_tokens: int,
        *,
        cache_rows: int = 8192,
    ) -> None:
        self.source, self.tokenizer, self.data_cfg = source, tokenizer, data_cfg
        self.max_prompt_tokens, self.cache_rows = max_prompt_tokens, cache_rows
        self._cache: OrderedDict[int, tuple[Prompt, list[int]] | str] = OrderedDict()
        self.skipped = Skipped()
        """Rows left out so far (each counted once), with the reasons of the first few."""
        self._left_out: set[int] = set()
        self.prompts = _Indexed(len(source), lambda i: self._usable_entry(i)[0])
        self.ids = _Indexed(len(source), lambda i: self._usable_entry(i)[1])

    def __len__(self) -> int:
        return len(self.source)

    def entry(self, i: int) -> tuple[Prompt, list[int]] | str:
        """(prompt, ids) of row i, or why it is not used."""
        found = self._cache.get(i)
        if found is not None:
            self._cache.move_to_end(i)
            return found
        return self._add(i, self.source.get(i))

    def _add(self, i: int, got: Any) -> tuple[Prompt, list[int]] | str:
        if isinstance(got, Prompt):
            ids = encode_prompt(self.tokenizer, got, self.data_cfg)
            entry: tuple[Prompt, list[int]] | str = (
                (got, ids)
                if len(ids) <= self.max_prompt_tokens
                else f"{len(ids)} tokens, more than rollout.max_prompt_tokens {self.max_prompt_tokens}"
            )
        else:
            entry = got
        if isinstance(entry, str) and i not in self._left_out:
            self._left_out.add(i)
            self.skipped.add(f"row {i + 1}", entry)
            if self.skipped.count <= MAX_EXAMPLES:
                log.warning("%s: row %d is left out: %s", self.source.description, i + 1, entry)
        self._cache[i] = entry
        if len(self._cache) > self.cache_rows:
            self._cache.popitem(last=False)
        return entry

    def usable_rows(self, indices: list[int]) -> list[bool]:
        """usable(i) of each index, the rows not read yet read together (the sampler's question per batch)."""
        missing = [i for i in dict.fromkeys(indices) if i not in self._cache]
        for i, got in zip(missing, self.source.get_many(missing), strict=True):
            self._add(i, got)
        return [self.usable(i) for i in indices]

    def usable(self, i: int) -> bool:
        return not isinstance(self.entry(i), str)

    def _usable_entry(self, i: int) -> tuple[Prompt, list[int]]:
        entry = self.entry(i)
        if isinstance(entry, str):
            raise IndexError(f"{self.source.description}: row {i + 1} is not usable: {entry}")
        return entry

    def first(self, k: int) -> tuple[list[Prompt], list[list[int]]]:
        """The first k usable prompts and their ids (evaluation's), scanning rows in order."""
        prompts: list[Prompt] = []
        ids: list[list[int]] = []
        for i in range(len(self)):
            if len(prompts) >= k:
                break
            entry = self.entry(i)
            if not isinstance(entry, str):
                prompts.append(entry[0])
                ids.append(entry[1])
        return prompts, ids


class _Indexed(Sequence[Any]):
    """A read-only sequence computed per index (LazyEncoded's prompts and ids)."""

    def __init__(self, size: int, at: Callable[[int], Any]) -> None:
        self._size, self._at = size, at

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self._at(j) for j in range(*i.indices(self._size))]
        return self._at(int(i))
