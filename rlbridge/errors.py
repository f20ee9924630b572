"""Errors meant for users. Anything raised as `RlbridgeError` is printed without a traceback.

`RecipeError` carries every problem found in a recipe at once; the CLI exits 2 on it. Other
`RlbridgeError`s (a missing checkpoint, a dead worker) exit 1.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


class RlbridgeError(Exception):
    """A failure with a message a user can act on (no traceback shown)."""


@dataclass(frozen=True)
class RecipeIssue:
    key: str
    """Dotted recipe key, e.g. trainer.parallel.tensor (or <file> for file-level problems)."""
    message: str
    """What is wrong, with the numbers involved."""
    value: str | None = None
    where: str | None = None
    """file:line, or --set for an override."""
    fix: str | None = None
    """The smallest change that makes it valid."""
    origin: tuple[str, ...] = ()
    """The keys that chose the values the problem was found in, when not `key` alone, least specific first: the
    rows of a data split lack what `key` names, and `data.train.path`, `.config` and `.split` chose those rows.
    The last `--set` of one of them is the `where`; without one, a `key` the file does not write is put on the
    file line of the last of them the file writes (recipe/__init__.py). Not printed."""

    def to_dict(self) -> dict[str, str | None]:
        out = asdict(self)
        del out["origin"]
        return out

    def __str__(self) -> str:
        text = f"{self.key}: {self.message}"
        if self.value is not None:
            text += f" (got {self.value})"
        if self.fix:
            text += f"; fix: {self.fix}"
        if self.where:
            text += f"  [{self.where}]"
        return text


class DataError(RlbridgeError):
    """A data source that does not hold what the recipe asks of it (a split, a configuration), with the recipe key
    to change and the fix, kept apart so that validate-recipe reports them as a recipe issue."""

    def __init__(self, key: str, message: str, fix: str, value: str | None = None):
        self.key, self.message, self.fix, self.value = key, message, fix, value
        super().__init__(f"{key}: {message}; {fix}")


class RecipeError(RlbridgeError):
    """One or more problems in a recipe; all of them are reported together."""

    def __init__(self, issues: list[RecipeIssue]):
        self.issues = issues
        super().__init__("\n".join(str(i) for i in issues))
