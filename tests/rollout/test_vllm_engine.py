"""The vLLM rollout engine against the trainer's own forward (``-m vllm``; skipped without vLLM).

Run where vLLM is installed: on a CPU machine ``bash infra/install_vllm_cpu.sh .venv-vllm`` then
``make test-vllm`` (``source .venv-vllm/vllm-env.sh; .venv-vllm/bin/python -m pytest -m vllm``); on
CUDA with the ``gpu`` extra. The model is the tiny preset's architecture (3 heads) after a short warm start
(peaked next-token distributions, as in training; a random model's near-ties would make greedy
agreement a coin toss), in float32.

Tolerance. vLLM computes the log-probs in its own kernels (attention, fused norms, its own
sampler's temperature scaling and log-softmax), so they equal the trainer's
``a3po.models.logprobs.token_logprobs`` only to rounding: ``BEHAV_TOL_MAX`` on any token, ``BEHAV_TOL_MEAN``
on the mean over the generated tokens, both in nats of log-prob (1e-4 nats is a 0.01% error in
the behaviour importance weight). Measured on vllm-cpu 0.32, float32, 2 CPU cores (printed with
-s): mean 1.3e-7, max 3.0e-6 nats over ~530 sampled tokens at T = 0.7 and T = 1, so the bounds
leave a margin of 30x on the max. In bfloat16 (CUDA) expect errors of order 1e-2: these bounds
are for float32.
"""

from __future__ import annotations

import importlib.util
import tempfile

import pytest
import torch

from a3po.config import WarmStartConfig
from a3po.data.arithmetic import WORDS, generate_split
from a3po.models.factory import TinyArch, build_tiny_model
from a3po.models.logprobs import token_logprobs
from a3po.producer.weight_store import clone_state
from a3po.rollout.torch_engine import RolloutEngine
from a3po.rollout.types import SamplingParams

pytestmark = pytest.mark.vllm

if importlib.util.find_spec("vllm") is None:
    from a3po.rollout.vllm_support import INSTALL_HINT

    pytest.skip(f"vLLM is not installed ({INSTALL_HINT})", allow_module_level=True)

from a3po.rollout.vllm_engine import VllmEngine  # noqa: E402
from a3po.training.warmstart import warm_start  # noqa: E402

BEHAV_TOL_MAX = 1e-4
BEHAV_TOL_MEAN = 1e-5
N_PROMPTS, NEW_TOKENS = 32, 24
# The tiny preset's sizes with 3 heads of 32 instead of 4 of 24: vLLM's CPU attention has no
# kernel for head size 24 (the same parameter count; the engine refuses 24 with that reason).
TINY_H32 = TinyArch(hidden_size=96, num_layers=2, num_heads=3, intermediate_size=192)


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model, tok = build_tiny_model(TINY_H32, WORDS, seed=0)
    rows = generate_split(400, "train", 0)
    warm_start(model, tok, rows, WarmStartConfig(steps=60, batch_size=32, lr=3e-3, seed=0))
    v0 = clone_state(model)
    warm_start(model, tok, rows, WarmStartConfig(steps=60, batch_size=32, lr=3e-3, seed=1))  # "a training step": v1
    v1 = clone_state(model)
    prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in generate_split(N_PROMPTS, "heldout", 5)]
    engine = VllmEngine.from_policy(model, tok, v0, 0, work_dir=tempfile.mkdtemp(prefix="a3po-vllm-test-"),
                                    max_model_len=128, dtype="float32", seed=0)
    yield model, tok, v0, v1, prompts, engine
    engine.close()


