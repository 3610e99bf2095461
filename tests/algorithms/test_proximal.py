"""A-3PO's loglinear proximal log-probs: bounds, edge cases, gradient isolation, and the pin to
standard PPO when every token is on-policy (d = 0).

``log pi_prox = a * log pi_behav + (1 - a) * log pi_theta`` with ``a = 1/d`` (``d >= 1``), ``a = 0``
(``d <= 0``); see ``a3po/algorithms/proximal.py``. The pure function is tested here; what the trainer
actually uses is the registered method, which anchors on ``behav`` at ``d = 0`` (tested below at
method level and in ``training/test_step.py`` through ``train_step`` against hand-derived numbers).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from a3po.algorithms.checks import NonFiniteError
from a3po.algorithms.losses import decoupled_ppo_loss, ppo_clip_loss
from a3po.algorithms.proximal import PROXIMAL_METHODS, ProxInputs, loglinear_alpha, loglinear_prox_logp

pytestmark = pytest.mark.usefixtures("core_one_thread")

F32_EPS = torch.finfo(torch.float32).eps  # 2**-23 ~ 1.19e-7

# Log-probs of real tokens: in [-30, 0] (a probability down to ~1e-13 still occurs in the tail).
logps = st.floats(min_value=-30.0, max_value=0.0, allow_nan=False, allow_infinity=False, width=32)
staleness_values = st.integers(min_value=-3, max_value=12)


@st.composite
def prox_inputs(draw):
    n = draw(st.integers(min_value=1, max_value=24))
    behav = torch.tensor(draw(st.lists(logps, min_size=n, max_size=n)), dtype=torch.float32)
    theta = torch.tensor(draw(st.lists(logps, min_size=n, max_size=n)), dtype=torch.float32)
    d = torch.tensor(draw(st.lists(staleness_values, min_size=n, max_size=n)), dtype=torch.long)
    return behav, theta, d


@settings(max_examples=300, deadline=None)
@given(prox_inputs())
def test_prox_lies_between_behaviour_and_target_per_token(inp):
    behav, theta, d = inp
    prox = loglinear_prox_logp(behav, theta, d)
    lo, hi = torch.minimum(behav, theta), torch.maximum(behav, theta)
    # a*b + (1-a)*t in fp32: two products and a sum, each rounded to half an ulp of a value of
    # magnitude <= 30, so the result may leave [lo, hi] by at most ~3 ulps of 30 = 30 * 3 * 2**-23 ~ 1.1e-5.
    tol = 3 * F32_EPS * torch.maximum(behav.abs(), theta.abs()).clamp(min=1.0)
    assert bool((prox >= lo - tol).all()), (prox, lo)
    assert bool((prox <= hi + tol).all()), (prox, hi)


@settings(max_examples=300, deadline=None)
@given(prox_inputs())
def test_prox_is_one_dth_of_the_way_from_target_to_behaviour(inp):
    # The defining property, not the formula restated: for d >= 1 the anchor sits 1/d of the way
    # from theta to behav, i.e. d * (prox - theta) = behav - theta; for d <= 0 it is theta itself.
    behav, theta, d = inp
    prox = loglinear_prox_logp(behav, theta, d).double()
    b, t = behav.double(), theta.double()
    stale = d >= 1
    assert torch.equal(prox[~stale], t[~stale])  # 0 * b + 1 * t is exact in fp32
    # prox carries fp32 rounding of ~3 ulps of max(|b|, |t|) (<= 30); multiplied by d <= 12 below.
    tol = 3 * F32_EPS * torch.maximum(b.abs(), t.abs()).clamp(min=1.0) * d.double()
    lhs = d.double() * (prox - t)
    assert bool(((lhs - (b - t)).abs() <= tol)[stale].all())


def test_alpha_per_staleness():
    # a = 0 for d <= 0 (prompt/pad tokens carry d < 0), else 1/d. Literals, and for d = 3, 7 the
    # nearest fp32 to the exact fraction (what 1.0 / d in fp32 must round to).
    d = torch.tensor([-5, -1, 0, 1, 2, 3, 4, 7, 10])
    expected = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.5, 0.3333333432674408, 0.25, 0.1428571492433548, 0.1])
    assert torch.equal(loglinear_alpha(d), expected)
    assert loglinear_alpha(d).dtype == torch.float32


def test_edge_cases_d0_d1_d4_and_negative():
    behav = torch.tensor([-2.0, -2.0, -2.0, -2.0, -2.0])
    theta = torch.tensor([-1.0, -1.0, -1.0, -1.0, -1.0])
    d = torch.tensor([0, 1, 4, -1, -7])
    prox = loglinear_prox_logp(behav, theta, d)
    # d = 0: a = 0 -> theta = -1.0 exactly (0 * b + 1 * t).
    # d = 1: a = 1 -> behav = -2.0 exactly.
    # d = 4: a = 1/4 -> 1/4 * (-2) + 3/4 * (-1) = -0.5 - 0.75 = -1.25 (exact in binary).
    # d < 0 (prompt / pad tokens): treated as d = 0 -> theta.
    assert prox.tolist() == [-1.0, -2.0, -1.25, -1.0, -1.0]


def test_d0_equals_detached_theta_bitwise_for_any_values():
    g = torch.Generator().manual_seed(0)
    behav = -torch.rand(4, 9, generator=g) * 10
    theta = (-torch.rand(4, 9, generator=g) * 10).requires_grad_()
    prox = loglinear_prox_logp(behav, theta, torch.zeros(4, 9, dtype=torch.long))
    assert torch.equal(prox, theta.detach())
    assert not prox.requires_grad


def test_theta_carries_no_gradient_through_prox():
    behav = torch.tensor([-1.0, -2.0, -3.0], requires_grad=True)
    theta = torch.tensor([-0.5, -0.5, -0.5], requires_grad=True)
    prox = loglinear_prox_logp(behav, theta, torch.tensor([1, 2, 4]))
    (g_theta,) = torch.autograd.grad(prox.sum(), theta, allow_unused=True, retain_graph=True)
    assert g_theta is None  # the anchor is detached from theta
    (g_behav,) = torch.autograd.grad(prox.sum(), behav)
    assert g_behav.tolist() == [1.0, 0.5, 0.25]  # = a = 1/d: behav itself is a constant in training


def test_float_staleness_raises_type_error():
    x = torch.zeros(3)
    with pytest.raises(TypeError, match="integer"):
        loglinear_prox_logp(x, x, torch.tensor([0.0, 1.0, 2.0]))


def test_shape_mismatch_raises_naming_the_shapes():
    with pytest.raises(ValueError, match="shape mismatch"):
        loglinear_prox_logp(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="staleness"):
        loglinear_prox_logp(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3, dtype=torch.long))


def test_non_finite_inputs_raise_naming_the_tensor():
    ok = torch.zeros(3)
    d = torch.ones(3, dtype=torch.long)
    with pytest.raises(NonFiniteError, match="^behav_logp"):
        loglinear_prox_logp(torch.tensor([0.0, math.nan, 0.0]), ok, d)
    with pytest.raises(NonFiniteError, match="^theta_logp"):
        loglinear_prox_logp(ok, torch.tensor([0.0, 0.0, -math.inf]), d)


def _inputs(behav, theta, d, mask, recompute=None):
    def never():
        raise AssertionError("loglinear must not run the model")

    return ProxInputs(behav_logp=behav, theta_logp=theta, staleness=d, mask=mask, recompute_logp=recompute or never)


def test_registered_loglinear_never_calls_recompute_and_matches_the_formula_on_the_mask():
    method = PROXIMAL_METHODS.get("loglinear")
    assert method.needs_forward is False
    assert PROXIMAL_METHODS.get("recompute").needs_forward is True
    behav = torch.tensor([[0.0, 0.0, -2.0, -2.0, -2.0]])
    theta = torch.tensor([[-3.0, -0.7, -1.0, -1.0, -1.0]])
    d = torch.tensor([[-1, -1, 0, 2, 4]])  # two prompt tokens, then d = 0, 2, 4
    mask = torch.tensor([[False, False, True, True, True]])
    prox, metrics = method(_inputs(behav, theta, d, mask))
    # On the mask: d=0 -> behav = -2 (the step-start policy of an on-policy token is its
    # behaviour policy; see _loglinear_on_mask); d=2 -> (-2 - 1)/2 = -1.5; d=4 -> -1.25.
    # Outside it the value is unused by the loss (the method returns 0 there).
    assert prox[mask].tolist() == [-2.0, -1.5, -1.25]
    assert metrics == {}


def test_metrics_method_trains_on_the_recomputed_logp_and_reports_the_loglinear_error_by_hand():
    method = PROXIMAL_METHODS.get("metrics")
    assert method.needs_forward is True and method.checks_behaviour is True
    #  token  d   behav  theta  loglinear prox                 exact (recomputed)   diff = approx - exact   |exp(diff) - 1|
    #  0      -   0      0      (prompt, not on the mask)       9.0                  ignored                 ignored
    #  1      1   -1     -3     a = 1: behav = -1              -1 - ln 2             +ln 2 = 0.693147        |2 - 1| = 1
    #  2      2   -1     -3     a = 1/2: (-1 - 3)/2 = -2       -2 + ln 2             -ln 2                   |1/2 - 1| = 0.5
    #  3      0   -0.5   -4     d = 0 anchors on behav: -0.5   -0.5                  0                       0
    # approx_abs_err = (ln 2 + ln 2 + 0) / 3 = 0.462098; approx_iw_err = (1 + 0.5 + 0) / 3 = 0.5
    # (the sign of the log error matters for the weight error: +ln 2 and -ln 2 give 1 and 0.5).
    ln2 = math.log(2.0)
    exact = torch.tensor([[9.0, -1.0 - ln2, -2.0 + ln2, -0.5]])
    behav = torch.tensor([[0.0, -1.0, -1.0, -0.5]])
    theta = torch.tensor([[0.0, -3.0, -3.0, -4.0]])
    d = torch.tensor([[-1, 1, 2, 0]])
    mask = torch.tensor([[False, True, True, True]])
    prox, metrics = method(_inputs(behav, theta, d, mask, recompute=lambda: exact))
    assert torch.equal(prox, exact)  # it trains with the exact proximal log-probs
    assert metrics == pytest.approx({"prox/approx_abs_err": 2 * ln2 / 3, "prox/approx_iw_err": 0.5}, abs=1e-6)
    # No generated token: nothing to compare, both errors are 0.
    _, none = method(_inputs(behav, theta, d, torch.zeros_like(mask), recompute=lambda: exact))
    assert none == {"prox/approx_abs_err": 0.0, "prox/approx_iw_err": 0.0}


def test_registered_loglinear_ignores_non_finite_values_outside_the_mask():
    # A prompt or pad token's log-prob may be -inf (outside a top-p nucleus) or garbage: the
    # loss ignores it, so the proximal method must too, instead of refusing the batch.
    method = PROXIMAL_METHODS.get("loglinear")
    mask = torch.tensor([[False, True, True, False]])
    behav = torch.tensor([[math.nan, -1.0, -2.0, math.inf]])
    theta = torch.tensor([[-math.inf, -3.0, -1.0, math.nan]])
    d = torch.tensor([[-1, 1, 2, -1]])
    prox, _ = method(_inputs(behav, theta, d, mask))
    assert prox[mask].tolist() == [-1.0, -1.5]  # d=1 -> behav; d=2 -> (-2 + -1)/2
    assert bool(torch.isfinite(prox).all())
    # ...but a non-finite value ON the mask still raises, naming the tensor.
    theta_bad = theta.clone()
    theta_bad[0, 2] = math.nan
    with pytest.raises(NonFiniteError, match="theta_logp"):
        method(_inputs(behav, theta_bad, d, mask))


# --- pin: loglinear with every d = 0 is standard PPO when on-policy ------------------------


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=0, max_value=10_000), st.sampled_from([None, 0.28]))
def test_loglinear_d0_decoupled_equals_ppo_clip_on_policy(seed, eps_high):
    # On-policy first minibatch: the weights being optimised are the ones that sampled the
    # batch, so theta == behav. Then loglinear with d = 0 gives prox = theta = behav, r = 1 and
    # w = 1 in both losses, which run the very same float operations: equality is bitwise.
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(3, 7, generator=g, dtype=torch.float64) * 5).requires_grad_()
    behav = logp.detach().clone()
    adv = torch.randn(3, 7, generator=g, dtype=torch.float64)
    mask = torch.rand(3, 7, generator=g) < 0.7
    mask[0, 0] = True
    d = torch.where(mask, torch.zeros(3, 7, dtype=torch.long), torch.full((3, 7), -1))
    prox = loglinear_prox_logp(behav, logp.detach(), d)
    assert torch.equal(prox, logp.detach())
    # What the trainer uses at d = 0 is the registered method, which anchors on behav (the
    # step-start policy); here behav == theta, so both anchors give the same loss.
    prox_trainer, _ = PROXIMAL_METHODS.get("loglinear")(_inputs(behav, logp.detach(), d, mask))
    assert torch.equal(prox_trainer[mask], behav[mask])

    l_ppo, m_ppo = ppo_clip_loss(logp, behav, adv, mask, 0.2, eps_high)
    (g_ppo,) = torch.autograd.grad(l_ppo, logp)
    for anchor in (prox, prox_trainer):
        l_dec, m_dec = decoupled_ppo_loss(logp, anchor, behav, adv, mask, 0.2, eps_high, None)
        (g_dec,) = torch.autograd.grad(l_dec, logp)
        assert l_dec.item() == l_ppo.item()
        assert torch.equal(g_dec, g_ppo)
        assert m_dec["stability/trust_ratio_clipped_frac"] == m_ppo["stability/trust_ratio_clipped_frac"] == 0.0


def test_loglinear_d0_equals_ppo_within_rollout_noise():
    # In practice behav comes from the incremental (KV-cache) decode and theta from a full
    # forward: they agree to ~1e-6 in fp32, not bitwise. Then r = exp(theta - prox) = 1 while
    # PPO's r = exp(theta - behav) = 1 + O(1e-6), and loglinear's w = exp(prox - behav) carries
    # the same factor: value and gradient agree to O(1e-6) relative. Tolerance 1e-5.
    g = torch.Generator().manual_seed(1)
    logp = (-torch.rand(4, 10, generator=g) * 5).requires_grad_()
    behav = logp.detach() + 1e-6 * torch.randn(4, 10, generator=g)
    adv = torch.randn(4, 10, generator=g)
    mask = torch.ones(4, 10, dtype=torch.bool)
    prox = loglinear_prox_logp(behav, logp.detach(), torch.zeros(4, 10, dtype=torch.long))
    l_dec, _ = decoupled_ppo_loss(logp, prox, behav, adv, mask)
    (g_dec,) = torch.autograd.grad(l_dec, logp)
    l_ppo, _ = ppo_clip_loss(logp, behav, adv, mask)
    (g_ppo,) = torch.autograd.grad(l_ppo, logp)
    torch.testing.assert_close(l_dec, l_ppo, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g_dec, g_ppo, rtol=1e-5, atol=1e-8)
