"""Benchmark metrics over per-problem correctness: greedy pass@1, mean@n and unbiased pass@k.

pass@k is the probability that at least one of k samples drawn without replacement from the
n generated for a problem is correct, averaged over problems. With c correct out of n
(Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1)::

    pass@k = E_problems[ 1 - C(n - c, k) / C(n, k) ]

computed as the product 1 - prod_{i = n-c+1}^{n} (1 - k / i), which never forms the huge
binomials. mean@n is the mean score of all n samples (the expected pass@1 under sampling).
"""

from __future__ import annotations

from typing import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``c`` correct among ``n`` samples (1 <= k <= n)."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def summarize_samples(scores: Sequence[Sequence[float]], ks: Sequence[int]) -> dict[str, float]:
    """``mean@n`` and ``pass@k`` for each k in ``ks`` (k <= n) from per-problem sample scores
    (``scores[p][j]`` in [0, 1], n samples for every problem; a sample is correct when 1)."""
    if not scores:
        return {}
    n = len(scores[0])
    if n == 0 or any(len(s) != n for s in scores):
        raise ValueError("every problem needs the same number n >= 1 of samples")
    out = {f"mean@{n}": mean([mean(s) for s in scores])}
    for k in ks:
        if k > n:
            raise ValueError(f"pass@{k} needs at least {k} samples per problem, got n={n}")
        out[f"pass@{k}"] = mean([pass_at_k(n, sum(1 for x in s if x >= 1.0), k) for s in scores])
    return out
