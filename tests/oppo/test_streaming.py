"""OPPO intra-step overlap: reference log-probs, critic values and reward-model scores streamed
chunk by chunk (own KV cache, own thread, fed by the rollout engine's per-token callback) equal
one-shot scoring of the finished batch.

The one-shot figures come from transformers' own forwards, not from a3po.oppo.streaming:
``a3po.models.logprobs.token_logprobs`` (the trainer's path) for log-probs,
``Qwen2ForTokenClassification(...).logits`` for values, ``Qwen2ForSequenceClassification(...)``
(which pools at the rightmost non-pad token) for the reward. Cached and full attention run
different kernels, so fp32 agreement is to rounding (~1e-7 here); tolerance 1e-5 as required.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2ForSequenceClassification, Qwen2ForTokenClassification

from a3po.data.arithmetic import WORDS
from a3po.models.factory import build_tiny_model
from a3po.models.logprobs import position_ids_from_mask, token_logprobs
from a3po.oppo.streaming import ChunkFeeder, IncrementalScorer, LogProbHead, RewardHead, ValueHead, start_scorers, stop_scorers
from a3po.rollout.torch_engine import RolloutEngine
from a3po.rollout.types import SamplingParams

pytestmark = pytest.mark.usefixtures("core_one_thread")

TOL = 1e-5
MAX_NEW = 7
TEXTS = ["Question: Mia has 23 pens. She buys 45 more.", "Question: Sam", "Question: Ava has 7 eggs and finds 2 more"]


class _StopRows:
    """Forward hook on the actor's ``lm_head``: row 0 emits EOS at decode step 2, row 2 at step
    0, row 1 never (+-50 on EOS's logit), so the batch holds finished rows, padding after EOS
    and a row cut at ``MAX_NEW``."""

    def __init__(self, model, eos_id):
        self.eos, self.t = eos_id, 0
        self.handle = model.lm_head.register_forward_hook(self._hook)

    def between_steps(self, t):
        self.t = t
        return None

    def _hook(self, module, inputs, out):
        bias = torch.tensor([50.0 if self.t == 2 else -50.0, -50.0, 50.0 if self.t == 0 else -50.0])
        out = out.clone()
        out[:, -1, self.eos] += bias
        return out


@pytest.fixture(scope="module")
def models():
    actor, tok = build_tiny_model("micro", WORDS, seed=0)
    ref, _ = build_tiny_model("micro", WORDS, seed=1)  # a different model than the actor
    cfg = ref.config
    torch.manual_seed(2)
    critic = Qwen2ForTokenClassification(cfg.__class__(**{**cfg.to_dict(), "num_labels": 1})).float().eval()
    torch.manual_seed(3)
    rm = Qwen2ForSequenceClassification(cfg.__class__(**{**cfg.to_dict(), "num_labels": 1})).float().eval()
    torch.manual_seed(4)
    linear_value = torch.nn.Linear(cfg.hidden_size, 1)
    return actor, tok, ref, critic, rm, linear_value


def _streamed_rollout(models, chunk_size):
    actor, tok, ref, critic, rm, linear_value = models
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    threads = start_scorers({
        "ref": (ref, LogProbHead(temperature=0.7)),
        "critic": (critic, ValueHead()),
        "critic_linear": (ref, ValueHead(linear_value)),
        "reward": (rm, RewardHead()),
    })
    feeder = ChunkFeeder(threads, chunk_size)
    ctl = _StopRows(actor, tok.eos_token_id)
    try:
        engine = RolloutEngine(actor, tok.eos_token_id, tok.pad_token_id)
        # The engine left-pads the prompts; the feeder gets the same block before decoding starts.
        width = max(map(len, prompts))
        p_ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
        p_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        feeder.start(p_ids, p_mask)
        batch = engine.generate(prompts, SamplingParams(MAX_NEW, temperature=1.0), generator=torch.Generator().manual_seed(0),
                                between_steps=ctl.between_steps, on_token=feeder.on_token)
        out = feeder.finish()
    finally:
        ctl.handle.remove()
        stop_scorers(threads)
    return batch, out, feeder.chunks_sent


@pytest.mark.parametrize("chunk_size", [1, 3, 100])
def test_streamed_scores_equal_one_shot(models, chunk_size):
    actor, tok, ref, critic, rm, linear_value = models
    batch, out, chunks = _streamed_rollout(models, chunk_size)
    # The precondition the test is about: EOS rows padded after, one row cut, left padding.
    assert batch.finished.tolist() == [True, False, True]
    assert batch.response_mask.sum(1).tolist() == [3, MAX_NEW, 1]
    assert (batch.attention_mask[:, 0] == 0).any()
    steps = batch.input_ids.shape[1] - batch.prompt_len
    assert chunks == -(-steps // chunk_size)  # ceil: 7, 3 and 1 chunks

    ids, attn, resp = batch.input_ids, batch.attention_mask, batch.response_mask
    pos = position_ids_from_mask(attn)
    with torch.no_grad():
        ref_logp = token_logprobs(ref, ids, attn, temperature=0.7)
        values = critic(input_ids=ids, attention_mask=attn, position_ids=pos).logits[..., 0]
        hidden = ref.model(input_ids=ids, attention_mask=attn, position_ids=pos).last_hidden_state
        values_linear = linear_value(hidden)[..., 0]
        reward = rm(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, 0]

    # Compared where they are defined: generated tokens (and all attended tokens for values).
    real = attn.bool()
    assert out["ref"].shape == ids.shape
    torch.testing.assert_close(out["ref"][resp], ref_logp[resp], atol=TOL, rtol=0)
    torch.testing.assert_close(out["ref"][real], ref_logp[real], atol=TOL, rtol=0)
    torch.testing.assert_close(out["critic"][real], values[real], atol=TOL, rtol=0)
    torch.testing.assert_close(out["critic_linear"][real], values_linear[real], atol=TOL, rtol=0)
    assert out["reward"].shape == (3,)
    torch.testing.assert_close(out["reward"], reward, atol=TOL, rtol=0)
    # Not vacuous: the heads produce distinct, non-trivial figures.
    assert ref_logp[resp].abs().min() > 0.1 and reward.std() > 0


def test_reward_is_read_at_eos_not_at_the_padding_after_it(models):
    _, tok, _, _, rm, _ = models
    # Row 0: "a b <eos> <pad>" right-padded after EOS; row 1: left-padded "a b c".
    a, b, c = (tok.convert_tokens_to_ids(x) for x in ("a", "b", "c"))
    eos, pad = tok.eos_token_id, tok.pad_token_id
    ids = torch.tensor([[a, b, eos, pad], [pad, a, b, c]])
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]])
    s = IncrementalScorer(rm, RewardHead())
    s.prefill(ids[:, :1], mask[:, :1])
    s.extend(ids[:, 1:], mask[:, 1:])
    with torch.no_grad():
        at_eos = rm(input_ids=ids[:1, :3], attention_mask=mask[:1, :3]).logits[0, 0]
    torch.testing.assert_close(s.result()[0], at_eos, atol=TOL, rtol=0)


def test_extend_before_prefill_raises(models):
    _, _, ref, _, _, _ = models
    with pytest.raises(RuntimeError, match="before prefill"):
        IncrementalScorer(ref, LogProbHead()).extend(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1))


def test_a_failing_scorer_surfaces_in_finish(models):
    _, _, ref, _, _, _ = models
    threads = start_scorers({"ref": (ref, LogProbHead())})
    feeder = ChunkFeeder(threads, 2)
    try:
        feeder.start(torch.tensor([[10**6]]), torch.ones(1, 1, dtype=torch.long))  # id outside the vocabulary
        with pytest.raises(RuntimeError, match="scorer-ref failed"):
            feeder.finish(timeout=60)
    finally:
        stop_scorers(threads)
