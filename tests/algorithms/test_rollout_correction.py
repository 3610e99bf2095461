"""Rollout correction (engine-vs-trainer mismatch): each method's weights on small tensors with
the expected values derived by hand in the comments, the config's refusals, the loss's
composition, the bf16 torch engine, and one micro run per method."""

from __future__ import annotations

import math

import pytest
import torch

from a3po.algorithms.losses import decoupled_ppo_loss
from a3po.algorithms.rollout_correction import (
    ROLLOUT_CORRECTIONS,
    CorrectionSettings,
    icepop_weights,
    mis_weights,
    tis_weights,
    trainer_logp_source,
)
from a3po.config import preset, with_overrides
from a3po.data.arithmetic import WORDS
from a3po.data.datasets import load_rows
from a3po.models.factory import build_tiny_model
from a3po.producer.weight_store import clone_state
from a3po.rollout.engines import build_engine
from a3po.training.loop import rl_train

# Two sequences of three columns; row 1's last column is padding. Token ratios rho = exp(log_ratio):
#   row 0: 0.5, 1.0, 3.0        row 1: 1.2, 0.25, (pad)
RHO = torch.tensor([[0.5, 1.0, 3.0], [1.2, 0.25, 7.0]])
MASK = torch.tensor([[True, True, True], [True, True, False]])
LOG_RATIO = RHO.log()


def test_tis_truncates_each_token_ratio_at_the_cap():
    c = tis_weights(LOG_RATIO, MASK, cap=2.0)
    # min(rho, 2): 0.5, 1, 2 | 1.2, 0.25, and 0 on the pad
    assert torch.allclose(c.weights, torch.tensor([[0.5, 1.0, 2.0], [1.2, 0.25, 0.0]]), atol=1e-6)
    assert c.truncated.tolist() == [[False, False, True], [False, False, False]]
    assert not c.masked.any()
    # 1 of 5 tokens truncated, none masked; mean weight (0.5 + 1 + 2 + 1.2 + 0.25) / 5 = 0.99
    assert c.metrics["correction/truncated_frac"] == pytest.approx(0.2)
    assert c.metrics["correction/masked_frac"] == 0.0
    assert c.metrics["correction/weight_mean"] == pytest.approx(0.99, abs=1e-6)
    # ratios sorted 0.25, 0.5, 1, 1.2, 3: median 1; p99 at 0.99 * 4 = 3.96 -> 1.2 + 0.96 * 1.8 = 2.928; max 3
    assert c.metrics["correction/ratio_p50"] == pytest.approx(1.0, abs=1e-6)
    assert c.metrics["correction/ratio_p99"] == pytest.approx(2.928, abs=1e-5)
    assert c.metrics["correction/ratio_max"] == pytest.approx(3.0, abs=1e-5)


def test_icepop_drops_tokens_outside_the_band_and_keeps_the_ratio_inside():
    c = icepop_weights(LOG_RATIO, MASK, lower=0.5, upper=2.0)
    # band [0.5, 2]: 0.5 kept (bound included), 1 kept, 3 dropped | 1.2 kept, 0.25 dropped
    assert torch.allclose(c.weights, torch.tensor([[0.5, 1.0, 0.0], [1.2, 0.0, 0.0]]), atol=1e-6)
    assert c.masked.tolist() == [[False, False, True], [False, True, False]]
    assert c.metrics["correction/masked_frac"] == pytest.approx(2 / 5)
    assert c.metrics["correction/seq_masked_frac"] == 0.0  # no sequence lost every token


def test_mis_sequence_product_masks_whole_sequences():
    # R = prod rho: row 0 0.5 * 1 * 3 = 1.5, row 1 1.2 * 0.25 = 0.3 (the pad is not a token)
    c, seq = mis_weights(LOG_RATIO, MASK, upper=2.0, lower=0.5, level="sequence", mode="mask")
    assert torch.allclose(seq, torch.tensor([1.5, 0.3]), atol=1e-6)
    # row 0 inside [0.5, 2]: every token weighs R = 1.5; row 1 below 0.5: dropped
    assert torch.allclose(c.weights, torch.tensor([[1.5, 1.5, 1.5], [0.0, 0.0, 0.0]]), atol=1e-6)
    assert c.masked.tolist() == [[False, False, False], [True, True, False]]
    assert c.metrics["correction/seq_masked_frac"] == 0.5
    assert c.metrics["correction/masked_frac"] == pytest.approx(2 / 5)
    assert c.metrics["correction/seq_ratio_max"] == pytest.approx(1.5, abs=1e-6)