def _trainer_logp(model, state, batch, temperature):
    model.load_state_dict(state)
    with torch.no_grad():
        return token_logprobs(model.eval(), batch.input_ids, batch.attention_mask, temperature)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_behaviour_logprobs_match_a_fresh_trainer_forward(setup, temperature):
    model, tok, v0, _, prompts, engine = setup
    engine.load_weights(v0, 0)
    batch = engine.generate_batch(prompts, SamplingParams(NEW_TOKENS, temperature=temperature), seed=11)
    m = batch.response_mask
    assert int(m.sum()) >= N_PROMPTS  # every row generated something
    assert batch.versions[m].eq(0).all() and batch.versions[~m].eq(-1).all()
    diff = (batch.behav_logp - _trainer_logp(model, v0, batch, temperature))[m].abs()
    print(f"\nT={temperature}: {int(m.sum())} tokens, |vLLM - trainer| log-prob mean {diff.mean():.2e} max {diff.max():.2e} nats")
    assert diff.max() < BEHAV_TOL_MAX
    assert diff.mean() < BEHAV_TOL_MEAN
    # The temperature is in them: the same tokens scored at T = 1 are far off when T = 0.7.
    if temperature != 1.0:
        assert (batch.behav_logp - _trainer_logp(model, v0, batch, 1.0))[m].abs().max() > 100 * BEHAV_TOL_MAX


def test_after_a_weight_update_greedy_outputs_match_the_trainers_model(setup):
    model, tok, v0, v1, prompts, engine = setup
    greedy = SamplingParams(NEW_TOKENS, temperature=0.0)
    model.load_state_dict(v0)
    before = RolloutEngine(model, tok.eos_token_id, tok.pad_token_id).generate(prompts, greedy).responses
    engine.load_weights(v0, 0)
    assert engine.generate_batch(prompts, greedy, seed=0).responses == before  # the starting point agrees too

    engine.load_weights(v1, 1)
    batch = engine.generate_batch(prompts, greedy, seed=0)
    model.load_state_dict(v1)
    after = RolloutEngine(model, tok.eos_token_id, tok.pad_token_id).generate(prompts, greedy).responses
    assert after != before  # the update changes the greedy answers, so agreement below means it was loaded
    same = sum(a == b for a, b in zip(batch.responses, after, strict=True))
    print(f"\ngreedy after the update to v1: {same}/{len(prompts)} rows identical to the trainer's model")
    assert same == len(prompts)
    assert batch.versions[batch.response_mask].eq(1).all()
    assert batch.finished.tolist() == [r[-1] == tok.eos_token_id for r in after]


def test_behaviour_logprobs_follow_the_update(setup):
    model, _, v0, v1, prompts, engine = setup
    engine.load_weights(v1, 1)
    batch = engine.generate_batch(prompts, SamplingParams(NEW_TOKENS, temperature=1.0), seed=12)
    m = batch.response_mask
    assert (batch.behav_logp - _trainer_logp(model, v1, batch, 1.0))[m].abs().max() < BEHAV_TOL_MAX
    assert (batch.behav_logp - _trainer_logp(model, v0, batch, 1.0))[m].abs().max() > 100 * BEHAV_TOL_MAX  # not v0's


def test_mid_batch_weight_swaps_are_refused(setup):
    *_, prompts, engine = setup
    with pytest.raises(ValueError, match="between batches only"):
        engine.generate_batch(prompts, SamplingParams(4, temperature=1.0), seed=0, between_steps=lambda t: None)


def test_a_head_size_without_a_cpu_kernel_is_refused_with_the_reason():
    if torch.cuda.is_available():
        pytest.skip("the head-size limit is vLLM's CPU attention's")
    from a3po.rollout.vllm_support import VllmUnsupported

    model, tok = build_tiny_model("tiny", WORDS, seed=0)  # 96 / 4 heads = 24
    with pytest.raises(VllmUnsupported, match="does not support head size 24"):
        VllmEngine.from_policy(model, tok, clone_state(model), 0, work_dir=tempfile.mkdtemp(), max_model_len=64)


def test_a_batch_whose_prompts_exceed_the_default_token_budget_samples_seeded(setup):
    # 192 prompts of ~30 tokens: more prompt tokens than vLLM's default step budget (4096). With it,
    # vllm-cpu 0.32 splits a seeded prefill and its worker dies ("CPU Generator does not use
    # offset"); the engine's budget holds a whole batch (a3po/rollout/vllm_engine.py).
    model, _, v0, _, prompts, engine = setup
    engine.load_weights(v0, 0)
    many = (prompts * 6)[:192]
    assert sum(map(len, many)) > 4096
    batch = engine.generate_batch(many, SamplingParams(8, temperature=1.0), seed=5)
    assert len(batch) == 192 and bool(batch.response_mask.any(dim=1).all())
    assert (batch.behav_logp - _trainer_logp(model, v0, batch, 1.0))[batch.response_mask].abs().max() < BEHAV_TOL_MAX


