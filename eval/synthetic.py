"""Synthetic completions with a known right or wrong final answer, for grader checks and benches.

A grader is only trustworthy if, on every real gold, a natural completion that ends in the gold
scores 1 and the same completion ending in a clearly different answer scores 0. These helpers
build both without a model: ``natural_completion(answer)`` and ``wrong_answer(gold)``.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from a3po.grading.answers import plain_number

_FIRST_INT = re.compile(r"\d+")
_TEXT = re.compile(r"\\text\{([^{}]*)\}")

STYLES = ("boxed", "hash", "answer_is")


def natural_completion(answer: str, style: str = "boxed") -> str:
    """A short worked-solution-like completion whose final answer is ``answer``.

    ``boxed``: "... so the answer is \\boxed{A}."; ``hash``: GSM8K style "...\\n#### A";
    ``answer_is``: "... The final answer is $A$. I hope it is correct." (Minerva style)."""
    body = "Let me work through this step by step.\nFirst I collect what is given, then I combine the quantities.\n"
    if style == "boxed":
        return body + f"Putting it together, so the answer is \\boxed{{{answer}}}."
    if style == "hash":
        return body + f"Putting it together gives {answer}.\n#### {answer}"
    if style == "answer_is":
        return body + f"The final answer is ${answer}$. I hope it is correct."
    raise ValueError(f"unknown style {style!r}; valid: {', '.join(STYLES)}")


def wrong_answer(gold: str) -> str:
    """A clearly different answer: a plain number plus one; else the first integer in the LaTeX
    plus one (``\\frac{14}{3}`` -> ``\\frac{15}{3}``, ``90^\\circ`` -> ``91^\\circ``); else a
    ``\\text{...}`` answer negated (``\\text{not Evelyn}``); else the expression plus one."""
    gold = str(gold).strip()
    if plain_number(gold) is not None:
        try:
            value = Decimal(gold.replace(",", "").lstrip("\\$").strip("$")) + 1
        except InvalidOperation:
            value = None
        if value is not None:
            return str(value)
    m = _FIRST_INT.search(gold)
    if m is not None:
        return gold[: m.start()] + str(int(m.group()) + 1) + gold[m.end() :]
    if _TEXT.search(gold):
        return _TEXT.sub(lambda t: f"\\text{{not {t.group(1)}}}", gold, count=1)
    return f"{gold} + 1"