def test_mis_truncate_caps_the_sequence_ratio():
    c, _ = mis_weights(LOG_RATIO, MASK, upper=1.2, lower=0.0, level="sequence", mode="truncate")
    # min(R, 1.2): row 0 1.5 -> 1.2 (truncated), row 1 0.3 stays; nothing dropped
    assert torch.allclose(c.weights, torch.tensor([[1.2, 1.2, 1.2], [0.3, 0.3, 0.0]]), atol=1e-6)
    assert c.metrics["correction/truncated_frac"] == pytest.approx(3 / 5)
    assert not c.masked.any()


def test_mis_geometric_mean_rejects_and_weighs_one():
    # G = exp(mean log rho): row 0 1.5 ** (1/3) = 1.1447, row 1 0.3 ** (1/2) = 0.5477
    c, seq = mis_weights(LOG_RATIO, MASK, upper=1.2, lower=0.6, level="geometric", mode="mask")
    assert torch.allclose(seq, torch.tensor([1.5 ** (1 / 3), 0.3**0.5]), atol=1e-6)
    # row 0 in [0.6, 1.2]: weight 1 (rejection only); row 1 below 0.6: dropped
    assert torch.allclose(c.weights, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]), atol=1e-6)


def test_registry_defaults_are_the_published_ones():
    s = CorrectionSettings()
    assert ROLLOUT_CORRECTIONS.get("tis").resolve(s).cap == 2.0  # TRL / verl
    assert ROLLOUT_CORRECTIONS.get("icepop").resolve(s) == CorrectionSettings(cap=5.0, lower=0.5)  # the Ring-1T report
    assert ROLLOUT_CORRECTIONS.get("mis").resolve(s) == CorrectionSettings(cap=2.0, lower=0.5, level="sequence", mode="mask")
    assert ROLLOUT_CORRECTIONS.get("mis").resolve(CorrectionSettings(level="geometric")).cap == 1.001
    assert not ROLLOUT_CORRECTIONS.get("none").needs_trainer_logp
    # where the trainer's log-probs of the behaviour versions come from
    assert trainer_logp_source("none", 2) is None
    assert trainer_logp_source("tis", 0) == "trainer" and trainer_logp_source("tis", 1) == "producer"


def test_loss_multiplies_the_correction_into_each_token():
    # One token, A = 1, theta = prox (r = 1, unclipped): the term is -A * r * w * c = -w * c.
    # prox = log 0.6, trainer's behaviour log-prob = log 0.5: w = 0.6 / 0.5 = 1.2; c = 0.5 -> loss -0.6.
    logp = torch.tensor([[math.log(0.6)]])
    mask = torch.tensor([[True]])
    loss, _ = decoupled_ppo_loss(logp, logp, torch.tensor([[math.log(0.5)]]), torch.tensor([1.0]), mask,
                                 correction=torch.tensor([[0.5]]))
    assert loss.item() == pytest.approx(-0.6, abs=1e-6)
    # without it, the same call is -w = -1.2 (today's loss)
    loss, _ = decoupled_ppo_loss(logp, logp, torch.tensor([[math.log(0.5)]]), torch.tensor([1.0]), mask)
    assert loss.item() == pytest.approx(-1.2, abs=1e-6)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"rollout_correction": "sis"}, "rl.rollout_correction: unknown rollout correction 'sis'"),
        ({"rollout_correction_cap": 3.0}, "rl.rollout_correction_cap is set but rl.rollout_correction 'none'"),
        ({"rollout_correction": "tis", "rollout_correction_lower": 0.5}, "rl.rollout_correction_lower is set but"),
        ({"rollout_correction": "icepop", "rollout_correction_level": "geometric"}, "rl.rollout_correction_level is set"),
        ({"rollout_correction": "tis", "rollout_correction_cap": 1.0}, "rl.rollout_correction_cap must be in (1, 1e6]"),
        ({"rollout_correction": "icepop", "rollout_correction_lower": 1.5}, "rl.rollout_correction_lower must be in (0, 1)"),
        ({"rollout_correction": "mis", "rollout_correction_level": "geometric", "rollout_correction_mode": "truncate"},
         "geometric mean is a rejection statistic"),
        ({"rollout_correction": "mis", "rollout_correction_mode": "truncate", "rollout_correction_lower": 0.5},
         "has no lower threshold"),
    ],
)
def test_config_refuses_naming_the_field(overrides, message):
    with pytest.raises((ValueError, KeyError)) as e:
        with_overrides(preset("micro"), rl=overrides)
    assert message in str(e.value)


def test_config_refuses_what_is_not_wired():
    with pytest.raises(ValueError, match="rl.rollout_correction with oppo.inter"):
        with_overrides(preset("micro"), rl={"rollout_correction": "tis"}, oppo={"inter": True})
    with pytest.raises(ValueError, match="rl.rollout_correction with distributed.rollout_workers"):
        with_overrides(preset("micro"), rl={"rollout_correction": "tis"}, distributed={"rollout_workers": 1})
    # sync computes the trainer's log-probs in the trainer: fine with workers
    with_overrides(preset("micro"), rl={"rollout_correction": "tis", "variant": "sync"}, distributed={"rollout_workers": 1})
    with pytest.raises(ValueError, match="rollout.dtype is for the torch engine"):
        with_overrides(preset("micro"), rollout={"engine": "vllm", "dtype": "bfloat16"})
    with pytest.raises(ValueError, match="rollout.dtype: expected one of"):
        with_overrides(preset("micro"), rollout={"dtype": "float16"})


