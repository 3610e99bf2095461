"""The embedded task: disjoint splits, correct golds, and the careless teacher's slips."""

from __future__ import annotations

import re

import pytest

from a3po.config import DataConfig
from a3po.data.arithmetic import ArithmeticDifficulty, generate_split

LINE = re.compile(r"^(\d+) ([+*-]) (\d+) = (\d+)\n#### (\d+)$")


def _true_result(a: str, op: str, b: str) -> int:
    return {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]


def test_splits_are_disjoint_deterministic_and_golds_are_right():
    train, held = generate_split(2000, "train", 7), generate_split(300, "heldout", 7)
    assert {r["prompt"] for r in train}.isdisjoint({r["prompt"] for r in held})
    assert train == generate_split(2000, "train", 7)
    for r in train + held:
        a, op, b, _, _ = LINE.match(r["solution"]).groups()
        assert int(r["gold"]) == _true_result(a, op, b) >= 0


def test_teacher_slips_are_near_misses_on_train_only():
    diff = ArithmeticDifficulty(slip_rate=0.4)
    train = generate_split(2000, "train", 3, diff)
    slipped = 0
    for r in train:
        a, op, b, c, final = LINE.match(r["solution"]).groups()
        assert c == final  # the worked line and the #### line agree, right or wrong
        off = int(c) - int(r["gold"])
        assert off in (0, -2, -1, 1, 2) and int(c) >= 0
        assert int(r["gold"]) == _true_result(a, op, b)  # the gold is never slipped
        slipped += off != 0
    assert 0.35 < slipped / len(train) < 0.45
    for r in generate_split(300, "heldout", 3, diff):
        assert r["solution"].endswith(f"#### {r['gold']}")


def test_slip_rate_does_not_change_the_problems():
    clean = generate_split(500, "train", 5, ArithmeticDifficulty(slip_rate=0.0))
    noisy = generate_split(500, "train", 5, ArithmeticDifficulty(slip_rate=0.65))
    assert [(r["prompt"], r["gold"]) for r in clean] == [(r["prompt"], r["gold"]) for r in noisy]
    assert all(r["solution"].endswith(f"#### {r['gold']}") for r in clean)


@pytest.mark.parametrize("rate", [-0.1, 1.0])
def test_invalid_slip_rate_is_rejected(rate):
    with pytest.raises(ValueError, match="teacher_slip_rate"):
        DataConfig(teacher_slip_rate=rate)
