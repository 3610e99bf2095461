"""pass@k (Chen et al. 2021) and mean@n, pinned to hand-computed values and to the definition."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from eval.metrics import pass_at_k, summarize_samples


def test_hand_computed_values() -> None:
    # n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # n=5, c=2, k=3: 1 - C(3,3)/C(5,3) = 1 - 1/10 = 0.9
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9)
    # k=1 is the plain fraction correct; no correct sample gives 0; too few wrong ones give 1
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)
    assert pass_at_k(8, 0, 8) == 0.0
    assert pass_at_k(8, 7, 2) == 1.0


@given(st.integers(1, 12).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_matches_the_definition_by_enumeration(nck: tuple[int, int, int]) -> None:
    # pass@k = P(a k-subset of the n samples, drawn without replacement, holds a correct one)
    n, c, k = nck
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    brute = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
    assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_summarize_samples() -> None:
    # problem 1: 1 of 4 correct; problem 2: 4 of 4. mean@4 = (0.25 + 1) / 2; pass@2 = (0.5 + 1) / 2
    out = summarize_samples([[1, 0, 0, 0], [1, 1, 1, 1]], ks=(2, 4))
    assert out == pytest.approx({"mean@4": 0.625, "pass@2": 0.75, "pass@4": 1.0})


def test_invalid_arguments_raise() -> None:
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="pass@8"):
        summarize_samples([[1, 0]], ks=(8,))
    with pytest.raises(ValueError, match="same number"):
        summarize_samples([[1, 0], [1]], ks=())