def test_bf16_torch_engine_samples_from_a_bf16_copy():
    cfg = with_overrides(preset("micro"), rollout={"dtype": "bfloat16"})
    policy, tok = build_tiny_model("micro", WORDS, seed=0)
    engine = build_engine(policy, tok, clone_state(policy), 0, cfg)
    assert next(engine.model.parameters()).dtype == torch.bfloat16 and next(policy.parameters()).dtype == torch.float32
    # each weight is the fp32 one rounded to bf16
    w32, w16 = policy.state_dict()["lm_head.weight"], engine.model.state_dict()["lm_head.weight"]
    assert torch.equal(w16, w32.to(torch.bfloat16)) and not torch.equal(w16.float(), w32)


def _micro_run(rl: dict, rollout: dict | None = None):
    # update_threads 1: sync's update would take every core, slow on a shared machine
    cfg = with_overrides(preset("micro"), rl={"steps": 2, **rl}, rollout=rollout or {}, update_threads=1)
    model, tok = build_tiny_model("micro", WORDS, seed=0)
    train, held, _ = load_rows(cfg.data, tok)
    return rl_train(cfg, model, tok, train, held, warmstart_acc=0.0)


@pytest.mark.parametrize("variant, mode", [("sync", "tis"), ("loglinear", "icepop"), ("recompute", "mis")])
def test_micro_run_per_method_logs_the_correction(core_stub_rewards, core_one_thread, variant, mode):
    res = _micro_run({"variant": variant, "rollout_correction": mode}, {"dtype": "bfloat16"})
    for h in res.history:
        # the bf16 engine differs from the fp32 trainer, a little: a mean |log ratio| above 0, far below 0.1
        assert 0.0 < h["rollout/behav_logp_abs_err"] < 0.1
        assert h["correction/ratio_p50"] <= h["correction/ratio_p99"] <= h["correction/ratio_max"]
        assert 0.0 <= h["correction/masked_frac"] <= 1.0 and 0.0 <= h["correction/seq_masked_frac"] <= 1.0
        assert math.isfinite(h["loss/policy"])
    assert ("correction/seq_ratio_p50" in res.history[0]) == (mode == "mis")


@pytest.mark.parametrize(
    "rl, forwards_per_step",
    [
        ({"variant": "sync"}, 2),  # the two minibatches' training forwards, nothing else: today's step
        ({"variant": "sync", "rollout_correction": "tis"}, 3),  # + one no-grad forward of the weights that sampled
        ({"variant": "sync", "proximal": "recompute"}, 3),  # the proximal forward...
        ({"variant": "sync", "proximal": "recompute", "rollout_correction": "tis"}, 3),  # ...is the trainer's log-prob: no more
    ],
)
def test_the_trainer_runs_an_extra_forward_only_where_a_correction_needs_one(core_stub_rewards, core_one_thread, monkeypatch, rl,
                                                                             forwards_per_step):
    import a3po.training.step as step

    calls = []
    real = step.token_logprobs
    monkeypatch.setattr(step, "token_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    res = _micro_run(rl)
    assert len(calls) == forwards_per_step * len(res.history)
    # none computes and logs nothing of the correction
    assert any(k.startswith("correction/") for k in res.history[0]) == ("rollout_correction" in rl)
    if rl.get("proximal") == "recompute" and "rollout_correction" in rl:
        # the trainer's behaviour log-prob is the proximal one: w' = pi_prox / pi_trainer(v) = 1 exactly (verl's decoupled mode)
        assert all(h["stability/behav_iw_max"] == 1.0 and h["stability/behav_iw_mean"] == 1.0 for h in res.history)


def test_tis_without_truncation_trains_as_none_up_to_rounding(core_stub_rewards, core_one_thread):
    # With no ratio above the cap, c = rho and w * c = (prox / trainer) * (trainer / engine) = prox / engine:
    # the loss of 'none' up to float rounding (a huge cap truncates nothing).
    base = _micro_run({"variant": "recompute"}, {"dtype": "bfloat16"})
    tis = _micro_run({"variant": "recompute", "rollout_correction": "tis", "rollout_correction_cap": 1e6}, {"dtype": "bfloat16"})
    assert all(h["correction/truncated_frac"] == 0.0 for h in tis.history)
    for a, b in zip(base.history, tis.history, strict=True):
        assert b["loss/policy"] == pytest.approx(a["loss/policy"], abs=1e-5)
