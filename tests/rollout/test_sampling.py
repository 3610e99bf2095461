"""The engine's token samplers: the inverse-CDF draw by hand, its frequencies against the distribution,
and the engine under each sampler (exact behaviour log-probs, reproducible per seed, top-p respected);
the config refuses an unknown sampler and a sampler for an engine that samples by itself."""

from __future__ import annotations

import pytest
import torch

from a3po.config import preset, with_overrides
from a3po.data.arithmetic import WORDS
from a3po.models.factory import build_tiny_model
from a3po.models.logprobs import token_logprobs
from a3po.rollout.sampling import SAMPLERS, inverse_cdf_draw
from a3po.rollout.torch_engine import RolloutEngine
from a3po.rollout.types import SamplingParams

pytestmark = pytest.mark.usefixtures("core_one_thread")


def test_the_inverse_cdf_draw_by_hand():
    p = torch.tensor([[0.2, 0.3, 0.5]] * 5 + [[0.5, 0.0, 0.5]] * 2)
    # C = 0.2, 0.5, 1.0: u < 0.2 -> 0; 0.2 <= u < 0.5 -> 1; else 2. With p_1 = 0, u = 0.5 lands past it.
    u = torch.tensor([[0.0], [0.19], [0.2], [0.49], [0.9999999], [0.5], [0.25]])
    assert inverse_cdf_draw(p, u).tolist() == [0, 0, 1, 1, 2, 2, 0]
    # Unnormalised rows are read as p / sum(p); u near 1 never runs past the last entry of nonzero mass.
    q = torch.tensor([[2.0, 2.0, 0.0, 0.0]])
    assert inverse_cdf_draw(q, torch.tensor([[0.49]])).tolist() == [0]
    assert inverse_cdf_draw(q, torch.tensor([[1.0 - 1e-9]])).tolist() == [1]


@pytest.mark.parametrize("sampler", ["multinomial", "inverse_cdf"])
def test_each_sampler_draws_the_distribution(sampler):
    p = torch.tensor([0.05, 0.0, 0.15, 0.3, 0.5])
    gen = torch.Generator().manual_seed(0)
    n = 20_000
    draws = SAMPLERS.get(sampler)(p.expand(n, -1).contiguous(), gen)
    freq = torch.bincount(draws, minlength=5).float() / n
    assert freq[1] == 0  # never an entry of probability 0
    # 4 binomial standard deviations at n = 20,000 (<= 0.0141 here)
    assert torch.all((freq - p).abs() <= 4 * (p * (1 - p) / n).sqrt() + 1e-9), freq.tolist()


@pytest.fixture(scope="module")
def micro():
    return build_tiny_model("micro", WORDS, seed=0)


@pytest.mark.parametrize("top_p", [1.0, 0.5])
def test_the_engine_under_inverse_cdf_records_the_log_probs_of_what_it_drew(micro, top_p):
    model, tok = micro
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ("Question: Mia has 23 pens.", "Question: Sam")]
    params = SamplingParams(max_new_tokens=12, temperature=0.7, top_p=top_p)
    engine = RolloutEngine(model, tok.eos_token_id, tok.pad_token_id, sampler="inverse_cdf")
    a = engine.generate_batch(prompts, params, seed=3)
    b = engine.generate_batch(prompts, params, seed=3)
    assert torch.equal(a.input_ids, b.input_ids)  # the seed decides the draws
    with torch.no_grad():
        fresh = token_logprobs(model, a.input_ids, a.attention_mask, temperature=0.7)
    m = a.response_mask
    if top_p == 1.0:  # top-p renormalises over the kept tokens: the recorded log-prob is of that distribution
        torch.testing.assert_close(a.behav_logp[m], fresh[m], rtol=0, atol=1e-4)
    assert bool((a.behav_logp[m] > -float("inf")).all())  # never a token top-p removed
    # The draws are the sampler's: the same seed under torch.multinomial gives other tokens (fixed seeds:
    # this holds or fails the same way every time).
    other = RolloutEngine(model, tok.eos_token_id, tok.pad_token_id).generate_batch(prompts, params, seed=3)
    assert not torch.equal(a.input_ids, other.input_ids)


def test_the_sampler_is_checked_when_the_config_is_built():
    with pytest.raises(ValueError, match="rollout.sampler must be one of"):
        with_overrides(preset("micro"), rollout={"sampler": "gumbel"})
    with pytest.raises(ValueError, match="rollout.sampler 'inverse_cdf' is for the torch engine"):
        with_overrides(preset("micro"), rollout={"engine": "vllm", "sampler": "inverse_cdf"})
    assert preset("smol").rollout.sampler == "inverse_cdf"
    with pytest.raises(KeyError, match="sampler"):
        RolloutEngine(build_tiny_model("micro", WORDS, seed=0)[0], 0, 0, sampler="gumbel")


def test_the_torch_engine_built_from_a_config_draws_with_its_sampler(micro):
    from a3po.devices import DType
    from a3po.rollout.engines import ROLLOUT_ENGINES
    from a3po.rollout.sampling import inverse_cdf_sampler, multinomial_sampler

    model, tok = micro
    for name, expected in (("inverse_cdf", inverse_cdf_sampler), ("multinomial", multinomial_sampler)):
        cfg = with_overrides(preset("micro"), rollout={"sampler": name})
        engine = ROLLOUT_ENGINES.get("torch").build(model, tok, model.state_dict(), 0, cfg, DType.FLOAT32)
        assert engine.draw is expected, name
