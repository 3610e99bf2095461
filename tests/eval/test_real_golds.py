"""Every real gold is gradable: a natural completion ending in it scores 1, a wrong one scores 0.

Over the full GSM8K test (1319), MATH500 (500) and AIME24 (30) files when the optional ``../shared/data`` is
present (marker ``data``), and always over the shipped fixtures. The completion is
"... so the answer is \\boxed{GOLD}." with GOLD written as in the file (GSM8K keeps its
thousands commas); the wrong one replaces GOLD by ``eval.synthetic.wrong_answer(GOLD)``
(a number plus one, the first integer in the LaTeX plus one, ``\\text{not ...}``, or ``+ 1``).
The counts are printed (``pytest -s``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from a3po.grading import grade
from eval.data import BENCHMARKS, fixture_path, load_benchmark
from eval.synthetic import STYLES, natural_completion, wrong_answer

EXPECTED_SIZES = {"gsm8k": 1319, "math500": 500, "aime24": 30}


def _as_written(bench: str, rec) -> str:
    """The gold as the file writes it: GSM8K's ``#### 1,234`` keeps its comma."""
    if bench == "gsm8k":
        return str(rec.metadata["answer"]).rpartition("####")[2].strip()
    return rec.gold


def check_all(bench: str, source: Path, style: str = "boxed") -> tuple[int, int, int, list]:
    """(items, correct completions scored 1, wrong completions scored 0, failures)."""
    task = BENCHMARKS.get(bench).task
    records = load_benchmark(bench, source)
    right = wrong = 0
    failures = []
    for rec in records:
        gold = _as_written(bench, rec)
        g1 = grade(task, natural_completion(gold, style), rec.gold)
        g0 = grade(task, natural_completion(wrong_answer(gold), style), rec.gold)
        right += g1.score == 1.0
        wrong += g0.score == 0.0
        if g1.score != 1.0 or g0.score != 0.0:
            failures.append((rec.id, rec.gold, wrong_answer(gold), g1, g0))
    return len(records), right, wrong, failures


@pytest.mark.parametrize("bench", sorted(EXPECTED_SIZES))
@pytest.mark.parametrize("style", STYLES)
def test_fixture_golds(bench: str, style: str) -> None:
    n, right, wrong, failures = check_all(bench, fixture_path(bench), style)
    assert failures == [] and right == wrong == n


@pytest.mark.data
@pytest.mark.parametrize("bench", sorted(EXPECTED_SIZES))
def test_real_golds(bench: str, shared_data: Path) -> None:
    n, right, wrong, failures = check_all(bench, shared_data)
    print(f"\n{bench}: {n} items, correct completion -> 1.0: {right}/{n}, wrong completion -> 0.0: {wrong}/{n}")
    for f in failures:
        print("  failure:", f)
    assert n == EXPECTED_SIZES[bench]
    assert failures == [], f"{len(failures)} of {n} {bench} golds mis-graded"
