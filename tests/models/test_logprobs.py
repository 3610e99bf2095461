"""The sampling transform and the per-token alignment that the rollout engine, the trainer and
the OPPO scorers share, against numbers derived by hand (the other tests compare code paths
that all go through these functions, so a common-mode error would pass them).

``sampling_log_softmax`` (``a3po/models/logprobs.py``): ``log softmax(logits / T)``, then the
top-p nucleus (the smallest prefix of the tokens sorted by probability whose mass reaches p),
renormalised; tokens outside it get ``-inf``.
``token_values`` (``a3po/models/critic.py``): column ``t`` is the critic head's output at
position ``t - 1`` (the value of the prefix before token ``t``); column 0 is 0.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from a3po.models import logprobs
from a3po.models.critic import token_values
from a3po.models.logprobs import picked_logprobs, sampling_log_softmax

pytestmark = pytest.mark.usefixtures("core_one_thread")

NEG_INF = float("-inf")

# Probabilities q at T = 2, in vocabulary order (not sorted, so the nucleus must be mapped back
# to the vocabulary): sorted they are 0.4 (id 1), 0.3 (id 3), 0.18 (id 0), 0.12 (id 2), and the
# mass before each is 0, 0.4, 0.7, 0.88. The logits are 2 ln q, so logits / 2 = ln q.
Q = [0.18, 0.4, 0.12, 0.3]
LOGITS = torch.tensor([2 * math.log(q) for q in Q])


@pytest.mark.parametrize(
    "top_p, expected",
    [
        # p = 0.5: 0.4 < 0.5, so id 3 is needed (0.4 + 0.3 = 0.7 reaches 0.5); mass 0.7.
        (0.5, [NEG_INF, math.log(0.4 / 0.7), NEG_INF, math.log(0.3 / 0.7)]),
        # p = 0.75: 0.7 < 0.75, so id 0 is needed too (0.88 reaches it); id 2 is out; mass 0.88.
        (0.75, [math.log(0.18 / 0.88), math.log(0.4 / 0.88), NEG_INF, math.log(0.3 / 0.88)]),
        # p = 0.9: 0.88 < 0.9, so all four stay and nothing is renormalised.
        (0.9, [math.log(q) for q in Q]),
        (1.0, [math.log(q) for q in Q]),
    ],
)
def test_temperature_then_the_top_p_nucleus_by_hand(top_p, expected):
    out = sampling_log_softmax(LOGITS, temperature=2.0, top_p=top_p)
    assert out.isinf().tolist() == [math.isinf(e) for e in expected]
    assert out.tolist() == pytest.approx(expected, abs=1e-6)


def test_temperature_divides_the_logits_before_the_nucleus_is_chosen():
    # At T = 1 the same logits give q^2 / sum q^2: 0.0324, 0.16, 0.0144, 0.09 over 0.2968, i.e.
    # 0.1092, 0.5391, 0.0485, 0.3032. At p = 0.5 the top token (id 1, 0.539) alone reaches p, so
    # the nucleus is {1} with log-prob 0, where T = 2 kept {1, 3} (above).
    out = sampling_log_softmax(LOGITS, temperature=1.0, top_p=0.5)
    assert out.tolist() == [NEG_INF, 0.0, NEG_INF, NEG_INF]
    full = sampling_log_softmax(LOGITS, temperature=1.0)
    assert full.tolist() == pytest.approx([math.log(q * q / 0.2968) for q in Q], abs=1e-6)
    # Greedy (T = 0) has no distribution of its own and is scored at T = 1.
    assert sampling_log_softmax(LOGITS, temperature=0.0).tolist() == full.tolist()


def test_the_nucleus_is_chosen_per_row():
    # Row 1 is the same distribution with its ids reversed: the nucleus follows the ids.
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    out = sampling_log_softmax(logits, temperature=2.0, top_p=0.5)
    row0 = [NEG_INF, math.log(0.4 / 0.7), NEG_INF, math.log(0.3 / 0.7)]
    assert out[0].tolist() == pytest.approx(row0, abs=1e-6)
    assert out[1].tolist() == pytest.approx(row0[::-1], abs=1e-6)


class _PositionCritic(torch.nn.Module):
    """A critic whose head output at each position is ``10 * token id + position id``, so the
    value in each column shows which position it was read from and which positions were used."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Parameter(torch.zeros(1))  # the device and dtype are read from a parameter

    def forward(self, input_ids, attention_mask, position_ids, use_cache):
        return SimpleNamespace(logits=(10 * input_ids + position_ids).float()[..., None])


