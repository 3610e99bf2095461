"""Lines of a UTF-8 text file, each decoded on its own, so one undecodable line is reported
with its line number and byte offset (or skipped by the caller) instead of failing the whole
read with a bare ``UnicodeDecodeError`` that names neither the file nor the row. ``json_lines``
parses JSONL on top of it: the one reader of training rows (``a3po.data.datasets``) and benchmark files
(``eval.data``), each of which words its own error. Valid bytes can still carry text that is not
UTF-8: JSON's ``"\\ud800"`` escape decodes to a lone surrogate, which no UTF-8 writer (a completion
table, a tokenizer, MLflow) accepts, so ``json_lines`` refuses such a value too (:func:`unencodable`)."""

from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Any, Iterator


def undecodable(e: UnicodeDecodeError, line_offset: int = 0) -> str:
    """The problem of ``e`` with its byte offset in the file (for a hex dump)."""
    return f"not valid UTF-8 (byte {line_offset + e.start} of the file: {e.reason})"


def utf8_lines(path: str | Path) -> Iterator[tuple[int, str | None, str | None]]:
    """``(line_number, text, problem)`` for each line of ``path`` (1-based numbers); ``text`` is
    None and ``problem`` says why when the line's bytes are not strict UTF-8. A UTF-8 byte-order
    mark at the start of the file is dropped."""
    offset = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            start = offset
            offset += len(raw)
            if number == 1 and raw.startswith(codecs.BOM_UTF8):
                raw, start = raw[len(codecs.BOM_UTF8):], start + len(codecs.BOM_UTF8)
            try:
                yield number, raw.decode("utf-8"), None
            except UnicodeDecodeError as e:
                yield number, None, undecodable(e, start)


def unencodable(value: Any, where: str = "") -> str | None:
    """Why parsed JSON ``value`` is not UTF-8 text (a string or key, at any depth, holding a lone
    surrogate), naming the field; None when every string encodes."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            field = f"field {where!r}: " if where else ""
            return f"{field}not UTF-8 text (lone surrogate U+{ord(value[e.start]):04X} at character {e.start})"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        name = f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}" if where else key
        problem = (unencodable(key, f"{name} (its name)") if isinstance(key, str) else None) or unencodable(item, name)
        if problem:
            return problem
    return None


def json_lines(path: str | Path) -> Iterator[tuple[int, Any, str | None]]:
    """``(line_number, value, problem)`` for each non-blank line of a JSONL file: ``value`` is the
    parsed JSON (any type; callers check for objects), or None with ``problem`` saying why when
    the line is not UTF-8, not valid JSON, or holds a string that is not UTF-8 text."""
    for number, text, problem in utf8_lines(path):
        value = None
        if text is not None:
            if not text.strip():
                continue
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                problem = f"not valid JSON ({e.msg})"
            else:
                problem = unencodable(value)
                value = None if problem else value
        yield number, value, problem
