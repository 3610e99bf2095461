"""``train_step``: loglinear never runs the model for its proximal log-probs; the variants are
pinned to each other where they must coincide (on-policy first minibatch).

The batch is a real rollout of the "micro" model (see ``bench.prox_logp.make_scored_batch``):
4 prompts x group 2 = 8 sequences, up to 6 generated tokens, seeded rewards.
"""

from __future__ import annotations

import pytest
import torch

from a3po.arithmetic import WORDS
from a3po.config import RLConfig, Variant, proximal_method_name
from a3po.controller import clone_state
from a3po.logprobs import token_logprobs
from a3po.losses import decoupled_ppo_loss, ppo_clip_loss
from a3po.models import build_tiny_model
from a3po.proximal import PROXIMAL_METHODS, ProxInputs, loglinear_prox_logp
from a3po.trainer import train_step
from bench.prox_logp import make_scored_batch

pytestmark = pytest.mark.usefixtures("core_one_thread")

N_PROMPTS, GROUP, MAX_NEW = 4, 2, 6


def _cfg(variant, **kw) -> RLConfig:
    # temperature 1.0: the batches below are sampled at make_scored_batch's default temperature.
    base = dict(variant=variant, batch_prompts=N_PROMPTS, group_size=GROUP, minibatches=2, max_new_tokens=MAX_NEW, temperature=1.0)
    return RLConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def setup():
    model, tok = build_tiny_model("micro", WORDS, seed=0)
    scored = make_scored_batch(model, tok, N_PROMPTS, GROUP, MAX_NEW, seed=0, version=0)
    return model, scored, clone_state(model)


