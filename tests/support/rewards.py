"""A stand-in for the grader behind RL rewards and held-out accuracy.

On a random micro model the real grader scores every sample 0, so the loss and its gradient are
identically 0 and a determinism or resume test would prove nothing. The stand-in scores the
fraction of a completion's characters that are digits: deterministic, in [0, 1], and varied.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import pytest


def digit_reward(task: str, completions: list[str], golds: list[str], ids: list[str] | None = None) -> list[float]:
    """Fraction of each completion's characters that are digits."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def stub_rewards(mp: pytest.MonkeyPatch) -> list[str]:
    """Make every ``a3po`` module that looks up ``score_completions`` (the one function through
    which the loop grades rewards and held-out accuracy) see :func:`digit_reward`, until ``mp``
    is undone. The patch goes where the name is looked up: each module that imported it by name.
    Every module of the training package is imported first: one that imported the name while the
    stub is in place would keep the stub after the undo. Returns the patched modules' names."""
    import a3po.grading.rewards
    import a3po.training

    for info in pkgutil.iter_modules(a3po.training.__path__, "a3po.training."):
        importlib.import_module(info.name)

    real = a3po.grading.rewards.score_completions
    patched = sorted(name for name, mod in list(sys.modules.items()) if name.startswith("a3po.") and getattr(mod, "score_completions", None) is real)
    # The loop's rewards and held-out accuracy: if these moved, the stub would silently grade for real.
    assert any(name.startswith("a3po.training.") for name in patched), f"no training module looks up score_completions: {patched}"
    for name in patched:
        mp.setattr(sys.modules[name], "score_completions", digit_reward)
    return patched
