"""Every `# type: ignore` in rlbridge/ names its error codes and says why on the same line."""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "rlbridge"
EXPLAINED = re.compile(r"# type: ignore\[[a-z-]+(,[a-z-]+)*\]  # \S")


def test_every_type_ignore_has_codes_and_a_reason() -> None:
    bare = [
        f"{path.relative_to(PACKAGE.parent)}:{i}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if "type: ignore" in line and not EXPLAINED.search(line)
    ]
    assert not bare, "type: ignore without [codes] and a reason:\n" + "\n".join(bare)


def test_the_check_catches_a_bare_ignore() -> None:
    assert not EXPLAINED.search("x = f()  # type: ignore[arg-type]")
    assert not EXPLAINED.search("x = f()  # type: ignore")
    assert EXPLAINED.search("x = f()  # type: ignore[arg-type]  # stubs are wrong")