def _run_step(model, init, scored, cfg, version, proximal=None, sgd_lr=None):
    model.load_state_dict(init)
    if sgd_lr is None:
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    else:  # plain SGD: the update is -lr * (clipped) gradient, so gradients can be compared
        opt = torch.optim.SGD(model.parameters(), lr=sgd_lr)
    method = PROXIMAL_METHODS.get(proximal or proximal_method_name(cfg))
    calls = []
    handle = model.register_forward_pre_hook(lambda mod, args, kwargs: calls.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    try:
        metrics = train_step(model, opt, scored, version, cfg, method)
    finally:
        handle.remove()
    return metrics, calls, clone_state(model)


@pytest.mark.parametrize("minibatches", [1, 2, 4])
def test_loglinear_never_runs_the_model_for_prox_recompute_does_once(setup, minibatches):
    model, scored, init = setup
    n = len(scored.rollout)
    assert 0 < int(scored.rollout.response_mask.sum())
    for variant, proximal, expected in [
        # (variant, proximal override, forward calls: one per minibatch + one full-batch no-grad pass if needed)
        (Variant.LOGLINEAR, None, [n // minibatches] * minibatches),
        (Variant.SYNC, None, [n // minibatches] * minibatches),
        (Variant.RECOMPUTE, None, [n] + [n // minibatches] * minibatches),
        (Variant.RECOMPUTE, "metrics", [n] + [n // minibatches] * minibatches),
    ]:
        cfg = _cfg(variant, minibatches=minibatches, proximal=proximal)
        metrics, calls, _ = _run_step(model, init, scored, cfg, version=2, proximal=proximal)
        assert calls == expected, (variant, proximal)
        assert len(calls) == minibatches + PROXIMAL_METHODS.get(proximal_method_name(cfg)).needs_forward
        assert torch.isfinite(torch.tensor(list(metrics.values()))).all()
    # staleness of the batch (all tokens version 0) at trainer version 2
    assert metrics["staleness/mean"] == metrics["staleness/max"] == 2.0


def test_on_policy_first_minibatch_loglinear_d0_equals_ppo_clip_with_real_model(setup):
    # theta (one full forward) and behav (incremental decode) of the same weights agree to
    # float rounding; with d = 0 the decoupled loss with loglinear prox equals PPO-clip with
    # old = behav in value and gradient to the same order (see test_core_proximal).
    model, scored, init = setup
    model.load_state_dict(init)
    b = scored.rollout
    mask = b.response_mask
    logp = token_logprobs(model, b.input_ids, b.attention_mask)
    gap = float((logp.detach() - b.behav_logp)[mask].abs().max())
    assert gap < 1e-5
    adv = torch.linspace(-1.5, 1.5, len(b))  # per sequence
    d = torch.where(mask, torch.zeros_like(b.versions), torch.full_like(b.versions, -1))
    prox, _ = PROXIMAL_METHODS.get("loglinear")(
        ProxInputs(behav_logp=b.behav_logp, theta_logp=logp.detach(), staleness=d, mask=mask, recompute_logp=None)
    )
    # d = 0: the registered method anchors on behav (the step-start policy, exact for on-policy
    # tokens); the pure function is theta. They agree to rollout rounding here.
    assert torch.equal(prox[mask], b.behav_logp[mask])
    assert torch.equal(loglinear_prox_logp(b.behav_logp, logp.detach(), d.clamp(min=0)), logp.detach())
    params = [p for p in model.parameters()]
    l_dec, _ = decoupled_ppo_loss(logp, prox, b.behav_logp, adv, mask)
    g_dec = torch.autograd.grad(l_dec, params, retain_graph=True)
    l_ppo, _ = ppo_clip_loss(logp, b.behav_logp, adv, mask)
    g_ppo = torch.autograd.grad(l_ppo, params)
    # |r - 1| <= gap ~ 1e-6 per token: relative differences of that order; tolerance 1e-4.
    torch.testing.assert_close(l_dec, l_ppo, rtol=1e-4, atol=1e-7)
    for a, c in zip(g_dec, g_ppo):
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("variant", [Variant.LOGLINEAR, Variant.RECOMPUTE])
def test_single_minibatch_fresh_batch_every_variant_is_sync_ppo(setup, variant):
    # One minibatch, batch sampled by the very weights being trained (d = 0): the proximal
    # policy is the current one for all three variants (loglinear: theta; recompute: a forward
    # of the same weights; sync: behav). They agree to rollout rounding (~1e-6 relative), so
    # one SGD step (update = -lr * clipped gradient, lr = 1) moves the weights by the same
    # amount to ~1e-6 relative; tolerance 1e-4 relative to the largest update entry.
    model, scored, init = setup
    m_sync, _, w_sync = _run_step(model, init, scored, _cfg(Variant.SYNC, minibatches=1), version=0, sgd_lr=1.0)
    m_var, _, w_var = _run_step(model, init, scored, _cfg(variant, minibatches=1), version=0, sgd_lr=1.0)
    assert m_var["loss/policy"] == pytest.approx(m_sync["loss/policy"], rel=1e-4, abs=1e-7)
    assert m_var["policy/grad_norm"] == pytest.approx(m_sync["policy/grad_norm"], rel=1e-4)
    assert m_var["policy/clip_frac"] == m_sync["policy/clip_frac"] == 0.0
    assert m_var["staleness/max"] == 0.0
    scale = max(float((w_sync[k] - init[k]).abs().max()) for k in init)
    assert scale > 1e-4  # the step did something
    for k in init:
        torch.testing.assert_close(w_var[k] - init[k], w_sync[k] - init[k], rtol=0, atol=1e-4 * scale)


def test_step_changes_the_weights_and_reports_documented_metrics(setup):
    model, scored, init = setup
    metrics, _, w = _run_step(model, init, scored, _cfg(Variant.LOGLINEAR), version=1)
    assert any(not torch.equal(w[k], init[k]) for k in init)
    for key in ["loss/policy", "policy/iw_mean", "policy/clip_frac", "policy/grad_norm", "policy/entropy",
                "staleness/mean", "staleness/max", "prox/time_s", "perf/step_time_s", "reward/mean"]:
        assert key in metrics
    assert metrics["staleness/max"] == 1.0
    assert metrics["reward/mean"] == pytest.approx(scored.rewards.mean().item())


def test_top_p_below_one_is_rejected_for_training():
    # Behaviour log-probs of a truncated nucleus cannot be reproduced by the trainer for stale
    # tokens (log 0 outside the current nucleus), so the combination fails when the config is built.
    with pytest.raises(ValueError, match="top_p"):
        _cfg(Variant.SYNC, minibatches=1, top_p=0.5)


def test_recompute_on_fresh_batch_equals_sync_over_several_minibatches(setup):
    # d = 0 everywhere: recompute's proximal forward (weights before the step) equals behav to
    # rollout rounding, so recompute IS sync PPO for the whole step, clipping included.
    # lr 3e-2 with 4 minibatches makes later minibatches move far enough to clip.
    model, scored, init = setup
    m_sync, _, w_sync = _run_step(model, init, scored, _cfg(Variant.SYNC, minibatches=4, lr=3e-2), version=0)
    m_rc, _, w_rc = _run_step(model, init, scored, _cfg(Variant.RECOMPUTE, minibatches=4, lr=3e-2), version=0)
    assert m_sync["policy/clip_frac"] > 0  # the trust region is exercised
    assert m_rc["policy/clip_frac"] == m_sync["policy/clip_frac"]
    for k in init:
        # AdamW moves ~lr per step; rounding-level gradient differences leave ~1e-6.
        torch.testing.assert_close(w_rc[k], w_sync[k], rtol=0, atol=1e-4)


def test_loglinear_on_fresh_batch_equals_recompute_over_several_minibatches(setup):
    # d = 0 everywhere: the step-start policy is the behaviour policy, so loglinear anchors on
    # behav and keeps the trust region across minibatches, exactly like recompute (and sync).
    model, scored, init = setup
    m_rc, _, w_rc = _run_step(model, init, scored, _cfg(Variant.RECOMPUTE, minibatches=4, lr=3e-2), version=0)
    m_ll, _, w_ll = _run_step(model, init, scored, _cfg(Variant.LOGLINEAR, minibatches=4, lr=3e-2), version=0)
    assert m_ll["policy/clip_frac"] == m_rc["policy/clip_frac"]
    for k in init:
        torch.testing.assert_close(w_ll[k], w_rc[k], rtol=0, atol=1e-4)


def test_learning_rate_warms_up_then_decays_to_the_floor():
    from a3po.trainer import learning_rate

    rl = RLConfig(lr=1e-4, lr_warmup_steps=10, steps=110, lr_schedule="cosine", lr_min_ratio=0.1)
    lrs = [learning_rate(rl, s) for s in range(rl.steps)]
    assert lrs[0] == pytest.approx(1e-5) and lrs[9] == pytest.approx(1e-4)  # linear warm-up
    assert lrs[10] == pytest.approx(1e-4)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # monotone decay after it
    assert lrs[60] == pytest.approx(1e-4 * (0.1 + 0.9 * 0.5))  # half way: the mean of peak and floor
    assert lrs[-1] > 1e-5 and learning_rate(rl, rl.steps) == pytest.approx(1e-5)  # the floor where the schedule ends
    constant = RLConfig(lr=1e-4, lr_warmup_steps=10, steps=110, lr_schedule="constant")
    assert [learning_rate(constant, s) for s in (10, 60, 109)] == [1e-4] * 3
    with pytest.raises(ValueError, match="lr_schedule"):
        RLConfig(lr_schedule="linear")
