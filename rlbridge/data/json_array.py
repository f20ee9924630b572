"""A .json file holding one JSON array of row objects, read one element at a time.

Hugging Face datasets reads such a file whole (its bytes, every row as a Python object, then the rows again as JSON
Lines) before converting it to Arrow: several times the file's size in memory at once. Here the standard library's
`JSONDecoder.raw_decode` takes one element at a time from a buffer of CHUNK_CHARS, so a run converts the array to
JSON Lines (`write_json_lines`, which datasets then reads in chunks and memory-maps) and validation previews its
first rows (`array_rows`) in memory that does not grow with the file. A malformed file is an `RlbridgeError` with
the line and column.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, NamedTuple

from rlbridge.errors import RlbridgeError

CHUNK_CHARS = 1 << 20
"""Characters read at a time; an element longer than this grows the buffer until it is whole."""
_SLACK = 16
"""A decode error this close to the end of the buffer may be an element cut by the chunk (`tr` of `true`): read
more before calling it an error."""
_NEWLINES = str.maketrans({"\n": " ", "\r": " "})


class Element(NamedTuple):
    position: int
    """0-based position in the array."""
    line: int
    """1-based line of the file where the element starts."""
    text: str
    """The element's JSON text on one line (a newline outside strings is whitespace; JSON forbids one inside)."""
    value: dict[str, Any]


def is_json_array(path: Path) -> bool:
    """Whether the file's first character past whitespace (and a UTF-8 byte-order mark) is `[`."""
    with path.open("rb") as f:
        head = f.read(4096)
    return head.removeprefix(b"\xef\xbb\xbf").lstrip()[:1] == b"["


class _Reader:
    """The buffer over the file: `buf[pos:]` is unread; `line` is the line of `buf[counted]` (lines are counted
    forward only, so that each character is counted once)."""

    def __init__(self, f: IO[str]) -> None:
        self.f, self.buf, self.pos, self.eof = f, "", 0, False
        self.line, self.counted = 1, 0

    def line_at(self, pos: int) -> int:
        """The line of `buf[pos]`, for `pos` at or past the last one asked."""
        self.line += self.buf.count("\n", self.counted, pos)
        self.counted = pos
        return self.line

    def more(self) -> bool:
        """Drop what was read, append a chunk; False at the end of the file."""
        chunk = "" if self.eof else self.f.read(CHUNK_CHARS)
        if not chunk:
            self.eof = True
            return False
        self.line_at(self.pos)
        self.buf, self.pos, self.counted = self.buf[self.pos :] + chunk, 0, 0
        return True

    def next_char(self) -> str:
        """The next character past whitespace ('' at the end of the file), not consumed."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos < len(self.buf) or not self.more():
                return self.buf[self.pos : self.pos + 1]

    def where(self, pos: int) -> str:
        line = self.line + self.buf.count("\n", self.counted, pos) - self.buf.count("\n", pos, self.counted)
        column = pos - (self.buf.rfind("\n", 0, pos) + 1) + 1
        return f"line {line} column {column}"


def array_elements(path: Path, key: str) -> Iterator[Element]:
    """The elements of the JSON array in `path`, in order; each must be an object (a row)."""
    decoder = json.JSONDecoder()

    def bad(reader: _Reader, pos: int, why: str) -> RlbridgeError:
        return RlbridgeError(
            f"{key}.path: {path} is not a JSON array of row objects: {why} at {reader.where(pos)}; fix the file "
            f"(python -m json.tool {path} > /dev/null names the first error), or write one JSON object per line "
            "to a .jsonl file"
        )

    with path.open(encoding="utf-8-sig") as f:  # -sig: a leading byte-order mark is not content
        reader = _Reader(f)
        if reader.next_char() != "[":
            raise bad(reader, reader.pos, "it does not start with '['")
        reader.pos += 1
        index = 0
        while True:
            c = reader.next_char()
            if c == "]" and index == 0:
                reader.pos += 1
                break
            if c != "{":
                what = "the end of the file" if not c else repr(c)
                raise bad(reader, reader.pos, f"element {index} starts with {what}, not '{{' (an object)")
            while True:
                try:
                    value, end = decoder.raw_decode(reader.buf, reader.pos)
                except json.JSONDecodeError as e:
                    cut = e.pos >= len(reader.buf) - _SLACK or e.msg.startswith("Unterminated string")
                    if cut and reader.more():
                        continue
                    raise bad(reader, e.pos, f"{e.msg} (element {index})") from None
                break  # an object ends at its closing brace: nothing of it is left to read
            yield Element(
                index, reader.line_at(reader.pos), reader.buf[reader.pos : end].translate(_NEWLINES), value
            )
            reader.pos, index = end, index + 1
            c = reader.next_char()
            if c == "]":
                reader.pos += 1
                break
            if c != ",":
                what = "the end of the file" if not c else repr(c)
                raise bad(reader, reader.pos, f"expected ',' or ']' after element {index - 1}, found {what}")
            reader.pos += 1
        if reader.next_char():
            raise bad(reader, reader.pos, "text after the closing ']'")


def array_rows(path: Path, key: str, num_rows: int) -> list[tuple[str, Any, str | None]]:
    """(where, row, None) for the first `num_rows` elements, reading only as far as they go."""
    out: list[tuple[str, Any, str | None]] = []
    for element in array_elements(path, key):
        if len(out) == num_rows:
            break
        out.append((f"row {element.position + 1} (line {element.line})", element.value, None))
    return out


def write_json_lines(path: Path, out: IO[str], key: str) -> int:
    """The array's elements to `out`, one per line; the number of rows."""
    count = 0
    for element in array_elements(path, key):
        out.write(element.text + "\n")
        count += 1
    return count
