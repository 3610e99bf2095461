"""The ``reuse`` proximal method: recompute's exact anchor, read from the training forward, where a
step makes one update; refused where it makes several.

The batch is a real rollout of the "micro" model (``bench.prox_logp.make_scored_batch``), trained
on from weights moved away from the ones that sampled it, so the behaviour policy, the proximal
policy and any approximation between them differ measurably.
"""

from __future__ import annotations

import pytest
import torch

from a3po.algorithms.proximal import PROXIMAL_METHODS
from a3po.config import RLConfig, RunPlan, Variant, config_from_dict
from a3po.data.arithmetic import WORDS
from a3po.models.factory import build_tiny_model
from a3po.producer.weight_store import clone_state
from a3po.training.step import train_step
from bench.prox_logp import make_scored_batch

pytestmark = pytest.mark.usefixtures("core_one_thread")

N_PROMPTS, GROUP, MAX_NEW = 4, 2, 6


@pytest.fixture(scope="module")
def setup():
    model, tok = build_tiny_model("micro", WORDS, seed=0)
    scored = make_scored_batch(model, tok, N_PROMPTS, GROUP, MAX_NEW, seed=0, version=0)
    # The trainer's weights are the sampler's plus noise: the step trains on stale samples (d = 2).
    gen = torch.Generator().manual_seed(1)
    moved = {k: v + 0.05 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v
             for k, v in clone_state(model).items()}
    return model, scored, moved


def _step(model, init, scored, proximal, **kw):
    cfg = RLConfig(variant=Variant.LOGLINEAR, batch_prompts=N_PROMPTS, group_size=GROUP, max_new_tokens=MAX_NEW,
                   temperature=1.0, proximal=proximal, **{"minibatches": 1, **kw})
    model.load_state_dict(init)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)  # the update is -lr * (clipped) gradient
    calls = []
    handle = model.register_forward_pre_hook(lambda mod, args, kwargs: calls.append(kwargs["input_ids"].shape[0]),
                                             with_kwargs=True)
    try:
        metrics = train_step(model, opt, scored, 2, cfg, PROXIMAL_METHODS.get(proximal))
    finally:
        handle.remove()
    return metrics, calls, clone_state(model)


@pytest.mark.parametrize("shared", [False, True], ids=["plain", "shared_prompt"])
def test_reuse_is_recomputes_anchor_on_a_one_minibatch_step_without_its_forward(setup, shared):
    model, scored, init = setup
    m_rc, calls_rc, w_rc = _step(model, init, scored, "recompute", shared_prompt_forward=shared)
    m_re, calls_re, w_re = _step(model, init, scored, "reuse", shared_prompt_forward=shared)
    m_ll, calls_ll, _ = _step(model, init, scored, "loglinear", shared_prompt_forward=shared)
    # Model calls: recompute's full-batch no-grad forward, then the single minibatch's training forward
    # (two calls each with the shared prompt: the distinct prompts, then the rows); reuse and loglinear
    # run the training forward alone.
    one_pass = [N_PROMPTS, N_PROMPTS * GROUP] if shared else [N_PROMPTS * GROUP]
    assert calls_rc == one_pass + one_pass
    assert calls_re == calls_ll == one_pass
    # The same forward on the same weights gives the anchor: the loss and the behaviour weights to
    # float rounding (fp32, log-probs of magnitude < 10: ~1e-6), the trust ratio exactly 1.
    for key in ("loss/policy", "stability/behav_iw_mean", "stability/behav_iw_max", "policy/approx_kl"):
        assert m_re[key] == pytest.approx(m_rc[key], rel=1e-5, abs=1e-7), key
    assert m_re["stability/trust_ratio_max"] == pytest.approx(1.0, abs=1e-6)
    assert m_rc["stability/trust_ratio_max"] == pytest.approx(1.0, abs=1e-5)
    scale = max(float((w_rc[k] - init[k]).abs().max()) for k in init)
    assert scale > 1e-4  # the step moved the weights
    for k in init:
        torch.testing.assert_close(w_re[k] - init[k], w_rc[k] - init[k], rtol=0, atol=1e-4 * scale)
    # The test can tell anchors apart: loglinear's (a = 1/2 at d = 2) gives another loss here.
    assert abs(m_ll["loss/policy"] - m_rc["loss/policy"]) > 100 * abs(m_re["loss/policy"] - m_rc["loss/policy"]) + 1e-4


