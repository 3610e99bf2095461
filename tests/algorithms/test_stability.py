"""Step stability statistics (``a3po.algorithms.stability``) against hand-derived numbers.

Quantile rule (type 7): for sorted ``x_(0..n-1)`` and level q, ``p = q (n - 1)``,
``Q = x_(floor p) + frac(p) (x_(floor p + 1) - x_(floor p))``.

The step below has two minibatches of unequal size, so step statistics differ from the mean of
the per-minibatch ones (what the trainer used to log):

    minibatch 1 (5 tokens): w = [1, 1, 1, 1, 9], r = [1, 1, 1, 1.5, 1], A = +1 (r = 1.5 > 1.2: clipped)
    minibatch 2 (2 tokens): w = [1, 1],          r = [0.5, 1],          A = -1 (r = 0.5 < 0.8: clipped)

    step w sorted  [1, 1, 1, 1, 1, 1, 9]: p = 0.99 * 6 = 5.94 -> 1 + 0.94 * 8 = 8.52
    minibatch p99s: 1: p = 0.99 * 4 = 3.96 -> 1 + 0.96 * 8 = 8.68;  2: 1.  Their mean: 4.84
    step r sorted  [0.5, 1, 1, 1, 1, 1, 1.5]: p = 5.94 -> 1 + 0.94 * 0.5 = 1.47
    clipped: 2 of 7 tokens (minibatch fractions 1/5 and 1/2, mean 0.35)
    capped (cap 5): the w = 9 token, 1 of 7 (minibatch fractions 1/5 and 0, mean 0.1)
    approx_kl: w ((r - 1) - ln r) is 0 where r = 1; (0.5 - ln 1.5) + (-0.5 + ln 2) = ln(4/3), over 7 tokens
"""

from __future__ import annotations

import math

import pytest
import torch

from a3po.algorithms.losses import decoupled_ppo_loss
from a3po.algorithms.stability import TokenStats, quantile, stability_metrics
from a3po.training.step import combine_minibatch_metrics

pytestmark = pytest.mark.usefixtures("core_one_thread")

D = torch.float64


def _minibatch(r, w, adv, cap=5.0):
    prox = torch.full((1, len(r)), -1.0, dtype=D)
    logp = prox + torch.log(torch.tensor([r], dtype=D))
    behav = prox - torch.log(torch.tensor([w], dtype=D))
    mask = torch.ones(1, len(r), dtype=torch.bool)
    return decoupled_ppo_loss(logp, prox, behav, torch.tensor([adv], dtype=D), mask, eps_clip=0.2, behav_weight_cap=cap, return_tokens=True)


def _two_minibatches():
    return [
        _minibatch(r=[1, 1, 1, 1.5, 1], w=[1, 1, 1, 1, 9], adv=[1.0] * 5),
        _minibatch(r=[0.5, 1], w=[1, 1], adv=[-1.0, -1.0]),
    ]


def test_quantile_is_linear_interpolation_between_order_statistics():
    assert quantile(torch.tensor([1.0, 1, 1, 1, 9]), 0.99) == pytest.approx(8.68)
    assert quantile(torch.tensor([9.0, 1, 1, 1, 1, 1, 1]), 0.99) == pytest.approx(8.52)  # order of input irrelevant
    assert quantile(torch.tensor([3.0, 1.0]), 0.5) == pytest.approx(2.0)
    assert quantile(torch.tensor([4.0]), 0.99) == 4.0
    assert quantile(torch.tensor([]), 0.99) == 0.0
    with pytest.raises(ValueError, match="quantile level"):
        quantile(torch.tensor([1.0]), 1.5)


def test_each_minibatch_reports_its_own_tokens():
    (_, m1, _), (_, m2, _) = _two_minibatches()
    assert m1["stability/behav_iw_p99"] == pytest.approx(8.68)
    assert m2["stability/behav_iw_p99"] == pytest.approx(1.0)
    assert m1["stability/trust_ratio_clipped_frac"] == pytest.approx(1 / 5)
    assert m2["stability/trust_ratio_clipped_frac"] == pytest.approx(1 / 2)


def test_step_statistics_are_over_all_the_steps_tokens_not_means_of_minibatch_figures():
    parts = _two_minibatches()
    m = combine_minibatch_metrics([p[1] for p in parts], [p[2] for p in parts])
    assert m["stability/behav_iw_p99"] == pytest.approx(8.52)  # not (8.68 + 1) / 2 = 4.84
    assert m["stability/behav_iw_mean"] == pytest.approx(15 / 7)  # not (13/5 + 1) / 2 = 1.8
    assert m["stability/behav_iw_max"] == pytest.approx(9.0)
    assert m["stability/behav_iw_capped_frac"] == pytest.approx(1 / 7)  # not 0.1
    assert m["stability/trust_ratio_p99"] == pytest.approx(1.47)
    assert m["stability/trust_ratio_mean"] == pytest.approx(1.0)
    assert m["stability/trust_ratio_max"] == pytest.approx(1.5)
    assert m["stability/trust_ratio_clipped_frac"] == pytest.approx(2 / 7)  # not 0.35
    assert m["policy/approx_kl"] == pytest.approx(math.log(4 / 3) / 7)
    # Non-stability metrics stay the mean over minibatches.
    assert m["loss/policy"] == pytest.approx((parts[0][1]["loss/policy"] + parts[1][1]["loss/policy"]) / 2)


def test_approx_kl_is_kl_prox_theta_on_behaviour_samples():
    # One context, vocabulary {a, b}: pi_behav = (1/2, 1/2), pi_prox = (0.8, 0.2), pi_theta = (0.6, 0.4).
    # Sampling a and b once each is the exact expectation under pi_behav. The importance-weighted
    # k3 mean equals KL(prox || theta) = 0.8 ln(0.8/0.6) + 0.2 ln(0.2/0.4) = 0.0915...;
    # plain k3 on these samples would give 0.5 (0.75 - 1 - ln 0.75) + 0.5 (2 - 1 - ln 2) = 0.172...
    behav = torch.log(torch.tensor([[0.5, 0.5]], dtype=D))
    prox = torch.log(torch.tensor([[0.8, 0.2]], dtype=D))
    theta = torch.log(torch.tensor([[0.6, 0.4]], dtype=D))
    _, m = decoupled_ppo_loss(theta, prox, behav, torch.zeros(1, 2, dtype=D), torch.ones(1, 2, dtype=torch.bool))
    kl = 0.8 * math.log(0.8 / 0.6) + 0.2 * math.log(0.2 / 0.4)
    assert m["policy/approx_kl"] == pytest.approx(kl, rel=1e-12)
    assert kl == pytest.approx(0.0915, abs=1e-4)


def test_empty_step_and_concatenation_errors():
    empty = TokenStats(*(torch.zeros(0) for _ in range(2)), torch.zeros(0, dtype=torch.bool), torch.zeros(0, dtype=torch.bool), torch.zeros(0))
    assert set(stability_metrics(empty).values()) == {0.0}
    with pytest.raises(ValueError, match="no token statistics"):
        TokenStats.cat([])
