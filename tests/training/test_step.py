"""``train_step``: loglinear never runs the model for its proximal log-probs; the variants are
pinned to each other where they must coincide (on-policy first minibatch).

The batch is a real rollout of the "micro" model (see ``bench.prox_logp.make_scored_batch``):
4 prompts x group 2 = 8 sequences, up to 6 generated tokens, seeded rewards. Also: the learning-rate
schedule, and the run state a checkpoint holds (its keys on disk).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from a3po.algorithms.losses import decoupled_ppo_loss, ppo_clip_loss
from a3po.algorithms.proximal import PROXIMAL_METHODS, ProxInputs, loglinear_prox_logp
from a3po.config import RLConfig, Variant, config_from_dict, proximal_method_name
from a3po.data.arithmetic import WORDS
from a3po.models.factory import build_tiny_model
from a3po.models.logprobs import token_logprobs
from a3po.producer.producer import ScoredBatch
from a3po.producer.weight_store import clone_state
from a3po.rollout.types import RolloutBatch
from a3po.training.step import train_step
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


@pytest.mark.parametrize("shared", [False, True], ids=["plain", "shared_prompt"])
@pytest.mark.parametrize("minibatches", [1, 2, 4])
def test_loglinear_never_runs_the_model_for_prox_recompute_does_once(setup, minibatches, shared):
    model, scored, init = setup
    n = len(scored.rollout)
    assert 0 < int(scored.rollout.response_mask.sum())

    def passes(rows: int) -> list[int]:
        # Model calls of one forward pass over `rows` rows of whole groups (minibatch_split
        # groups): plain, one call; with the shared prompt, one call over the distinct prompts
        # (one per group), one over the rows.
        return [rows // GROUP, rows] if shared else [rows]

    mb = n // minibatches
    for variant, proximal, expected in [
        # (variant, proximal override, forward passes: one per minibatch + one full-batch no-grad pass if needed)
        (Variant.LOGLINEAR, None, passes(mb) * minibatches),
        (Variant.SYNC, None, passes(mb) * minibatches),
        (Variant.RECOMPUTE, None, passes(n) + passes(mb) * minibatches),
        (Variant.RECOMPUTE, "metrics", passes(n) + passes(mb) * minibatches),
    ]:
        cfg = _cfg(variant, minibatches=minibatches, proximal=proximal, shared_prompt_forward=shared, minibatch_split="groups")
        metrics, calls, _ = _run_step(model, init, scored, cfg, version=2, proximal=proximal)
        assert calls == expected, (variant, proximal)
        assert len(calls) == len(passes(1)) * (minibatches + PROXIMAL_METHODS.get(proximal_method_name(cfg)).needs_forward)
        assert torch.isfinite(torch.tensor(list(metrics.values()))).all()
    # staleness of the batch (all tokens version 0) at trainer version 2
    assert metrics["staleness/mean"] == metrics["staleness/max"] == 2.0


def test_a_step_with_the_shared_prompt_forward_updates_the_weights_as_the_plain_one(setup):
    # Plain SGD, so the update is the (clipped) gradient: the two forwards differ by float rounding only.
    model, scored, init = setup
    for variant in (Variant.LOGLINEAR, Variant.RECOMPUTE):
        m_plain, _, plain = _run_step(model, init, scored, _cfg(variant, shared_prompt_forward=False), version=2, sgd_lr=0.5)
        m_shared, _, shared = _run_step(model, init, scored, _cfg(variant), version=2, sgd_lr=0.5)
        assert any(not torch.equal(plain[k], init[k]) for k in init)
        for k in init:
            torch.testing.assert_close(shared[k], plain[k], rtol=0, atol=1e-6, msg=k)
        assert m_shared["loss/policy"] == pytest.approx(m_plain["loss/policy"], abs=1e-6)


def test_on_policy_first_minibatch_loglinear_d0_equals_ppo_clip_with_real_model(setup):
    # theta (one full forward) and behav (incremental decode) of the same weights agree to
    # float rounding; with d = 0 the decoupled loss with loglinear prox equals PPO-clip with
    # old = behav in value and gradient to the same order (see algorithms/test_proximal).
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
    for a, c in zip(g_dec, g_ppo, strict=True):
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
    assert m_var["stability/trust_ratio_clipped_frac"] == m_sync["stability/trust_ratio_clipped_frac"] == 0.0
    assert m_var["staleness/max"] == 0.0
    scale = max(float((w_sync[k] - init[k]).abs().max()) for k in init)
    assert scale > 1e-4  # the step did something
    for k in init:
        torch.testing.assert_close(w_var[k] - init[k], w_sync[k] - init[k], rtol=0, atol=1e-4 * scale)


def test_step_changes_the_weights_and_reports_documented_metrics(setup):
    model, scored, init = setup
    metrics, _, w = _run_step(model, init, scored, _cfg(Variant.LOGLINEAR), version=1)
    assert any(not torch.equal(w[k], init[k]) for k in init)
    for key in ["loss/policy", "stability/trust_ratio_mean", "stability/trust_ratio_clipped_frac", "policy/grad_norm", "policy/entropy",
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
    assert m_sync["stability/trust_ratio_clipped_frac"] > 0  # the trust region is exercised
    assert m_rc["stability/trust_ratio_clipped_frac"] == m_sync["stability/trust_ratio_clipped_frac"]
    for k in init:
        # AdamW moves ~lr per step; rounding-level gradient differences leave ~1e-6.
        torch.testing.assert_close(w_rc[k], w_sync[k], rtol=0, atol=1e-4)


def test_loglinear_on_fresh_batch_equals_recompute_over_several_minibatches(setup):
    # d = 0 everywhere: the step-start policy is the behaviour policy, so loglinear anchors on
    # behav and keeps the trust region across minibatches, exactly like recompute (and sync).
    model, scored, init = setup
    m_rc, _, w_rc = _run_step(model, init, scored, _cfg(Variant.RECOMPUTE, minibatches=4, lr=3e-2), version=0)
    m_ll, _, w_ll = _run_step(model, init, scored, _cfg(Variant.LOGLINEAR, minibatches=4, lr=3e-2), version=0)
    assert m_ll["stability/trust_ratio_clipped_frac"] == m_rc["stability/trust_ratio_clipped_frac"]
    for k in init:
        torch.testing.assert_close(w_ll[k], w_rc[k], rtol=0, atol=1e-4)


def test_learning_rate_warms_up_then_decays_to_the_floor():
    from a3po.training.lr_schedule import learning_rate

    rl = RLConfig(lr=1e-4, lr_warmup_steps=10, steps=110, lr_schedule="cosine", lr_min_ratio=0.1)
    lrs = [learning_rate(rl, s) for s in range(rl.steps)]
    assert lrs[0] == pytest.approx(1e-5) and lrs[9] == pytest.approx(1e-4)  # linear warm-up
    assert lrs[10] == pytest.approx(1e-4)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))  # monotone decay after it
    assert lrs[60] == pytest.approx(1e-4 * (0.1 + 0.9 * 0.5))  # half way: the mean of peak and floor
    assert lrs[-1] > 1e-5 and learning_rate(rl, rl.steps) == pytest.approx(1e-5)  # the floor where the schedule ends
    constant = RLConfig(lr=1e-4, lr_warmup_steps=10, steps=110, lr_schedule="constant")
    assert [learning_rate(constant, s) for s in (10, 60, 109)] == [1e-4] * 3
    with pytest.raises(ValueError, match="lr_schedule"):
        config_from_dict({"rl": {"lr_schedule": "linear"}})


# --- train_step against hand-derived numbers -----------------------------------------------------
#
# A policy whose logits we control: two tokens, logits [w, 0] at every position whatever the input,
# so p(token 0) = sigmoid(w) and p(token 1) = 1 - sigmoid(w). At w = 0 every token has
# log pi_theta = log(1/2), and d log pi_theta / dw = 1 - sigmoid(w) = +1/2 for token 0,
# -sigmoid(w) = -1/2 for token 1. The behaviour log-probs are data in the batch, chosen below so
# that r and w come out as round numbers.


class _TwoTokenPolicy(torch.nn.Module):
    def __init__(self, w: float = 0.0) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(float(w)))

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        b, length = input_ids.shape
        logits = torch.stack([self.w, torch.zeros_like(self.w)]).expand(b, length, 2)
        return SimpleNamespace(logits=logits)


def _scored(tokens, behav, d, version, rewards, pad_to):
    """A one-group ScoredBatch: row i has prompt token 0 at column 0, then ``tokens[i]`` (with
    behaviour log-probs ``behav[i]`` and staleness ``d[i]``), right-padded to ``pad_to`` columns."""
    n = len(tokens)
    ids = torch.zeros(n, 1 + pad_to, dtype=torch.long)
    resp = torch.zeros(n, 1 + pad_to, dtype=torch.bool)
    blp = torch.zeros(n, 1 + pad_to)
    ver = torch.full((n, 1 + pad_to), -1, dtype=torch.long)
    for i in range(n):
        k = len(tokens[i])
        ids[i, 1 : 1 + k] = torch.tensor(tokens[i])
        resp[i, 1 : 1 + k] = True
        blp[i, 1 : 1 + k] = torch.tensor(behav[i], dtype=torch.float32)
        ver[i, 1 : 1 + k] = version - torch.tensor(d[i])
    rollout = RolloutBatch(
        input_ids=ids, attention_mask=torch.ones_like(ids), response_mask=resp, behav_logp=blp, versions=ver,
        finished=torch.ones(n, dtype=torch.bool), prompt_len=1, meta=[{"group": 0} for _ in range(n)],
    )
    return ScoredBatch(index=version, rollout=rollout, rewards=torch.tensor(rewards), completions=[""] * n, gen_time_s=0.0)


def test_loglinear_train_step_matches_the_hand_derived_loss_and_gradient():
    # Paper's equations (A-3PO; decoupled PPO, Hilton et al. 2022), eps = 0.2, cap on w = 5:
    #   log pi_prox = a log pi_behav + (1 - a) log pi_theta,  a = 1/d (d >= 1); for d = 0 the
    #   step-start policy is the behaviour policy itself, so pi_prox = pi_behav (see test below)
    #   r = pi_theta / pi_prox,  w = pi_prox / pi_behav (token dropped if w > 5)
    #   l = w * max(-A r, -A clip(r, 0.8, 1.2)),  loss = sum(l) / (number of response tokens)
    # With theta = log(1/2) and behav = theta + delta:  d = 2 -> r = w = exp(-delta/2);
    # d = 1 or 0 -> r = exp(-delta), w = 1;  d = 4 -> r = exp(-delta/4), w = exp(-3 delta/4).
    # Advantages: dr_grpo, rewards [2, 0] in one group -> A = +1, -1 (exact).
    half = math.log(0.5)
    ln = math.log
    rows = [
        # row 0, A = +1: three tokens and one pad column
        [(0, 2, half - 2 * ln(1.1)),  # r = w = 1.1 (inside the clip): l = 1.1 * -1.1 = -1.21, dl/dlogp = -1.21
         (1, 2, half - 2 * ln(1.5)),  # r = w = 1.5 > 1.2, A > 0: clipped, l = 1.5 * -1.2 = -1.8, no gradient
         (0, 0, ln(1 / 3))],          # d = 0: prox = behav = log(1/3), r = 0.5/(1/3) = 1.5, w = 1: l = -1.2, no gradient
        # row 1, A = -1: four tokens
        [(1, 1, ln(5 / 9)),           # prox = behav, r = 0.5/(5/9) = 0.9, w = 1: l = max(0.9, 0.9) = 0.9, dl/dlogp = +0.9
         (0, 4, ln(1 / 32)),          # delta = -4 log 2: r = 2, w = 8 > 5: dropped (still counted in the mean)
         (1, 4, half - 4 * ln(1.1)),  # r = 1.1, w = 1.1**3 = 1.331: l = 1.331 * 1.1 = 1.4641, dl/dlogp = +1.4641
         (0, 1, ln(2 / 3))],          # r = 0.5/(2/3) = 0.75 < 0.8, A < 0: clipped, l = 0.8, no gradient
    ]
    scored = _scored(
        tokens=[[t for t, _, _ in r] for r in rows], behav=[[b for _, _, b in r] for r in rows],
        d=[[d for _, d, _ in r] for r in rows], version=4, rewards=[2.0, 0.0], pad_to=4,
    )
    # loss = (-1.21 - 1.8 - 1.2 + 0.9 + 0 + 1.4641 + 0.8) / 7 = -1.0459 / 7
    expected_loss = -1.0459 / 7
    # dloss/dw = sum(dl/dlogp * dlogp/dw) / 7 = (-1.21 * 1/2 + 0.9 * -1/2 + 1.4641 * -1/2) / 7 = -1.78705 / 7
    expected_grad = -1.78705 / 7
    policy = _TwoTokenPolicy()
    opt = torch.optim.SGD(policy.parameters(), lr=1.0)  # w_after = 0 - 1.0 * grad (|grad| < grad_clip = 1)
    cfg = RLConfig(variant=Variant.LOGLINEAR, batch_prompts=1, group_size=2, minibatches=1, temperature=1.0,
                   advantage="dr_grpo", eps_clip=0.2, behav_weight_cap=5.0, grad_clip=1.0)
    metrics = train_step(policy, opt, scored, 4, cfg, PROXIMAL_METHODS.get("loglinear"))

    # fp32 log-probs of magnitude <= 4, exponentiated: ~1e-6 relative; tolerance 1e-5.
    assert metrics["loss/policy"] == pytest.approx(expected_loss, rel=1e-5)
    assert policy.w.item() == pytest.approx(-expected_grad, rel=1e-5)
    assert metrics["policy/grad_norm"] == pytest.approx(abs(expected_grad), rel=1e-5)
    assert metrics["stability/behav_iw_capped_frac"] == pytest.approx(1 / 7)  # the d = 4, w = 8 token
    assert metrics["stability/trust_ratio_clipped_frac"] == pytest.approx(3 / 7)  # the r = 1.5, 1.5, 0.75 tokens
    assert metrics["stability/trust_ratio_max"] == pytest.approx(2.0, rel=1e-5)
    assert metrics["stability/behav_iw_max"] == pytest.approx(8.0, rel=1e-5)
    assert metrics["staleness/mean"] == pytest.approx((2 + 2 + 0 + 1 + 4 + 4 + 1) / 7)
    assert metrics["staleness/max"] == 4.0
    assert metrics["policy/entropy"] == pytest.approx(math.log(2), rel=1e-6)  # two equally likely tokens


@pytest.mark.parametrize("variant", [Variant.LOGLINEAR, Variant.RECOMPUTE, Variant.SYNC])
def test_d0_tokens_keep_the_trust_region_across_minibatches_in_train_step(variant):
    # What the trainer does at d = 0 (not the pure function, which would anchor on theta).
    # Two rows, one response token each, one minibatch each, on-policy at w = 0 (behav = log 1/2):
    #   row 0: token 0, A = +1;  row 1: token 1, A = -1  (dr_grpo, rewards [2, 0]).
    # First minibatch (either row): r = 1, w = 1, dloss/dw = -A * dlogp/dw = -1/2 for both rows,
    #   so SGD with lr = 2 log 3 moves w to log 3: p(token 0) = 3/4.
    # Second minibatch, anchored on the step-start policy pi_prox = pi_behav = 1/2:
    #   row 0: r = (3/4)/(1/2) = 1.5 > 1.2 with A > 0 -> clipped, no gradient;
    #   row 1: r = (1/4)/(1/2) = 0.5 < 0.8 with A < 0 -> clipped, no gradient.
    # So w ends at exactly log 3 whichever row came first, and clip_frac = (0 + 1) / 2.
    # Anchoring d = 0 tokens on the current theta instead gives r = 1 in the second minibatch: no
    # clipping, a non-zero gradient, and w != log 3.
    half = math.log(0.5)
    scored = _scored(tokens=[[0], [1]], behav=[[half], [half]], d=[[0], [0]], version=3, rewards=[2.0, 0.0], pad_to=1)
    policy = _TwoTokenPolicy()
    opt = torch.optim.SGD(policy.parameters(), lr=2 * math.log(3))
    cfg = RLConfig(variant=variant, batch_prompts=1, group_size=2, minibatches=2, temperature=1.0, advantage="dr_grpo")
    metrics = train_step(policy, opt, scored, 3, cfg, PROXIMAL_METHODS.get(proximal_method_name(cfg)))
    assert policy.w.item() == pytest.approx(math.log(3), rel=1e-6)
    assert metrics["stability/trust_ratio_clipped_frac"] == 0.5
    # loss/policy is the mean over minibatches: (-1 + 0.8) / 2 or (+1 - 1.2) / 2, both -0.1.
    assert metrics["loss/policy"] == pytest.approx(-0.1, rel=1e-5)


def test_train_step_stability_statistics_are_over_the_steps_tokens():
    # recompute: pi_prox is the step-start policy (1/2 for every token at w = 0) whatever order the
    # minibatches run in, so the behaviour weights pi_prox / pi_behav are fixed by the batch:
    #   row 0 (its own minibatch): 5 tokens, w = [1, 1, 1, 1, 9];  row 1: 2 tokens, w = [1, 1].
    # Over the step's 7 tokens (type-7 quantile, tests/algorithms/test_stability.py): p99 = 1 + 0.94 * 8
    # = 8.52, mean 15/7, max 9, capped (cap 5) 1/7. Per minibatch the p99s are 8.68 and 1: their
    # mean 4.84 is what averaging minibatch figures would report.
    half = math.log(0.5)
    ws = [[1, 1, 1, 1, 9], [1, 1]]
    scored = _scored(tokens=[[0] * 5, [1] * 2], behav=[[half - math.log(w) for w in row] for row in ws],
                     d=[[1] * 5, [1] * 2], version=3, rewards=[2.0, 0.0], pad_to=5)
    cfg = RLConfig(variant=Variant.RECOMPUTE, batch_prompts=1, group_size=2, minibatches=2, temperature=1.0,
                   advantage="dr_grpo", behav_weight_cap=5.0)
    policy = _TwoTokenPolicy()
    metrics = train_step(policy, torch.optim.SGD(policy.parameters(), lr=0.1), scored, 3, cfg, PROXIMAL_METHODS.get("recompute"))
    # fp32 log-probs: ~1e-6 relative.
    assert metrics["stability/behav_iw_p99"] == pytest.approx(8.52, rel=1e-5)
    assert metrics["stability/behav_iw_mean"] == pytest.approx(15 / 7, rel=1e-5)
    assert metrics["stability/behav_iw_max"] == pytest.approx(9.0, rel=1e-5)
    assert metrics["stability/behav_iw_capped_frac"] == pytest.approx(1 / 7)


# --- the checkpoint's run state ------------------------------------------------------------------

# A checkpoint of the current on-disk format, every key written out (a PPO run with OPPO intra and inter).
ON_DISK = {
    "step": 4, "policy": {"w": torch.ones(2)}, "optimizer": {"state": {}}, "weights_history": {3: {"w": torch.zeros(2)}},
    "history": [{"reward/mean": 0.5}] * 4, "eval_curve": [[0, 0.25], [4, 0.5]], "train_wall_s": 7.0, "warmstart_acc": 0.25,
    "config": {"rl": {"steps": 8}}, "inputs": {"data.train_path": "ab" * 32}, "precision": "bf16-autocast",
    "critic": {"v": torch.ones(1)}, "critic_optimizer": {"state": {}},
    "oppo_state": {"carry": []}, "intra_critic_history": {}, "intra_state": {"chunk_tuner": {}},
    "pending_evaluation": {"version": 4, "train_rows": [{"source": "train", "reward": 1.0}]},
}


def test_run_state_reads_and_writes_the_checkpoint_keys_on_disk():
    """Old checkpoints keep resuming: RunState reads every key of the current format and writes
    back the same keys (the policy and optimizer beside it, through the updater)."""
    from a3po.training.run_state import PendingEvaluation, RunState

    run = RunState.from_checkpoint(ON_DISK, "ckpt/step_000004")
    assert (run.step, run.warmstart_acc, run.train_wall_s, run.path) == (4, 0.25, 7.0, "ckpt/step_000004")
    assert run.eval_curve == [(0, 0.25), (4, 0.5)]  # JSON's lists back to (step, acc) pairs
    assert run.inputs == {"data.train_path": "ab" * 32}  # the files' hashes, not an extension's entry
    assert run.precision == "bf16-autocast"  # what the run computed in, not an extension's entry
    assert run.pending_evaluation == PendingEvaluation(4, [{"source": "train", "reward": 1.0}])  # nor this
    assert run.policy is ON_DISK["policy"] and run.optimizer is ON_DISK["optimizer"]
    assert set(run.extensions) == {"critic", "critic_optimizer", "oppo_state", "intra_critic_history", "intra_state"}
    written = run.to_checkpoint()
    assert set(written) == set(ON_DISK) - {"policy", "optimizer"}
    assert written["weights_history"] is ON_DISK["weights_history"] and written["oppo_state"] is ON_DISK["oppo_state"]
    assert written["pending_evaluation"] == ON_DISK["pending_evaluation"]


def test_a_checkpoint_without_a_run_key_names_the_file_and_the_key():
    from a3po.storage.checkpoint import CheckpointError
    from a3po.training.run_state import RunState

    with pytest.raises(CheckpointError, match=r"ckpt/step_000004 has no weights_history"):
        RunState.from_checkpoint({k: v for k, v in ON_DISK.items() if k != "weights_history"}, "ckpt/step_000004")
