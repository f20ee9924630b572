"""The recipes shipped with rlbridge: the repository's recipes/, packaged as rlbridge/recipes.

One copy: `rlbridge/recipes` is a symlink to `recipes/` in the repository, and the build copies the files
into wheels and sdists (package data), so `rlbridge recipes list | show | copy` work after a plain
`pip install` as well as in a checkout. Each recipe's first comment line says what it is; a `# Run:` line
gives its command.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from importlib.resources import files
from importlib.resources.abc import Traversable

from rlbridge.errors import RlbridgeError


class UnknownRecipe(RlbridgeError):
    """A name that is not a shipped recipe (a usage error: exit 2)."""


@dataclass(frozen=True)
class Shipped:
    name: str
    """File name without .yaml: what `rlbridge recipes show/copy` take."""
    text: str

    @property
    def description(self) -> str:
        """The first sentence of the header comment (the lines before `# Run:`)."""
        words = []
        for line in self.text.splitlines():
            if not line.startswith("#") or "Run:" in line:
                break
            words.append(line.lstrip("#").strip())
        text = " ".join(words)
        end = text.find(". ")
        return text if end < 0 else text[: end + 1]

    @property
    def run(self) -> str:
        for line in self.text.splitlines():
            if not line.startswith("#"):
                break
            if "Run:" in line:
                return line.split("Run:", 1)[1].strip()
        return ""


def _root() -> Traversable:
    return files("rlbridge") / "recipes"


def shipped() -> list[Shipped]:
    root = _root()
    if not root.is_dir():
        raise RlbridgeError(
            "this installation has no shipped recipes (rlbridge/recipes is missing): reinstall rlbridge"
        )
    found = [
        Shipped(f.name.removesuffix(".yaml"), f.read_text(encoding="utf-8"))
        for f in root.iterdir()
        if f.name.endswith(".yaml")
    ]
    return sorted(found, key=lambda s: s.name)


def find(name: str) -> Shipped:
    all_ = shipped()
    key = name.removesuffix(".yaml").removeprefix("recipes/")
    for s in all_:
        if s.name == key:
            return s
    names = [s.name for s in all_]
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise UnknownRecipe(
        f"no shipped recipe named {name!r}: {hint}see `rlbridge recipes list` ({', '.join(names)})"
    )


def for_copy(recipe: Shipped, dest: str) -> str:
    """The text to write at `dest`: header commands that name the shipped path name the copy instead."""
    lines = recipe.text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if not line.startswith("#"):
            break
        lines[i] = line.replace(f"recipes/{recipe.name}.yaml", dest)
    return "".join(lines)