def test_reuse_is_refused_with_several_minibatches_naming_the_fields():
    with pytest.raises(ValueError, match=r"rl.proximal 'reuse'.*rl.minibatches 1, got 4"):
        RLConfig(proximal="reuse", minibatches=4)
    with pytest.raises(ValueError, match="rl.minibatches 1, got 2"):
        config_from_dict({"rl": {"proximal": "reuse", "minibatches": 2}})
    assert RLConfig(proximal="reuse", minibatches=1).minibatches == 1


def test_reuse_is_refused_with_lora_dropout():
    # The training forward drops adapter inputs: its log-probs are not the proximal policy's.
    with pytest.raises(ValueError, match="model.lora.dropout"):
        config_from_dict({"rl": {"proximal": "reuse", "minibatches": 1}, "model": {"lora": {"dropout": 0.1}}})
    config_from_dict({"rl": {"proximal": "reuse", "minibatches": 1}, "model": {"lora": {"dropout": 0.0}}})


def test_the_plan_of_a_reuse_run_runs_no_proximal_forward():
    plan = RunPlan.of(config_from_dict({"rl": {"proximal": "reuse", "minibatches": 1}}), cores=1)
    assert plan.proximal == "reuse" and plan.proximal_forward is False and plan.rescore is False
    recompute = RunPlan.of(config_from_dict({"rl": {"variant": "recompute", "minibatches": 1}}), cores=1)
    assert recompute.proximal_forward is True


def _model_folder(tmp_path, name, model):
    folder = tmp_path / name
    model.save_pretrained(folder, safe_serialization=True)
    return str(folder)


@pytest.fixture(scope="module")
def dropout_folders(tmp_path_factory):
    """Model folders whose training forward drops units: a Qwen2-shaped one with attention dropout
    0.5, GPT-2 with its own default dropouts (0.1 on residuals, embeddings and attention), and
    the Qwen2-shaped one with none."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tmp = tmp_path_factory.mktemp("dropout")
    model, _ = build_tiny_model("micro", WORDS, seed=0)
    none = _model_folder(tmp, "none", model)
    model.config.attention_dropout = 0.5
    attention = _model_folder(tmp, "attention", model)
    gpt2 = _model_folder(tmp, "gpt2", GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=len(WORDS) + 8)))
    return {"none": none, "attention": attention, "gpt2": gpt2}


@pytest.mark.parametrize("folder,words", [("attention", "attention_dropout 0.5"), ("gpt2", "resid_pdrop 0.1")])
def test_reuse_is_refused_on_a_model_with_dropout_naming_it(dropout_folders, folder, words):
    """reuse anchors on the training forward, run in training mode: with the model's own dropout
    that is a dropped-out forward (behav_iw_p99 1.07 at step 1 on-policy, where exact reads 1.0)."""
    from a3po.config import ConfigError
    from a3po.models.checks import check_model

    reuse = config_from_dict({"model": {"name": dropout_folders[folder]}, "rl": {"proximal": "reuse", "minibatches": 1}})
    with pytest.raises(ConfigError, match=rf"rl.proximal 'reuse' on model .*which has dropout \(.*{words}.*rl.proximal recompute"):
        check_model(reuse, WORDS)
    # the approximate and recomputed anchors do not read the training forward: accepted
    for proximal in ("recompute", "loglinear"):
        check_model(config_from_dict({"model": {"name": dropout_folders[folder]}, "rl": {"proximal": proximal}}), WORDS)


def test_reuse_is_accepted_on_a_model_without_dropout(dropout_folders):
    from a3po.models.checks import check_model, model_config, model_dropouts

    cfg = config_from_dict({"model": {"name": dropout_folders["none"]}, "rl": {"proximal": "reuse", "minibatches": 1}})
    assert check_model(cfg, WORDS) is cfg
    assert model_dropouts(*model_config(dropout_folders["none"], WORDS)) == {}