def test_token_values_shift_one_column_and_skip_left_padding():
    ids = torch.tensor([[3, 4, 5, 6], [0, 7, 8, 9]])  # row 1 is left-padded by one pad token (id 0)
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    # Positions: row 0: 0 1 2 3; row 1: 0 0 1 2 (the first real token is at position 0).
    # Head output (10 id + pos): row 0: 30 41 52 63; row 1: 0 70 81 92.
    # Column t holds the output at t - 1, column 0 holds 0: row 0: 0 30 41 52; row 1: 0 0 70 81.
    values = token_values(_PositionCritic(), ids, mask)
    assert values.dtype == torch.float32
    assert values.tolist() == [[0.0, 30.0, 41.0, 52.0], [0.0, 0.0, 70.0, 81.0]]


# --- picked_logprobs: the chunked log-prob and entropy the trainer takes --------------------------


def test_picked_logprobs_by_hand():
    """Q at T = 2 (LOGITS / 2 = ln Q): log p(id) = ln Q[id], H = -sum Q ln Q, without a nucleus."""
    targets = torch.tensor([1, 2])
    logp, ent = picked_logprobs(torch.stack([LOGITS, LOGITS]), targets, temperature=2.0, return_entropy=True)
    assert torch.allclose(logp, torch.tensor([math.log(0.4), math.log(0.12)]), atol=1e-6)
    assert torch.allclose(ent, torch.full((2,), -sum(q * math.log(q) for q in Q)), atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_picked_logprobs_chunked_equal_the_full_log_softmax_and_its_gradient(monkeypatch, dtype, temperature):
    """A chunk of 3 vocabulary rows at a time (20 positions: 7 chunks, the last one short) gives the
    values, entropies and logit gradients of torch's own log-softmax over the whole tensor."""
    monkeypatch.setattr(logprobs, "_CHUNK_ELEMENTS", 3 * 40)
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(4, 5, 40, generator=gen)).to(dtype).requires_grad_()
    targets = torch.randint(40, (4, 5), generator=gen)
    upstream = torch.randn(4, 5, generator=gen)

    logp, ent = picked_logprobs(logits, targets, temperature, return_entropy=True)
    (logp * upstream).sum().backward()
    got_grad, logits.grad = logits.grad, None

    ref_all = torch.log_softmax(logits.float() / (temperature or 1.0), dim=-1)
    ref = ref_all.gather(-1, targets[..., None]).squeeze(-1)
    (ref * upstream).sum().backward()
    assert logp.dtype == torch.float32 and got_grad.dtype == dtype
    assert torch.allclose(logp, ref, atol=1e-5)
    assert torch.allclose(ent, -(ref_all.exp() * ref_all).sum(-1).detach(), atol=1e-4)
    assert torch.allclose(got_grad.float(), logits.grad.float(), atol=1e-6)


def test_picked_logprobs_entropy_of_a_ruled_out_token_is_finite():
    """A -inf logit (a token the model rules out) has p = 0 and adds nothing to H (not 0 * -inf = nan)."""
    logits = torch.tensor([[0.0, 0.0, NEG_INF]])
    logp, ent = picked_logprobs(logits, torch.tensor([0]), return_entropy=True)
    assert torch.allclose(logp, torch.tensor([math.log(0.5)])) and torch.allclose(ent, torch.tensor([math.log(2.0)]))
