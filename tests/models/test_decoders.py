"""Incremental decoders (a3po.models.decoders).

The fast ``llama_like`` decoder must give what the model's own forward gives: greedy tokens
equal to the ``generic`` decoder's and behaviour log-probs equal to a fresh full forward to float
rounding, on Qwen2 and Llama configs with grouped-query attention, biases and repeated prompts
(the prefill shares a GRPO group's prefix). Tolerance 1e-4 on log-probs of magnitude <= ~10, as
in rollout/test_torch_engine (different kernels agree to ~1e-6, not bitwise).
"""

from __future__ import annotations

import pytest
import torch

from a3po.models.decoders import DECODERS, HFDecoder, LlamaLikeDecoder, decoder_for
from a3po.models.logprobs import token_logprobs
from a3po.rollout.torch_engine import RolloutEngine
from a3po.rollout.types import SamplingParams
from tests.support.tiny_models import EOS, PAD
from tests.support.tiny_models import llama as _llama
from tests.support.tiny_models import qwen2 as _qwen2

pytestmark = pytest.mark.usefixtures("core_one_thread")

TOL = 1e-4


# Prompts of different lengths (left padding), two of them repeated (a GRPO group), out of order.
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [5, 6, 7, 8, 9], [12, 13, 14], [10, 11], [20, 21, 22, 23, 24, 25, 26]]


def _generate(model, decoder, params, seed=0):
    engine = RolloutEngine(model, EOS, PAD, decoder=decoder)
    return engine.generate(PROMPTS, params, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("build", [_qwen2, _llama], ids=["qwen2", "llama"])
def test_fast_decoder_greedy_matches_the_models_own_forward(build):
    model = build()
    assert isinstance(decoder_for(model)(model, 1, 8), LlamaLikeDecoder)  # auto picks the fast path
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    fast, generic = _generate(model, "auto", greedy), _generate(model, "generic", greedy)
    assert torch.equal(fast.input_ids, generic.input_ids)
    m = fast.response_mask
    torch.testing.assert_close(fast.behav_logp[m], generic.behav_logp[m], rtol=0, atol=TOL)
    assert torch.equal(fast.input_ids[0], fast.input_ids[2])  # same prompt, greedy: same response


@pytest.mark.parametrize("build", [_qwen2, _llama], ids=["qwen2", "llama"])
def test_fast_decoder_behaviour_logp_equals_a_fresh_forward(build):
    model = build()
    params = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.95)
    b = _generate(model, "auto", params, seed=3)
    with torch.no_grad():
        fresh = token_logprobs(model, b.input_ids, b.attention_mask, temperature=0.8, top_p=0.95)
    m = b.response_mask
    assert int(m.sum()) > 20
    torch.testing.assert_close(b.behav_logp[m], fresh[m], rtol=0, atol=TOL)
    # Sampled rows of one prompt differ (the shared prefill does not tie their samples).
    assert not torch.equal(b.input_ids[0], b.input_ids[2])


def test_decoder_choice_falls_back_to_the_generic_path():
    assert set(DECODERS.names()) >= {"generic", "llama_like", "qwen2", "llama"}
    # A config the fast path does not cover (another activation) gets the model's own forward.
    gelu = _qwen2(hidden_act="gelu")
    assert isinstance(decoder_for(gelu)(gelu, 1, 8), HFDecoder)
    with pytest.raises(ValueError, match="does not support"):
        decoder_for(gelu, "llama_like")
    # A forward hook on the model must keep firing: generic path.
    model = _qwen2()
    handle = model.register_forward_hook(lambda *a: None)
    try:
        assert isinstance(decoder_for(model)(model, 1, 8), HFDecoder)
    finally:
        handle.remove()
    with pytest.raises(KeyError, match="valid"):
        RolloutEngine(model, EOS, PAD, decoder="nope")


def test_new_weights_loaded_in_place_are_decoded_with_not_the_fused_copy_of_the_old_ones():
    """The fast decoder reuses its fused weights across batches; weights loaded in place
    (``load_state_dict``, as the engine's weight push does) must be the ones decoded with."""
    model, other = _qwen2(), _qwen2()
    with torch.no_grad():
        for p in other.parameters():
            p.normal_(0.0, 0.5)
    engine = RolloutEngine(model, EOS, PAD, decoder="llama_like")
    prompts, params = [[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=6, temperature=0.0)
    before = engine.generate(prompts, params)
    engine.load_weights(other.state_dict(), version=1)
    after = engine.generate(prompts, params)
    fresh = RolloutEngine(_qwen2(), EOS, PAD, decoder="llama_like")
    fresh.load_weights(other.state_dict(), version=1)
    expected = fresh.generate(prompts, params)
    assert torch.equal(after.input_ids, expected.input_ids) and torch.equal(after.behav_logp, expected.behav_logp)
    assert not torch.equal(before.behav_logp, after.behav_logp)  # the new weights do decode differently
