"""Answer extraction: which part of a completion is the model's final answer.

Pure string functions, linear in the completion length, so the reward stays cheap and a
100,000-character completion cannot stall the trainer. Extraction only *locates* an answer;
deciding whether two answers are equal is math-verify's job (``a3po.grading``), except for
plain numbers, which compare exactly here without any LaTeX parsing.

The answer is, in order of precedence (``extract_answer``):

1. ``boxed``       the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) whose braces balance;
                   an unclosed ``\\boxed{`` is skipped in favour of an earlier closed one
                   (the MATH / Minerva convention, and what the prompt templates ask for);
2. ``hash``        the first ``#### N`` line (the GSM8K and embedded-task format; the *first*,
                   like lm-eval's gsm8k strict-match, because a base model that keeps going
                   after its answer starts writing the next problem and its answer);
3. ``answer_is``   the text after the last "answer is" ("The final answer is $5$. I hope..." -> ``5``);
4. ``last_number`` the last number in the text (a lenient fallback for unformatted answers);

otherwise there is no answer (method ``none``), which scores 0.

Every function here is total on strings: hostile text (a 10**5-digit integer, 10**4 nested
braces, NUL bytes, any unicode) gives an answer or None, never an exception. Numbers longer than
``MAX_NUMBER_CHARS`` are not plain numbers, since ``int()`` of a long digit string raises
(``sys.get_int_max_str_digits()``: 4300 digits by default, 640 at the lowest setting).
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import NamedTuple

# Only the last few \boxed{ occurrences are tried, so a completion made of thousands of unclosed
# "\boxed{" costs a bounded number of linear scans.
_MAX_BOXED_TRIES = 8
# Below the lowest digit limit Python allows for int(str) (640), so the conversion cannot raise
# whatever the process sets; no benchmark answer is anywhere near this long.
MAX_NUMBER_CHARS = 600

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE = re.compile(r"[{}]")
_HASH = re.compile(r"####[ \t]*([^\n]*)")
_ANSWER_IS = re.compile(r"answer\s+is\s*:?[ \t]*([^\n]*)", re.IGNORECASE)
_SENTENCE_END = re.compile(r"\.(?:\s|$)")
# A plain number: optional sign, digits (optionally grouped by thousands with commas), optional decimals.
_NUMBER = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+"
_PLAIN_NUMBER = re.compile(_NUMBER)
_PLAIN_INT = re.compile(r"-?\d+")
_NUMBER_IN_TEXT = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")
# "#### 1,234 dollars" -> "1,234", but "#### 12/5" is not the number 12, nor "#### 1, -2" the number 1.
_LEADING_NUMBER = re.compile(r"(?:\\?\$)?\s*(" + _NUMBER + r")(?![\d!/^*_{(\\]|\.\d|,\s*[-+\d])")


class Extraction(NamedTuple):
    answer: str | None  # the answer text, stripped; None when nothing was found
    method: str  # boxed | hash | answer_is | last_number | none


def _closing_braces(text: str, starts: list[int]) -> dict[int, int]:
    """``{start: index of the }`` closing the group opened at ``text[start - 1]``}`` for the
    ``starts`` that close, in one pass over the braces from the first of them (a stack of open
    groups), so trying several starts costs one scan, not one each. Stops once the last start
    (the one preferred) is closed."""
    wanted, last = set(starts), starts[-1]
    found: dict[int, int] = {}
    stack: list[int] = []
    for m in _BRACE.finditer(text, starts[0] - 1):
        if m.group() == "{":
            stack.append(m.end())
        elif stack:  # a "}" with nothing open closes nothing
            start = stack.pop()
            if start in wanted:
                found[start] = m.start()
                if start == last:
                    break
    return found


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces, or None."""
    if "\\boxed" not in text and "\\fbox" not in text:
        return None
    starts = [m.end() for m in _BOXED.finditer(text)][-_MAX_BOXED_TRIES:]
    if not starts:
        return None
    ends = _closing_braces(text, starts)
    for start in reversed(starts):
        if start in ends:
            return text[start : ends[start]].strip()
    return None


def hash_answer(text: str) -> str | None:
    """The answer on the first ``#### ...`` line: its leading number if it starts with one
    (``#### 1,234 dollars`` -> ``1,234``), else the whole line; None when absent or empty."""
    if "####" not in text:
        return None
    m = _HASH.search(text)
    line = m.group(1).strip() if m else ""
    if not line:
        return None
    num = _LEADING_NUMBER.match(line)
    return num.group(1) if num else line


def answer_is(text: str) -> str | None:
    """The text after the last "answer is", up to the end of its sentence or line."""
    last = None
    for m in _ANSWER_IS.finditer(text):
        last = m
    if last is None:
        return None
    phrase = last.group(1)
    end = _SENTENCE_END.search(phrase)
    if end is not None:
        phrase = phrase[: end.start()]
    phrase = strip_math_delimiters(phrase.strip())
    return phrase or None


def last_number(text: str) -> str | None:
    """The last number in ``text`` (thousands commas kept), or None."""
    last = None
    for m in _NUMBER_IN_TEXT.finditer(text):
        last = m
    return last.group() if last is not None else None


def extract_answer(text: str) -> Extraction:
    """The final answer of a completion and how it was found (see the module docstring)."""
    for method, fn in _EXTRACTORS:
        answer = fn(text)
        if answer:
            return Extraction(answer, method)
    return Extraction(None, "none")


_EXTRACTORS = (("boxed", last_boxed), ("hash", hash_answer), ("answer_is", answer_is), ("last_number", last_number))


def strip_math_delimiters(s: str) -> str:
    """``$x$``, ``\\(x\\)``, ``\\[x\\]`` -> ``x``; a trailing period is dropped too."""
    s = s.strip()
    if s.endswith("."):
        s = s[:-1].rstrip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(s) >= len(left) + len(right) and s.startswith(left) and s.endswith(right):
            return s[len(left) : -len(right)].strip()
    return s


def plain_number(s: str) -> int | Fraction | None:
    """The exact value of a plain number (``42``, ``-3.5``, ``1,234``, ``$18``, ``$5$``, ``7.``),
    or None for anything else (fractions, units, LaTeX: those go to math-verify).

    This is the grader's fast path: no LaTeX is interpreted, only digits, sign, thousands
    commas, decimals, math-mode dollars and a currency sign are understood. Longer than
    ``MAX_NUMBER_CHARS``: None (math-verify, or the grader's length cap, decides)."""
    if len(s) > MAX_NUMBER_CHARS:
        return None
    if _PLAIN_INT.fullmatch(s):  # the common case, checked first for speed
        return int(s)
    s = strip_math_delimiters(s)
    if s.startswith("\\$"):
        s = s[2:].lstrip()
    elif s.startswith("$"):
        s = s[1:].lstrip()
    if not s or _PLAIN_NUMBER.fullmatch(s) is None:
        return None
    s = s.replace(",", "")
    if "." in s:
        return Fraction(s)
    return int(s)
