"""The guard on loglinear's approximation (``rl.guard_every``): its statistics by hand, its cost (one
minibatch's forward on a checked step, none otherwise), its policies, and micro runs: quiet on a
healthy run, firing on one made to drift (a learning rate far too high, a large staleness bound),
each firing a row of the run's actions (a3po.training.actions), once each after a crash and resume.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from a3po.algorithms.guard import GUARD_POLICIES, GuardBounds, approximation_stats, breaches
from a3po.algorithms.minibatches import MINIBATCH_SPLITS
from a3po.algorithms.proximal import PROXIMAL_METHODS
from a3po.config import RLConfig, Variant, config_from_dict, preset, with_overrides
from a3po.data.arithmetic import WORDS
from a3po.data.datasets import load_rows
from a3po.models.factory import build_tiny_model
from a3po.producer.producer import Admission
from a3po.producer.weight_store import WeightStore, clone_state
from a3po.training.actions import read_actions
from a3po.training.guard import ApproximationGuard
from a3po.training.loop import rl_train
from a3po.training.step import minibatch_seed, train_step
from bench.prox_logp import make_scored_batch
from tests.support.resume import run_interrupted_and_resumed

pytestmark = pytest.mark.usefixtures("core_one_thread")

N_PROMPTS, GROUP, MAX_NEW = 4, 2, 6


# --- the statistics and bounds, by hand -----------------------------------------------------------


def test_approximation_stats_by_hand():
    # Four generated tokens and one pad column (ignored whatever it holds):
    #   approx - exact = [0.1, -0.2, 0, 0.4]  -> |err| mean 0.175, max 0.4
    #   exact - behav  = [0, log 2, 0, log 4] -> behav weight [1, 2, 1, 4], max 4
    # p99 of 4 sorted values v (linear interpolation at 0.99 * 3 = 2.97): v[2] + 0.97 (v[3] - v[2]).
    exact = torch.tensor([[-1.0, -2.0, -0.5, -3.0, 7.0]])
    approx = exact + torch.tensor([[0.1, -0.2, 0.0, 0.4, 9.0]])
    behav = exact - torch.tensor([[0.0, math.log(2), 0.0, math.log(4), 0.0]])
    mask = torch.tensor([[True, True, True, True, False]])
    s = approximation_stats(approx, exact, behav, mask)
    assert s["guard/abs_err_mean"] == pytest.approx(0.175, rel=1e-6)
    assert s["guard/abs_err_max"] == pytest.approx(0.4, rel=1e-6)
    assert s["guard/abs_err_p99"] == pytest.approx(0.2 + 0.97 * 0.2, rel=1e-5)
    iw_err = sorted(abs(math.exp(e) - 1) for e in (0.1, -0.2, 0.0, 0.4))
    assert s["guard/iw_err_p99"] == pytest.approx(iw_err[2] + 0.97 * (iw_err[3] - iw_err[2]), rel=1e-5)
    assert s["guard/behav_iw_max"] == pytest.approx(4.0, rel=1e-6)
    assert s["guard/behav_iw_p99"] == pytest.approx(2 + 0.97 * 2, rel=1e-5)
    assert s["guard/tokens"] == 4.0
    assert breaches(s, GuardBounds(max_err=0.5, max_iw=5.0)) == []
    reasons = breaches(s, GuardBounds(max_err=0.3, max_iw=3.0))
    assert len(reasons) == 2 and "rl.guard_max_err 0.3" in reasons[0] and "rl.guard_max_iw 3" in reasons[1]


def test_the_policies_are_a_registry_by_name():
    assert GUARD_POLICIES.names() == ["recompute", "tighten", "warn"]
    assert GUARD_POLICIES.get("recompute").anchor == "recompute" in PROXIMAL_METHODS
    assert GUARD_POLICIES.get("tighten").tightens and not GUARD_POLICIES.get("warn").tightens
    with pytest.raises(KeyError, match="rl.guard_policy: unknown guard policy 'stop'; valid: recompute, tighten, warn"):
        RLConfig(guard_every=1, guard_policy="stop")


@pytest.mark.parametrize("rl, match", [
    ({"guard_every": 2, "variant": "recompute"}, "rl.proximal 'recompute' is exact already"),
    ({"guard_every": 2, "proximal": "reuse", "minibatches": 1}, "rl.proximal 'reuse' is exact already"),
    ({"guard_every": 2, "variant": "sync"}, "rl.variant 'sync' trains on-policy"),
    ({"guard_every": 2, "max_staleness": 0}, "staleness bound 0"),
    ({"guard_every": -1}, "rl.guard_every must be >= 0"),
    ({"guard_max_iw": 1.0}, "rl.guard_max_iw > 1"),
    ({"guard_max_err": 0.0}, "rl.guard_max_err must be > 0"),
    ({"guard_every": 2, "guard_policy": "tighten"}, "rl.schedule 'deterministic'"),
])
def test_invalid_guard_settings_are_refused_naming_the_fields(rl, match):
    with pytest.raises(ValueError, match=match):
        config_from_dict({"rl": rl})


def test_tighten_runs_with_rollout_workers_under_the_threaded_schedule_only():
    # Workers take the lowered bound with the next version (a3po.placement.remote_rollouts).
    rl = {"guard_every": 2, "guard_policy": "tighten", "schedule": "threaded"}
    assert config_from_dict({"rl": rl, "distributed": {"rollout_workers": 1}}).rl.guard_policy == "tighten"
    with pytest.raises(ValueError, match="'tighten' with rl.schedule 'deterministic'"):
        config_from_dict({"rl": {**rl, "schedule": "deterministic"}, "distributed": {"rollout_workers": 1}})


def test_admission_lowers_its_bound_and_never_raises_it():
    store = WeightStore()
    admission = Admission(store, max_staleness=3, batch_size=8)
    assert admission.capacity(0) == 32
    admission.lower(1)
    assert admission.capacity(0) == 16  # (1 + 0 + 1) batches of 8
    with pytest.raises(ValueError, match="only be lowered, from 1, got 2"):
        admission.lower(2)


# --- one step: its cost and its policies ---------------------------------------------------------


@pytest.fixture(scope="module")
def setup():
    model, tok = build_tiny_model("micro", WORDS, seed=0)
    scored = make_scored_batch(model, tok, N_PROMPTS, GROUP, MAX_NEW, seed=0, version=0)
    sampler = clone_state(model)
    gen = torch.Generator().manual_seed(1)  # the trainer's weights far from the sampler's: loglinear strays
    moved = {k: v + 0.2 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v
             for k, v in sampler.items()}
    return model, scored, sampler, moved


def _step(model, weights, scored, version=2, proximal=None, guard_every=0, policy="warn", minibatches=2, method=None):
    cfg = RLConfig(variant=Variant.LOGLINEAR, batch_prompts=N_PROMPTS, group_size=GROUP, max_new_tokens=MAX_NEW,
                   temperature=1.0, minibatches=minibatches, shared_prompt_forward=False, proximal=proximal,
                   guard_every=guard_every, guard_policy=policy, max_staleness=4)
    model.load_state_dict(weights)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    guard = ApproximationGuard(cfg, cfg.max_staleness) if guard_every else None
    calls = []
    handle = model.register_forward_pre_hook(lambda mod, args, kwargs: calls.append(kwargs["input_ids"].shape[0]),
                                             with_kwargs=True)
    try:
        metrics = train_step(model, opt, scored, version, cfg, method or PROXIMAL_METHODS.get(proximal or "loglinear"),
                             guard=guard)
    finally:
        handle.remove()
    return metrics, calls


def test_a_checked_step_costs_one_minibatch_forward_and_an_unchecked_one_nothing(setup):
    model, scored, sampler, _ = setup
    n = N_PROMPTS * GROUP
    plain, calls_plain = _step(model, sampler, scored)
    # guard_every 3: step index 2 is the 3rd step (checked), index 3 is not.
    checked, calls_checked = _step(model, sampler, scored, version=2, guard_every=3)
    unchecked, calls_unchecked = _step(model, sampler, scored, version=3, guard_every=3)
    assert calls_plain == [n // 2, n // 2]  # two minibatches' training forwards
    assert calls_checked == [n // 2] + calls_plain  # + the guard's forward over one minibatch's rows
    assert calls_unchecked == calls_plain and not any(k.startswith("guard/") for k in unchecked)
    # Sampled by the weights being trained: loglinear's anchor is exact to rollout rounding; quiet.
    assert checked["guard/fired"] == 0.0 and checked["guard/abs_err_max"] < 1e-4
    assert checked["guard/behav_iw_max"] == pytest.approx(1.0, abs=1e-4)
    # The rows checked are the step's first minibatch, drawn as the step draws it.
    group_ids = torch.tensor([m["group"] for m in scored.rollout.meta])
    first = MINIBATCH_SPLITS.get("rows")(group_ids, torch.Generator().manual_seed(minibatch_seed(0, 2))).chunk(2)[0]
    assert checked["guard/tokens"] == float(scored.rollout.response_mask[first].sum()) > 0
    assert checked["loss/policy"] == plain["loss/policy"]  # the check changes nothing it does not act on


def test_warn_logs_the_reason_and_recompute_trains_the_step_on_the_exact_anchor(setup, caplog):
    model, scored, _, moved = setup
    loglinear, _ = _step(model, moved, scored)
    recompute, _ = _step(model, moved, scored, proximal="recompute")
    assert abs(loglinear["loss/policy"] - recompute["loss/policy"]) > 1e-3  # the anchors differ here
    with caplog.at_level(logging.WARNING, logger="a3po.guard"):
        warned, calls_warn = _step(model, moved, scored, guard_every=1)
    assert warned["guard/fired"] == 1.0 and warned["guard/abs_err_p99"] > 0.1 and warned["guard/recomputed"] == 0.0
    assert warned["guard/over_max_err"] == 1.0  # the reason, as a metric
    assert warned["loss/policy"] == loglinear["loss/policy"]
    assert "step 3: the proximal approximation crossed its bounds (guard/abs_err_p99" in caplog.text
    assert "rl.guard_policy 'warn': no change" in caplog.text
    fixed, calls_fixed = _step(model, moved, scored, guard_every=1, policy="recompute")
    assert fixed["guard/fired"] == fixed["guard/recomputed"] == 1.0
    # The step trained on recompute's anchor: its loss is recompute's (same forwards, same weights).
    assert fixed["loss/policy"] == pytest.approx(recompute["loss/policy"], rel=1e-6, abs=1e-8)
    assert len(calls_fixed) == len(calls_warn) + 1  # + the full-batch forward, on this step only


def test_a_check_that_cannot_compute_its_figure_fires_never_passes():
    # 200 tokens, one approximate log-prob NaN: sorted last, it sits above the p99, which stays small
    # and finite, so a rule reading the quantiles alone passes the step.
    exact = torch.full((1, 200), -1.0)
    approx = exact.clone()
    approx[0, 7] = float("nan")
    s = approximation_stats(approx, exact, exact, torch.ones(1, 200, dtype=torch.bool))
    assert math.isfinite(s["guard/abs_err_p99"]) and s["guard/abs_err_p99"] < 0.5
    assert s["guard/nonfinite_tokens"] == 1.0
    assert breaches(s, GuardBounds(max_err=0.5, max_iw=5.0)) == [
        "guard/nonfinite_tokens 1 of 200 checked: the anchor or behaviour log-probs hold NaN or inf"]
    # A NaN figure itself (NaN > bound is false): over its bound, named as NaN.
    nan = {"guard/abs_err_p99": float("nan"), "guard/behav_iw_p99": 1.0, "guard/tokens": 4.0}
    assert breaches(nan, GuardBounds(max_err=0.5, max_iw=5.0)) == [
        "guard/abs_err_p99 is NaN (the anchors compared hold NaN or inf): counted as over rl.guard_max_err 0.5"]


def test_a_nan_anchor_fires_the_guard_and_recompute_trains_the_step_on_the_exact_one(setup):
    model, scored, sampler, _ = setup
    loglinear = PROXIMAL_METHODS.get("loglinear")

    class Broken:  # loglinear, whose approximation breaks on one token; the exact forward is sound
        needs_forward, checks_behaviour, single_update = (loglinear.needs_forward, loglinear.checks_behaviour,
                                                          loglinear.single_update)

        def __call__(self, inputs):
            approx, info = loglinear(inputs)
            approx = approx.clone()
            approx[tuple(inputs.mask.bool().nonzero()[0].tolist())] = float("nan")
            return approx, info

    broken = Broken()

    recompute, _ = _step(model, sampler, scored, proximal="recompute")
    fixed, _ = _step(model, sampler, scored, guard_every=1, policy="recompute", method=broken)
    assert fixed["guard/fired"] == fixed["guard/recomputed"] == 1.0 and fixed["guard/nonfinite_tokens"] == 1.0
    assert fixed["loss/policy"] == pytest.approx(recompute["loss/policy"], rel=1e-6, abs=1e-8)


def test_an_exact_forward_that_is_not_finite_stops_the_step_naming_it_and_the_guard(setup, monkeypatch):
    import a3po.training.guard as guard_module
    from a3po.algorithms.checks import NonFiniteError

    model, scored, sampler, _ = setup
    real = guard_module.token_logprobs
    monkeypatch.setattr(guard_module, "token_logprobs", lambda *a, **k: real(*a, **k) * float("nan"))
    with pytest.raises(NonFiniteError, match=r"^step 3: the guard's exact forward \(rl.guard_every 1: .* gave \d+ "
                                             r"non-finite log-prob\(s\)"):
        _step(model, sampler, scored, guard_every=1, policy="recompute")


# --- micro runs ----------------------------------------------------------------------------------


def _result(actions=None, ckpt_dir=None, progress=None, **rl):
    cfg = with_overrides(preset("micro"), rl={"steps": 8, "eval_every": 100, "guard_every": 1, **rl})
    model, tok = build_tiny_model("micro", WORDS, seed=0)
    train, held, _ = load_rows(cfg.data, tok)
    return rl_train(cfg, model, tok, train, held, warmstart_acc=0.0, ckpt_dir=ckpt_dir, progress=progress,
                    actions_path=str(actions) if actions else None)


def _run(actions=None, **rl):
    return _result(actions, **rl).history


DRIFT = {"lr": 0.05, "lr_warmup_steps": 0, "lr_schedule": "constant", "max_staleness": 4}


def test_the_guard_is_quiet_on_a_healthy_run_and_fires_on_one_made_to_drift(core_stub_rewards, tmp_path):
    healthy = _run(tmp_path / "healthy.jsonl", max_staleness=2)
    assert all(h["guard/fired"] == h["guard/over_max_err"] == h["guard/over_max_iw"] == 0.0 for h in healthy)
    assert max(h["guard/abs_err_p99"] for h in healthy) < 0.01  # lr 1e-4: the policy barely moves per version
    assert max(h["staleness/max"] for h in healthy) == 2.0  # stale tokens were checked
    assert read_actions(tmp_path / "healthy.jsonl") == []  # nothing done, nothing recorded
    drift = _run(tmp_path / "actions.jsonl", **DRIFT)
    fired = [h["guard/fired"] for h in drift]
    assert fired[0] == 0.0  # step 1: every token on-policy, nothing to approximate
    assert all(f == 1.0 for f in fired[1:])  # lr 0.05: |error| p99 of 1.4-4 nats (see docs/variants.md)
    assert all(h["guard/bound"] == 4.0 and h["guard/recomputed"] == 0.0 for h in drift)  # 'warn' changes nothing
    # Each firing is a row: its step, the bound crossed with the figure that crossed it, and the action.
    rows = read_actions(tmp_path / "actions.jsonl")
    assert [a.step for a in rows] == [2, 3, 4, 5, 6, 7, 8]
    for a in rows:
        err = drift[a.step - 1]["guard/abs_err_p99"]
        assert (a.source, a.setting, a.action) == ("guard", "rl.guard_policy warn", "no change")
        assert a.reason.startswith(f"guard/abs_err_p99 {err:.4g} > rl.guard_max_err 1"), a.reason
        assert a.figures["guard/abs_err_p99"] == err and a.figures["rl.guard_max_err"] == 1.0
        assert a.figures["guard/bound"] == 4.0


def test_a_resumed_run_records_each_action_once(core_stub_rewards, tmp_path):
    # Crash after step 3 (rows of steps 2 and 3 written, checkpoint at 2): the resumed run drops the row
    # of step 3 and records steps 3 to 6 again, so each step's firing is there once.
    path = tmp_path / "actions.jsonl"
    res = run_interrupted_and_resumed(
        lambda ckpt, progress: _result(path, ckpt, progress, **DRIFT, steps=6, checkpoint_every=2), tmp_path / "ckpt", 3)
    assert res.resumed_from == 2
    rows = read_actions(path)
    assert [a.step for a in rows] == [2, 3, 4, 5, 6]
    # the resumed history: steps 1-2 restored from the checkpoint, 3-6 trained again
    assert [a.figures["guard/abs_err_p99"] for a in rows] == [h["guard/abs_err_p99"] for h in res.history[1:]]


def test_a_step_that_crashes_after_the_guard_fired_leaves_no_row(core_stub_rewards, tmp_path, monkeypatch):
    # Step 4's update runs (the guard fires and records), then the step dies before its metrics line:
    # the rows are those of the steps that happened, 2 and 3.
    import a3po.training.loop as loop

    real = loop.train_step

    def dies_on_step_4(*args, **kwargs):
        metrics = real(*args, **kwargs)
        if args[3] == 3:  # (model, updater, batch, step, ...): the 0-based step of step 4
            raise RuntimeError("killed mid-step")
        return metrics

    monkeypatch.setattr(loop, "train_step", dies_on_step_4)
    with pytest.raises(RuntimeError, match="killed mid-step"):
        _run(tmp_path / "actions.jsonl", **DRIFT)
    assert [a.step for a in read_actions(tmp_path / "actions.jsonl")] == [2, 3]


def test_tighten_lowers_the_bound_the_producer_admits_under(core_stub_rewards, tmp_path):
    history = _run(tmp_path / "actions.jsonl",
                   **{**DRIFT, "max_staleness": 3, "schedule": "threaded", "guard_policy": "tighten", "steps": 12})
    bounds = [h["guard/bound"] for h in history]
    assert bounds == sorted(bounds, reverse=True) and bounds[-1] == 1.0  # lowered one at a time, never below 1
    lowered_at = bounds.index(1.0)  # step index where the bound reached 1
    # Batches admitted before (up to 3 ahead, the old bound) are trained as they were; every later one
    # is at most 1 version stale.
    assert all(h["staleness/max"] <= 1.0 for h in history[lowered_at + 4:])
    assert len(history[lowered_at + 4:]) >= 3
    assert sum(h["guard/tightened"] for h in history) == 2.0  # 3 -> 2 -> 1
    # The rows: every firing of the guard, and each move of the bound in force that follows it.
    rows = read_actions(tmp_path / "actions.jsonl")
    guard = [a for a in rows if a.source == "guard"]
    assert [a.step for a in guard] == [i + 1 for i, h in enumerate(history) if h["guard/fired"]]
    assert all(a.setting == "rl.guard_policy tighten" for a in guard)
    tightened = [i + 1 for i, h in enumerate(history) if h["guard/tightened"]]
    assert [(a.step, a.action, a.figures["guard/bound"]) for a in guard if "lowered" in a.action] == [
        (tightened[0], "staleness bound lowered to 2 for the batches not yet admitted", 2.0),
        (tightened[1], "staleness bound lowered to 1 for the batches not yet admitted", 1.0)]
    assert all(a.action == "staleness bound already 1: no change" for a in guard if a.step > tightened[1])
    assert [(a.step, a.setting, a.action, a.reason) for a in rows if a.source == "staleness"] == [
        (tightened[0], "rl.staleness_control fixed", "staleness bound 3 -> 2", "the guard lowered the bound to 2"),
        (tightened[1], "rl.staleness_control fixed", "staleness bound 2 -> 1", "the guard lowered the bound to 1")]