# --- the request-level loop (OPPO: over-commitment, streamed scoring) ----------------------------


def test_the_request_loop_samples_what_generate_batch_samples(setup):
    # Same requests, same per-row seeds: stepping vLLM's engine here instead of LLM.generate changes nothing.
    _, _, v0, _, prompts, engine = setup
    engine.load_weights(v0, 0)
    params = SamplingParams(NEW_TOKENS, temperature=1.0)
    whole = engine.generate_batch(prompts, params, seed=21)
    looped = engine.generate_until(prompts, params, 21, torch.full((N_PROMPTS,), NEW_TOKENS), lambda done: False)
    assert torch.equal(looped.input_ids, whole.input_ids) and torch.equal(looped.behav_logp, whole.behav_logp)
    assert torch.equal(looped.finished, whole.finished) and torch.equal(looped.response_mask, whole.response_mask)


def test_an_early_stop_keeps_the_partial_answers_and_frees_the_engine(setup):
    """Rows capped by their budgets, the batch stopped once 12 rows are done: the rows still running
    come back unfinished with the tokens they had (each a prefix of what the uncapped, unstopped
    request samples, seeded alike), their log-probs the trainer's, and no request is left behind."""
    model, _, v0, _, prompts, engine = setup
    engine.load_weights(v0, 0)
    params = SamplingParams(NEW_TOKENS, temperature=1.0)
    budget = torch.tensor([3 + i % 5 if i % 4 == 0 else NEW_TOKENS for i in range(N_PROMPTS)])
    seen: list[int] = []

    def stop(done: torch.Tensor) -> bool:
        seen.append(int(done.sum()))
        return int(done.sum()) >= 12

    batch = engine.generate_until(prompts, params, 21, budget, stop)
    full = engine.generate_until(prompts, params, 21, torch.full((N_PROMPTS,), NEW_TOKENS), lambda done: False)
    lengths = batch.response_mask.sum(1)
    assert seen == sorted(seen) and 12 <= seen[-1] < N_PROMPTS  # stopped early, at the first step with 12 done
    assert bool((lengths <= budget).all()) and bool((lengths > 0).all())
    assert int(((lengths == budget) & (budget < NEW_TOKENS)).sum()) >= 1  # some rows stopped at their own cap
    running = ~batch.finished & (lengths < budget)
    assert int(running.sum()) >= 1, "precondition: some rows were still decoding at the stop"
    for i, (part, whole) in enumerate(zip(batch.responses, full.responses, strict=True)):
        assert whole[: len(part)] == part, i
    m = batch.response_mask
    assert (batch.behav_logp - _trainer_logp(model, v0, batch, 1.0))[m].abs().max() < BEHAV_TOL_MAX
    assert not engine.llm.llm_engine.has_unfinished_requests()
    again = engine.generate_batch(prompts, params, seed=21)  # the aborted requests left nothing in the way
    assert torch.equal(again.input_ids, full.input_ids)


def test_streamed_columns_are_the_batch_column_by_column(setup):
    # on_token gets each decode column once, in order, as the torch engine hands it to OPPO's scorers:
    # the sampled token where the row decoded that column, padding (and alive False) where it had stopped.
    _, tok, v0, _, prompts, engine = setup
    engine.load_weights(v0, 0)
    columns: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    batch = engine.generate_batch(prompts, SamplingParams(NEW_TOKENS, temperature=1.0), seed=22,
                                  on_token=lambda t, tokens, alive: columns.append((t, tokens.clone(), alive.clone())))
    p = batch.prompt_len
    assert [t for t, _, _ in columns] == list(range(batch.input_ids.shape[1] - p))
    for t, tokens, alive in columns:
        assert torch.equal(alive, batch.response_mask[:, p + t])
        assert torch.equal(tokens[alive], batch.input_ids[alive, p + t])
        assert bool((tokens[~alive] == tok.pad_token_id).all())
    assert bool((~batch.response_mask[:, p:]).any()), "precondition: some rows ended before the longest"
