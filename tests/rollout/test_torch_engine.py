"""Rollout engine: behaviour log-probs are the log-probs of the distribution actually sampled
from (same as a fresh full forward under the same weights), versions, EOS handling, max tokens,
left padding, and mid-generation weight swaps.

All on the 15k-parameter "micro" Qwen2 model in fp32. The incremental (KV-cache) decode and a
full forward run different kernels, so they agree to float rounding (~1e-6), not bitwise:
tolerance 1e-4 on log-probs of magnitude <= ~10.
"""

from __future__ import annotations

import pytest
import torch

from a3po.data.arithmetic import WORDS
from a3po.models.factory import build_tiny_model
from a3po.models.logprobs import position_ids_from_mask, token_logprobs
from a3po.rollout.torch_engine import RolloutEngine
from a3po.rollout.types import SamplingParams

pytestmark = pytest.mark.usefixtures("core_one_thread")

TOL = 1e-4


@pytest.fixture(scope="module")
def micro():
    model, tok = build_tiny_model("micro", WORDS, seed=0)
    return model, tok


def _prompts(tok, texts):
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


TEXTS = ["Question: Mia has 23 pens. She buys 45 more.", "Question: Sam", "Question: Ava has 7 eggs and finds 2 more"]


def _gen(model, tok, prompts, params, seed=0, **kw):
    engine = RolloutEngine(model, tok.eos_token_id, tok.pad_token_id, version=kw.pop("version", 0))
    return engine, engine.generate(prompts, params, generator=torch.Generator().manual_seed(seed), **kw)


def test_behaviour_logp_equals_fresh_forward_at_temperature_1(micro):
    model, tok = micro
    _, b = _gen(model, tok, _prompts(tok, TEXTS), SamplingParams(max_new_tokens=10, temperature=1.0))
    with torch.no_grad():
        fresh = token_logprobs(model, b.input_ids, b.attention_mask)
    m = b.response_mask
    assert int(m.sum()) > 0
    torch.testing.assert_close(b.behav_logp[m], fresh[m], rtol=0, atol=TOL)
    # outside the response: behav 0, version -1
    assert bool((b.behav_logp[~m] == 0).all())
    assert bool((b.versions[~m] == -1).all())
    assert bool((b.versions[m] == 0).all())
    assert b.behav_logp.dtype == torch.float32


def test_behaviour_logp_applies_temperature_and_top_p(micro):
    model, tok = micro
    params = SamplingParams(max_new_tokens=10, temperature=0.7, top_p=0.9)
    _, b = _gen(model, tok, _prompts(tok, TEXTS), params, seed=1)
    m = b.response_mask
    with torch.no_grad():
        fresh = token_logprobs(model, b.input_ids, b.attention_mask, temperature=0.7, top_p=0.9)
        plain = token_logprobs(model, b.input_ids, b.attention_mask)
    torch.testing.assert_close(b.behav_logp[m], fresh[m], rtol=0, atol=TOL)
    # ...and the transformation matters: T = 0.7 with a renormalised nucleus is not T = 1.
    assert float((b.behav_logp[m] - plain[m]).abs().max()) > 1e-2
    # Every sampled token lies inside the nucleus (finite log-prob).
    assert bool(torch.isfinite(b.behav_logp[m]).all())


def test_greedy_is_scored_at_temperature_1(micro):
    model, tok = micro
    _, b = _gen(model, tok, _prompts(tok, TEXTS[:2]), SamplingParams(max_new_tokens=6, temperature=0.0))
    with torch.no_grad():
        fresh = token_logprobs(model, b.input_ids, b.attention_mask)
        pos = position_ids_from_mask(b.attention_mask)
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=pos).logits
    m = b.response_mask
    torch.testing.assert_close(b.behav_logp[m], fresh[m], rtol=0, atol=TOL)
    # greedy: the first generated token is the argmax after the (left-padded) prompt
    P = b.prompt_len
    assert b.input_ids[:, P].tolist() == logits[:, P - 1].argmax(-1).tolist()


class _EosControl:
    """A forward hook on ``lm_head`` that adds +50 to EOS's logit for the rows told to stop at
    this step and -50 for the others (so no row stops by chance: exp(-50) ~ 2e-22). Driven by
    ``between_steps``, which sees the decode step ``t`` before each forward and returns None
    (no weight change)."""

    def __init__(self, model, eos_id: int, stop_at: dict[int, int], n: int) -> None:
        self.eos_id, self.stop_at, self.n, self.t = eos_id, stop_at, n, 0
        self.handle = model.lm_head.register_forward_hook(self._hook)

    def between_steps(self, t: int):
        self.t = t
        return None

    def _hook(self, module, inputs, out):
        bias = torch.full((self.n,), -50.0)
        for row, t_stop in self.stop_at.items():
            if t_stop == self.t:
                bias[row] = 50.0
        out = out.clone()
        out[:, -1, self.eos_id] += bias
        return out


