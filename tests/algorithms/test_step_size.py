"""VCPO's ESS-guided step size (``rl.step_size: ess_sqrt``, ``a3po.algorithms.step_size``): Kish's
effective sample size of the per-sequence behaviour weights, exact on hand-worked weights and stable
far from 1; computed on ``pi_prox / pi_behav`` per sequence (not per token, not on the trust ratio);
the rate it sets; refused where a variant has no importance weights."""

from __future__ import annotations

import math

import pytest
import torch

from a3po.algorithms.step_size import STEP_SIZE_RULES, ess_of_parts, ess_parts, sequence_log_weights
from a3po.config import ConfigError, config_from_dict


def test_kish_ess_of_hand_worked_weights():
    # W = (1, 3): (1 + 3)^2 / (1 + 9) = 1.6 of 2 sequences; equal weights: N; one dominant: ~1.
    assert ess_of_parts(ess_parts(torch.log(torch.tensor([1.0, 3.0]))[None])) == pytest.approx((1.6, 0.8))
    assert ess_of_parts(ess_parts(torch.zeros(5))[None]) == pytest.approx((5.0, 1.0))
    ess, ratio = ess_of_parts(ess_parts(torch.tensor([0.0, 0.0, 0.0, 50.0]))[None])
    assert ess == pytest.approx(1.0) and ratio == pytest.approx(0.25)


def test_the_ess_is_the_same_far_from_1_and_when_ranks_hold_parts_of_the_minibatch():
    log_w = torch.tensor([800.0, 800.0 + math.log(3.0), 799.0, 801.5])  # exp(800) overflows float64
    whole = ess_of_parts(ess_parts(log_w)[None])
    w = torch.exp(log_w - 800.0).double()
    assert whole[0] == pytest.approx(float(w.sum() ** 2 / (w * w).sum()))
    split = ess_of_parts(torch.stack([ess_parts(log_w[:1]), ess_parts(log_w[1:]), ess_parts(log_w[:0])]))
    assert split == pytest.approx(whole)


def test_a_sequence_weight_is_the_product_of_its_tokens_behaviour_weights_on_its_answer_only():
    prox = torch.tensor([[9.0, -1.0, -2.0, 0.0], [9.0, -0.5, -0.5, -0.5]])
    behav = torch.tensor([[0.0, -1.5, -1.0, 7.0], [0.0, -0.5, -1.5, -0.5]])
    mask = torch.tensor([[False, True, True, False], [False, True, True, True]])
    # row 0: (-1 + 1.5) + (-2 + 1) = -0.5; row 1: 0 + 1 + 0 = 1 (the prompt column and padding left out)
    assert sequence_log_weights(prox, behav, mask).tolist() == [-0.5, 1.0]


def test_the_rules_scale_by_the_square_root_of_the_ratio_or_not_at_all():
    assert STEP_SIZE_RULES.get("ess_sqrt").scale(0.25) == 0.5
    assert STEP_SIZE_RULES.get("fixed").scale(0.25) == 1.0
    assert STEP_SIZE_RULES.get("ess_sqrt").needs_weights and not STEP_SIZE_RULES.get("fixed").needs_weights


def test_a_non_finite_weight_is_refused_rather_than_read_as_healthy():
    with pytest.raises(ValueError, match="not finite"):
        ess_parts(torch.tensor([0.0, float("inf")]))


@pytest.mark.parametrize("rl, match", [
    ({"variant": "sync", "step_size": "ess_sqrt"}, r"rl.step_size 'ess_sqrt' with rl.variant 'sync' \(rl.proximal "
                                                   r"'behaviour', staleness bound 0\)"),
    ({"variant": "loglinear", "max_staleness": 0, "step_size": "ess_sqrt"}, r"with rl.variant 'loglinear' .*bound 0"),
    ({"step_size": "often"}, r"rl.step_size: unknown step-size rule 'often'"),
])
def test_refused_where_there_are_no_importance_weights(rl, match):
    with pytest.raises((ConfigError, KeyError), match=match):
        config_from_dict({"rl": rl})


# --- in a micro run ------------------------------------------------------------------------------


@pytest.fixture
def ess_run(core_stub_rewards, core_one_thread, monkeypatch):
    """A micro loglinear run at bound 4 with the ESS rule, and the rate each optimizer step ran at."""
    from a3po.config import preset, with_overrides
    from a3po.data.arithmetic import WORDS
    from a3po.data.datasets import load_rows
    from a3po.models.factory import build_tiny_model
    from a3po.parallel.updaters import LocalUpdater
    from a3po.training.loop import rl_train

    rates: list[float] = []
    update = LocalUpdater.update

    def recording(self, loss):
        rates.append(self.optimizer.param_groups[0]["lr"])
        return update(self, loss)

    monkeypatch.setattr(LocalUpdater, "update", recording)
    cfg = with_overrides(preset("micro"), rl={"variant": "loglinear", "steps": 8, "max_staleness": 4, "minibatches": 2,
                                              "step_size": "ess_sqrt", "lr": 3e-3, "lr_warmup_steps": 0,
                                              "lr_schedule": "constant"})
    model, tok = build_tiny_model("micro", WORDS, seed=0)
    train, held, _ = load_rows(cfg.data, tok)
    res = rl_train(cfg, model, tok, train, held, warmstart_acc=0.0)
    return res.history, rates, cfg


def test_on_policy_tokens_weigh_1_whatever_the_trust_ratio_after_the_first_minibatch(ess_run):
    history, rates, cfg = ess_run
    # Step 0: every token on-policy, pi_prox = pi_behav. The second minibatch's pi_theta has moved
    # (an update ran), so weights read off the trust ratio or pi_theta / pi_behav would be below 1.
    assert history[0]["loss/policy"] != 0.0
    assert history[0]["step_size/ess_ratio"] == 1.0 and rates[:2] == [cfg.rl.lr, cfg.rl.lr]


def test_stale_minibatches_train_at_the_rate_their_ess_sets(ess_run):
    history, rates, cfg = ess_run
    stale = [s for s, h in enumerate(history) if h["staleness/max"] >= 2]
    assert stale and all(history[s]["step_size/ess_ratio"] < 1.0 for s in stale), [
        (h["staleness/max"], h["step_size/ess_ratio"]) for h in history]
    for s in stale:  # two minibatches a step: the step's figure is their mean
        pair = rates[2 * s:2 * s + 2]
        assert all(r < cfg.rl.lr for r in pair)
        assert sum(r / cfg.rl.lr for r in pair) / 2 == pytest.approx(history[s]["step_size/lr_scale"])
