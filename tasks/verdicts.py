"""The one rule every verdict of the pipeline follows: it needs something to judge.

Python's ``all([])`` is True, so a parity night over no reference, a claim over no seed or a
comparison over no arm would "pass" on nothing, and enter the trend of earlier nights as a pass.
Every pass/fail decision (``tasks.parity``, ``tasks.claims``, ``flows.nightly_parity``) goes
through :func:`all_pass`, which refuses an empty judgement instead.
"""

from __future__ import annotations

from typing import Iterable


class NothingToJudge(ValueError):
    """A verdict over zero items; the message says what was missing."""


def all_pass(passes: Iterable[bool], what: str) -> bool:
    """True iff every item of ``passes`` is True; :class:`NothingToJudge` naming ``what`` (e.g.
    "parity results") when there is none."""
    passes = list(passes)
    if not passes:
        raise NothingToJudge(f"no {what} to judge: a verdict needs at least one")
    return all(passes)
