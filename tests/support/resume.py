"""Crash-and-resume harness for in-process training runs (``rl_train``, ``train_variant``).

A crash is an exception raised from the run's ``progress`` callback once a step has been
reported (its metrics logged, the checkpoints due up to it written); the run is then started
again on the same checkpoint folder and must end where an uninterrupted run ends. Runs killed
in another process (SIGKILL of a CLI run or a rank) are in :mod:`tests.support.cli_runs`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, TypeVar

import pytest
import torch

from tests.support.cli_runs import TIMING

T = TypeVar("T")


class Crash(Exception):
    """Raised from a run's progress callback: the stand-in for a crash after a step."""


def crash_after(step: int) -> Callable[[int, dict], None]:
    """A ``progress(step, metrics)`` callback that raises :class:`Crash` when ``step`` is reported."""

    def progress(s: int, metrics: dict) -> None:
        if s == step:
            raise Crash(f"crashed after step {step}")

    return progress


def run_interrupted_and_resumed(run: Callable[[str, Callable[[int, dict], None] | None], T], ckpt_dir: str | Path, kill_at: int) -> T:
    """``run(ckpt_dir, progress)`` crashed after step ``kill_at``, then run again on the same
    folder to the end; returns the second run's result (the caller checks its ``resumed_from``:
    the last checkpoint at or before ``kill_at``)."""
    with pytest.raises(Crash):
        run(str(ckpt_dir), crash_after(kill_at))
    return run(str(ckpt_dir), None)


def without_timing(history: list[dict], skip: tuple[str, ...] = TIMING) -> list[dict]:
    """Per-step metrics without the keys starting with ``skip`` (wall-clock figures by default)."""
    return [{k: v for k, v in m.items() if not k.startswith(skip)} for m in history]


def assert_same_final_state(a: Any, b: Any, skip: tuple[str, ...] = TIMING) -> None:
    """Two runs ended in the same state: the same per-step metrics (keys starting with ``skip``
    aside), the same held-out curve, and bitwise-equal weights where given. ``a`` and ``b`` are
    each a run's result (with ``history`` and ``eval_curve``) or a pair ``(result, state_dict)``."""
    (ra, wa), (rb, wb) = (x if isinstance(x, tuple) else (x, None) for x in (a, b))
    ha, hb = without_timing(ra.history, skip), without_timing(rb.history, skip)
    assert len(ha) == len(hb), f"{len(ha)} steps against {len(hb)}"
    for step, (ma, mb) in enumerate(zip(ha, hb, strict=True), start=1):
        assert ma == mb, (step, {k: (ma.get(k), mb.get(k)) for k in ma.keys() | mb.keys() if ma.get(k) != mb.get(k)})
    assert ra.eval_curve == rb.eval_curve
    assert (wa is None) == (wb is None), "weights given for one run only"
    if wa is not None:
        assert wa.keys() == wb.keys()
        differ = [k for k in wa if not torch.equal(wa[k], wb[k])]
        assert not differ, f"weights differ: {differ[:5]}"