def test_stop_on_eos_pads_after_it_and_masks_it_out(micro):
    model, tok = micro
    eos, pad = tok.eos_token_id, tok.pad_token_id
    ctl = _EosControl(model, eos, stop_at={0: 2, 2: 0}, n=3)  # row 0 stops at step 2, row 2 at step 0
    try:
        _, b = _gen(model, tok, _prompts(tok, TEXTS), SamplingParams(max_new_tokens=6), between_steps=ctl.between_steps)
    finally:
        ctl.handle.remove()
    P = b.prompt_len
    assert b.input_ids.shape[1] == P + 6  # row 1 ran to max_new_tokens
    assert b.finished.tolist() == [True, False, True]
    resp = b.responses
    assert len(resp[0]) == 3 and resp[0][-1] == eos and eos not in resp[0][:-1]
    assert resp[2] == [eos]
    assert len(resp[1]) == 6 and eos not in resp[1]
    for row, n_tok in ((0, 3), (2, 1)):
        after = slice(P + n_tok, None)
        assert bool((b.input_ids[row, after] == pad).all())
        assert not bool(b.response_mask[row, after].any())
        assert not bool(b.attention_mask[row, after].any())
        assert bool((b.versions[row, after] == -1).all())
        assert bool((b.behav_logp[row, after] == 0).all())
        assert bool(b.response_mask[row, P : P + n_tok].all())  # the EOS itself is trained on
    # The behaviour log-prob of a forced EOS is ~0 (its probability is ~1).
    assert abs(float(b.behav_logp[0, P + 2])) < 1e-6


def test_decoding_stops_once_every_row_has_finished(micro):
    model, tok = micro
    ctl = _EosControl(model, tok.eos_token_id, stop_at={0: 1, 1: 1, 2: 0}, n=3)
    try:
        _, b = _gen(model, tok, _prompts(tok, TEXTS), SamplingParams(max_new_tokens=8), between_steps=ctl.between_steps)
    finally:
        ctl.handle.remove()
    assert b.input_ids.shape[1] == b.prompt_len + 2  # steps 0 and 1 only
    assert b.finished.all()
    assert [len(r) for r in b.responses] == [2, 2, 1]


@pytest.mark.parametrize("max_new", [1, 5])
def test_max_new_tokens_respected(micro, max_new):
    model, tok = micro
    ctl = _EosControl(model, tok.eos_token_id, stop_at={}, n=3)  # EOS suppressed everywhere
    try:
        _, b = _gen(model, tok, _prompts(tok, TEXTS), SamplingParams(max_new_tokens=max_new), between_steps=ctl.between_steps)
    finally:
        ctl.handle.remove()
    assert b.input_ids.shape[1] == b.prompt_len + max_new
    assert [len(r) for r in b.responses] == [max_new] * 3
    assert not b.finished.any()


def test_left_padding_gives_the_same_greedy_output_as_alone(micro):
    model, tok = micro
    short, long = _prompts(tok, [TEXTS[1], TEXTS[0]])
    assert len(long) > len(short) + 5  # the short prompt gets real left padding
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    _, alone = _gen(model, tok, [short], params)
    _, batched = _gen(model, tok, [long, short], params)
    P = batched.prompt_len
    assert batched.input_ids[1, : P - len(short)].tolist() == [tok.pad_token_id] * (P - len(short))
    assert batched.attention_mask[1, : P - len(short)].sum() == 0
    assert batched.responses[1] == alone.responses[0]
    m_alone, m_batch = alone.response_mask[0], batched.response_mask[1]
    torch.testing.assert_close(batched.behav_logp[1][m_batch], alone.behav_logp[0][m_alone], rtol=0, atol=TOL)


def test_weight_swap_between_steps_versions_and_logp_follow_the_new_weights():
    model, tok = build_tiny_model("micro", WORDS, seed=0)
    old, _ = build_tiny_model("micro", WORDS, seed=0)  # copies to score with afterwards
    new, _ = build_tiny_model("micro", WORDS, seed=1)
    new_state = new.state_dict()
    swap_at, new_version = 3, 7

    def hook(t: int):
        if t == swap_at:  # the trainer's weight push lands before decode step 3
            model.load_state_dict(new_state)
            return new_version
        return None

    ctl_prompts = _prompts(tok, TEXTS)
    ctl = _EosControl(model, tok.eos_token_id, stop_at={}, n=3)  # no EOS: all 8 steps happen
    try:
        engine, b = _gen(
            model, tok, ctl_prompts, SamplingParams(max_new_tokens=8), between_steps=lambda t: (ctl.between_steps(t), hook(t))[1], version=2
        )
    finally:
        ctl.handle.remove()
    P = b.prompt_len
    assert engine.version == new_version
    assert b.versions[:, P : P + swap_at].eq(2).all()
    assert b.versions[:, P + swap_at :].eq(new_version).all()
    assert b.versions[:, :P].eq(-1).all()
    # Score with the EOS bias of generation re-applied (-50 on EOS at every position).
    def score(m):
        h = m.lm_head.register_forward_hook(lambda mod, i, o: o + torch.nn.functional.one_hot(torch.tensor(tok.eos_token_id), o.shape[-1]) * -50.0)
        try:
            with torch.no_grad():
                return token_logprobs(m, b.input_ids, b.attention_mask)
        finally:
            h.remove()

    lp_old, lp_new = score(old), score(new)
    before, after = b.versions == 2, b.versions == new_version
    torch.testing.assert_close(b.behav_logp[before], lp_old[before], rtol=0, atol=TOL)
    # Tokens after the swap are sampled from exactly the new weights given their prefix (the KV
    # cache of the prefix is rebuilt with them), so a fresh forward of the new weights agrees.
    torch.testing.assert_close(b.behav_logp[after], lp_new[after], rtol=0, atol=TOL)
    # ...and the swap is real: the old weights would have scored them differently.
    assert float((lp_old[after] - lp_new[after]).abs().max()) > 1e-2


def test_bad_generate_arguments_raise(micro):
    model, tok = micro
    engine = RolloutEngine(model, tok.eos_token_id, tok.pad_token_id)
    with pytest.raises(ValueError, match="at least one prompt"):
        engine.generate([], SamplingParams())
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[5], []], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
