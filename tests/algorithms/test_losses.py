"""Decoupled PPO loss and GRPO advantages against hand-derived numbers.

Loss per token (``a3po/algorithms/losses.py``): ``l_t = w_t * max(-A_t r_t, -A_t clip(r_t, 1-eps, 1+eps_high))``
with ``r_t = exp(logp_t - prox_t)`` and ``w_t = exp(prox_t - behav_t)``; tokens with
``w_t > cap`` are dropped; ``L = sum_t keep_t l_t / N`` with ``N = mask.sum()`` (dropped tokens
still count), or ``N = n_tokens`` when given (a data-parallel rank passes the whole minibatch's
count). Hence ``dL/dlogp_t = -(w_t A_t r_t) / N`` where the unclipped branch is active and
``0`` where the clipped one is (or the token is dropped or masked).

Most tests run in float64 so hand-computed numbers can be compared to ~1e-12.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from a3po.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs, grpo_advantages, mean_centered_advantages
from a3po.algorithms.checks import NonFiniteError
from a3po.algorithms.losses import decoupled_ppo_loss

pytestmark = pytest.mark.usefixtures("core_one_thread")

D = torch.float64


def _tensors(r, adv, w, mask):
    """logp/prox/behav realising the given ratios r = pi_theta/pi_prox and weights w = pi_prox/pi_behav."""
    prox = torch.full((1, len(r)), -1.0, dtype=D)
    logp = (prox + torch.log(torch.tensor([r], dtype=D))).requires_grad_()
    behav = prox - torch.log(torch.tensor([w], dtype=D))
    return logp, prox, behav, torch.tensor([adv], dtype=D), torch.tensor([mask])


def _loss_and_grad(logp, prox, behav, adv, mask, **kw):
    loss, metrics = decoupled_ppo_loss(logp, prox, behav, adv, mask, **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.item(), grad.tolist() if grad.shape[0] > 1 else grad[0].tolist(), metrics


def test_hand_computed_value_and_gradient_with_clipping_cap_and_mask():
    #  t   r     A    w    mask  branch (eps = 0.2)                       l_t = w*max(...)      N*dL/dlogp = -w*A*r
    #  0   1.1  +1   1.0   yes   inside [0.8, 1.2]: unclipped              1*(-1.1)  = -1.10    -1.10
    #  1   1.5  +1   2.0   yes   A>0, r>1.2: clipped                       2*(-1.2)  = -2.40     0
    #  2   0.5  -1   0.5   yes   A<0, r<0.8: clipped                       0.5*(0.8) =  0.40     0
    #  3   1.5  -1   1.5   yes   A<0, r>1.2: unclipped (pessimistic)       1.5*(1.5) =  2.25    +2.25
    #  4   0.5  +1   1.0   yes   A>0, r<0.8: unclipped (pessimistic)       1*(-0.5)  = -0.50    -0.50
    #  5   1.0  +1   6.0   yes   w > cap 5: dropped (still counted in N)   0                     0
    #  6   1.3  +2   1.0   no    masked out                                 0                     0
    # N = 6 (tokens 0..5); L = (-1.1 - 2.4 + 0.4 + 2.25 - 0.5) / 6 = -1.35 / 6 = -0.225.
    t = _tensors(
        r=[1.1, 1.5, 0.5, 1.5, 0.5, 1.0, 1.3],
        adv=[1.0, 1.0, -1.0, -1.0, 1.0, 1.0, 2.0],
        w=[1.0, 2.0, 0.5, 1.5, 1.0, 6.0, 1.0],
        mask=[True, True, True, True, True, True, False],
    )
    loss, grad, metrics = _loss_and_grad(*t, eps_clip=0.2, behav_weight_cap=5.0)
    assert loss == pytest.approx(-0.225, abs=1e-12)
    expected = [-1.1 / 6, 0.0, 0.0, 2.25 / 6, -0.5 / 6, 0.0, 0.0]
    assert grad == pytest.approx(expected, abs=1e-12)
    assert metrics["stability/trust_ratio_clipped_frac"] == pytest.approx(2 / 6)  # tokens 1 and 2
    assert metrics["stability/behav_iw_capped_frac"] == pytest.approx(1 / 6)  # token 5
    assert metrics["loss/policy"] == pytest.approx(-0.225, abs=1e-12)


def test_data_parallel_halves_with_the_whole_token_count_add_up_to_the_whole_minibatch():
    # A minibatch of two rows split over two data-parallel ranks, one row each; each rank passes
    # the all-reduced token count N = 4 as n_tokens. eps = 0.2, advantages one per row.
    #  row t   r    A    w    mask  branch                               l_t = w*max(...)       N*dL/dlogp = -w*A*r
    #  0   0  1.1  +1   1.0   yes   inside [0.8, 1.2]: unclipped          -1.10                  -1.10
    #  0   1  0.9  +1   1.0   yes   inside: unclipped                     -0.90                  -0.90
    #  0   2  1.0  +1   1.0   yes   inside: unclipped                     -1.00                  -1.00
    #  1   0  1.5  -1   0.5   yes   A<0, r>1.2: unclipped (pessimistic)   0.5*1.5 = 0.75         +0.75
    #  1   1,2                no    right padding                         0                       0
    # Whole minibatch: L = (-3.0 + 0.75) / 4 = -0.5625. Rank 0: -3.0 / 4 = -0.75; rank 1: 0.75 / 4 = 0.1875;
    # -0.75 + 0.1875 = -0.5625. Each rank's own count instead (3 and 1) would give -1.0 + 0.75 = -0.25.
    # Gradients: -1.1/4 = -0.275, -0.9/4 = -0.225, -1.0/4 = -0.25 (row 0); 0.75/4 = 0.1875 (row 1).
    rows = [
        _tensors(r=[1.1, 0.9, 1.0], adv=[1.0] * 3, w=[1.0] * 3, mask=[True] * 3),
        _tensors(r=[1.5, 1.0, 1.0], adv=[-1.0] * 3, w=[0.5] * 3, mask=[True, False, False]),
    ]
    whole = [torch.cat([a, b]) for a, b in zip(*rows, strict=True)]
    whole[0] = whole[0].detach().requires_grad_()
    loss, grad, _ = _loss_and_grad(*whole, eps_clip=0.2)
    assert loss == pytest.approx(-0.5625, abs=1e-12)
    assert grad[0] + grad[1] == pytest.approx([-0.275, -0.225, -0.25, 0.1875, 0.0, 0.0], abs=1e-12)
    # The count arrives as an all-reduced tensor on a real rank; an int is accepted too.
    halves = [_loss_and_grad(*rows[0], eps_clip=0.2, n_tokens=torch.tensor(4.0, dtype=D)), _loss_and_grad(*rows[1], eps_clip=0.2, n_tokens=4)]
    assert [h[0] for h in halves] == pytest.approx([-0.75, 0.1875], abs=1e-12)
    assert halves[0][0] + halves[1][0] == pytest.approx(loss, abs=1e-12)
    assert halves[0][1] + halves[1][1] == pytest.approx(grad[0] + grad[1], abs=1e-12)
    # Without n_tokens each half is its own token mean: the sum is not the minibatch's loss.
    own = [_loss_and_grad(*r, eps_clip=0.2)[0] for r in rows]
    assert own == pytest.approx([-1.0, 0.75], abs=1e-12)


def test_per_sequence_advantages_broadcast_over_tokens():
    t = _tensors(r=[1.1, 0.9], adv=[2.0, 2.0], w=[1.0, 1.0], mask=[True, True])
    logp, prox, behav, adv, mask = t
    loss_tok, grad_tok, _ = _loss_and_grad(logp, prox, behav, adv, mask)
    loss_seq, grad_seq, _ = _loss_and_grad(logp, prox, behav, torch.tensor([2.0], dtype=D), mask)
    # Both: L = (-2*1.1 - 2*0.9) / 2 = -2.0
    assert loss_tok == loss_seq == pytest.approx(-2.0, abs=1e-12)
    assert grad_tok == grad_seq


@pytest.mark.parametrize(
    ("r", "adv", "eps_high", "value", "grad"),
    [
        # A>0, r = 1.25: symmetric eps=0.2 clips at 1.2 -> l = -1.2, grad 0;
        (1.25, 1.0, None, -1.2, 0.0),
        # clip-higher eps_high = 0.28 lets it through: l = -1.25, dL/dlogp = -A*r = -1.25.
        (1.25, 1.0, 0.28, -1.25, -1.25),
        # the low side still uses eps: A<0, r = 0.75 < 0.8 clipped either way (l = 0.8, grad 0).
        (0.75, -1.0, None, 0.8, 0.0),
        (0.75, -1.0, 0.28, 0.8, 0.0),
        # A>0, r = 1.3 > 1.28: clipped at the higher bound: l = -1.28, grad 0.
        (1.3, 1.0, 0.28, -1.28, 0.0),
        # A<0, r = 1.25: max picks the unclipped (pessimistic) branch whatever eps_high: l = 1.25, grad +1.25.
        (1.25, -1.0, 0.28, 1.25, 1.25),
    ],
)
def test_eps_clip_high_asymmetry(r, adv, eps_high, value, grad):
    t = _tensors(r=[r], adv=[adv], w=[1.0], mask=[True])
    loss, g, _ = _loss_and_grad(*t, eps_clip=0.2, eps_clip_high=eps_high)
    assert loss == pytest.approx(value, abs=1e-12)
    assert g[0] == pytest.approx(grad, abs=1e-12)


@st.composite
def loss_case(draw):
    n = draw(st.integers(min_value=1, max_value=16))

    def floats(lo, hi):
        return st.lists(st.floats(lo, hi, allow_nan=False), min_size=n, max_size=n)

    r = draw(floats(0.3, 3.0))
    adv = draw(floats(-2.0, 2.0))
    w = draw(floats(0.1, 10.0))
    mask = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return r, adv, w, mask


@settings(max_examples=200, deadline=None)
@given(loss_case(), st.floats(1.5, 8.0))
def test_gradient_matches_formula_and_cap_never_inflates_it(case, cap):
    r, adv, w, mask = case
    logp, prox, behav, advt, maskt = _tensors(r, adv, w, mask)
    _, g_nocap, _ = _loss_and_grad(logp, prox, behav, advt, maskt, eps_clip=0.2)
    _, g_cap, _ = _loss_and_grad(logp, prox, behav, advt, maskt, eps_clip=0.2, behav_weight_cap=cap)
    n = max(sum(mask), 1)
    # The ratios and weights as the loss sees them (exp(log x) may differ from x in the last
    # ulp, which matters only when hypothesis puts x exactly on a clip bound or on the cap).
    r_seen = torch.exp(logp - prox).detach()[0].tolist()
    w_seen = torch.exp(prox - behav)[0].tolist()
    for t in range(len(r)):
        # Branch of the max; at a tie both branches have gradient -A*r (clamp passes its bounds).
        clipped_active = (adv[t] > 0 and r_seen[t] > 1.2) or (adv[t] < 0 and r_seen[t] < 0.8)
        formula = 0.0 if (not mask[t] or clipped_active) else -(w[t] * adv[t] * r[t]) / n
        # rel 1e-9: r and w went through log/exp in float64 (a few ulps, ~1e-15 relative).
        assert g_nocap[t] == pytest.approx(formula, rel=1e-9, abs=1e-12)
        # The cap drops tokens without changing N: kept tokens' gradients are unchanged
        # (bitwise), dropped ones become 0 -- never larger in magnitude.
        assert g_cap[t] == (g_nocap[t] if w_seen[t] <= cap else 0.0)
        assert abs(g_cap[t]) <= abs(g_nocap[t])


def test_values_outside_the_mask_change_nothing_even_nan_and_inf():
    g = torch.Generator().manual_seed(3)
    shape = (3, 8)
    logp = (-torch.rand(shape, generator=g, dtype=D) * 3).requires_grad_()
    prox = logp.detach() + 0.1 * torch.randn(shape, generator=g, dtype=D)
    behav = prox + 0.1 * torch.randn(shape, generator=g, dtype=D)
    adv = torch.randn(shape, generator=g, dtype=D)
    mask = torch.rand(shape, generator=g) < 0.6
    mask[0, 0], mask[0, 1] = True, False
    loss, grad, _ = _loss_and_grad(logp, prox, behav, adv, mask, behav_weight_cap=3.0)

    out = ~mask
    junk = torch.tensor([math.nan, math.inf, -math.inf], dtype=D).repeat(shape[0] * shape[1])[: int(out.sum())]
    logp2 = logp.detach().clone()
    logp2[out] = junk
    logp2.requires_grad_()
    prox2, behav2, adv2 = prox.clone(), behav.clone(), adv.clone()
    prox2[out], behav2[out], adv2[out] = junk.flip(0), junk, junk
    loss2, grad2, metrics2 = _loss_and_grad(logp2, prox2, behav2, adv2, mask, behav_weight_cap=3.0)
    assert math.isfinite(loss2) and loss2 == loss
    assert grad2 == grad  # bitwise: masked positions are replaced before any arithmetic
    assert all(math.isfinite(v) for v in metrics2.values())
    assert all(grad2[i][j] == 0.0 for i, j in out.nonzero().tolist())


@pytest.mark.parametrize(
    ("field", "pattern"),
    [("logp", "^logp "), ("prox", "^prox_logp "), ("behav", "^behav_logp "), ("adv", "^advantages ")],
)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_inside_the_mask_raises_naming_the_tensor(field, pattern, bad):
    args = dict(
        logp=torch.zeros(2, 3), prox=torch.zeros(2, 3), behav=torch.zeros(2, 3), adv=torch.ones(2, 3)
    )
    args[field] = args[field].clone()
    args[field][1, 2] = bad
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(NonFiniteError, match=pattern) as err:
        decoupled_ppo_loss(args["logp"], args["prox"], args["behav"], args["adv"], mask)
    assert "(1, 2)" in str(err.value)  # and the first bad index


def test_bad_arguments_raise():
    z = torch.zeros(1, 2)
    m = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="eps_clip"):
        decoupled_ppo_loss(z, z, z, z, m, eps_clip=0.0)
    with pytest.raises(ValueError, match="shape mismatch"):
        decoupled_ppo_loss(z, torch.zeros(1, 3), z, z, m)


# --- advantages ------------------------------------------------------------------------------


def test_grpo_hand_computed_groups():
    # Groups are interleaved on purpose: grouping is by id, not by position.
    #   group 0 (idx 0,2,5,7): r = 1,0,0,1   mean 0.5, pop. std 0.5        -> A = +-0.5/(0.5+1e-6)
    #   group 1 (idx 1,4):     r = 1,1       constant                      -> A = 0 exactly
    #   group 2 (idx 3,6,8):   r = 0,0.5,1   mean 0.5, std sqrt(1/6)=0.40825 -> A = (r-0.5)/(0.408248+1e-6)
    #   group 3 (idx 9):       r = 0.3       singleton: std 0               -> A = 0
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.5, 1.0, 1.0, 0.3])
    groups = torch.tensor([0, 1, 0, 2, 1, 0, 2, 0, 2, 3])
    a0 = 0.5 / (0.5 + 1e-6)  # 0.999998
    a2 = 0.5 / (math.sqrt(1 / 6) + 1e-6)  # 1.2247419
    expected = [a0, 0.0, -a0, -a2, 0.0, -a0, 0.0, a0, a2, 0.0]
    adv = grpo_advantages(rewards, groups)
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)
    assert adv[[1, 4, 9]].tolist() == [0.0, 0.0, 0.0]
    assert ADVANTAGE_ESTIMATORS.get("grpo").fn is grpo_advantages  # lifted to per-token by SequenceLevel


def test_constant_reward_group_gives_exact_zeros():
    for value in (0.0, 1.0, 0.37):
        adv = grpo_advantages(torch.full((8,), value), torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]))
        assert adv.tolist() == [0.0] * 8
        assert mean_centered_advantages(torch.full((4,), value), torch.zeros(4, dtype=torch.long)).tolist() == [0.0] * 4


def test_dr_grpo_is_mean_centered_without_std():
    # group 0: 1, 0, 0 -> mean 1/3 -> 2/3, -1/3, -1/3; group 1: 0.5, 1.5 -> -0.5, +0.5
    adv = mean_centered_advantages(torch.tensor([1.0, 0.0, 0.5, 0.0, 1.5]), torch.tensor([0, 0, 1, 0, 1]))
    assert adv.tolist() == pytest.approx([2 / 3, -1 / 3, -0.5, -1 / 3, 0.5], abs=1e-7)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_rewards_raise_naming_rewards(name, bad):
    with pytest.raises(NonFiniteError, match="^rewards .*index \\(2,\\)"):
        ADVANTAGE_ESTIMATORS.get(name)(
            AdvantageInputs(torch.tensor([[1.0], [0.0], [bad]]), torch.ones(3, 1, dtype=torch.bool), torch.tensor([0, 0, 0]))
        )
