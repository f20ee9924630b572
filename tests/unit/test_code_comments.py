"""Comments explain code; results live in results. rlbridge/'s docstrings, comments and messages carry no dates, no
GPU model names, no `bench/results` paths and no session diaries: a measurement behind a default is one link into
docs/ (docs/defaults.md), and every such link names a page and a heading that exist."""

from __future__ import annotations

import re
from pathlib import Path

from markdown.extensions.toc import slugify

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "rlbridge").rglob("*.py"))
ORDINAL = (
    r"(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|\w+teenth|\w+tieth)"
)
FORBIDDEN = {
    "a date": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
    "a GPU model": re.compile(
        r"\b(H100|H200|H800|A100|A800|V100|L40S?|GB?200|B100|MI[23]\d\dX?|RTX ?\d{4})\b"
    ),
    "a bench/results path": re.compile(r"bench/results"),
    "a session diary": re.compile(rf"\b{ORDINAL} session\b", re.I),
}
DOC_LINK = re.compile(r"\bdocs/([\w./-]+\.md)(?:#([\w-]+))?")


def offenders(text: str) -> list[tuple[int, str, str]]:
    """(line, what, the match) of every forbidden string in `text`."""
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in FORBIDDEN.items():
            out += [(number, what, m.group(0)) for m in pattern.finditer(line)]
    return out


def test_no_dates_gpu_models_or_result_paths_in_rlbridge() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {what} ({match!r})"
        for path in SOURCES
        for line, what, match in offenders(path.read_text(encoding="utf-8"))
    ]
    assert not found, (
        "rlbridge/ explains code; measurements live in bench/results/ and are cited from docs/ (a section of "
        "docs/defaults.md, linked as docs/defaults.md#section):\n" + "\n".join(found)
    )


def test_the_check_catches_each_kind() -> None:
    text = '"""Measured on an H200 (2026-12-04, bench/results/x.md) in the twentieth session."""\n# H100: 3x\nok = 1\n'
    assert [(line, what) for line, what, _ in offenders(text)] == [
        (1, "a date"),
        (1, "a GPU model"),
        (1, "a bench/results path"),
        (1, "a session diary"),
        (2, "a GPU model"),
    ]
    assert offenders('"""The session holds the workers; start_new_session=True."""') == []


def anchors(page: Path) -> set[str]:
    """The heading ids mkdocs gives `page` (markdown's toc slugify)."""
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.M | re.S)
    return {slugify(m.group(1).strip(), "-") for m in re.finditer(r"^#+\s+(.+?)\s*#*$", text, re.M)}


def test_links_into_docs_name_real_pages_and_headings() -> None:
    broken = []
    for path in SOURCES:
        for m in DOC_LINK.finditer(path.read_text(encoding="utf-8")):
            page = ROOT / "docs" / m.group(1)
            if not page.is_file():
                broken.append(f"{path.relative_to(ROOT)}: docs/{m.group(1)} does not exist")
            elif m.group(2) and m.group(2) not in anchors(page):
                broken.append(f"{path.relative_to(ROOT)}: docs/{m.group(1)} has no heading #{m.group(2)}")
    assert not broken, "\n".join(broken)
