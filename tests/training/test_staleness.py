"""The staleness bound in force in a run (a3po.training.staleness): the controller under the guard's
ceiling, fixed bounds, and a micro run whose adaptive bound is forced to rise, logged every step (each
move a row of the run's actions, with its reason) and admitted under by the producer."""

from __future__ import annotations

import logging
import time

import pytest

from a3po.config import RunPlan, config_from_dict, preset, with_overrides
from a3po.data.arithmetic import WORDS
from a3po.data.datasets import load_rows
from a3po.models.factory import build_tiny_model
from a3po.training import loop
from a3po.training.actions import read_actions
from a3po.training.guard import ApproximationGuard
from a3po.training.loop import rl_train
from a3po.training.staleness import StalenessBound, step_measures
from tests.support.producer_record import record_produced

pytestmark = pytest.mark.usefixtures("core_one_thread")

ADAPTIVE = {"variant": "loglinear", "staleness_control": "adaptive", "schedule": "threaded", "max_staleness": 4}
# The trainer waited 0.1 s for a 0.1 s step (idle 0.5 > 0.1) with weights at 1: a step that asks to raise.
IDLE = {"perf/step_time_s": 0.1, "stability/behav_iw_p99": 1.0}


def _bound(rl: dict) -> tuple[StalenessBound, ApproximationGuard | None]:
    cfg = config_from_dict({"rl": rl})
    guard = ApproximationGuard(cfg.rl, cfg.rl.max_staleness) if cfg.rl.guard_every else None
    return StalenessBound(cfg.rl, RunPlan.of(cfg, cores=1), guard), guard


def _steps(sb: StalenessBound, n: int, metrics: dict = IDLE, wait: float = 0.1, first: int = 0) -> list[tuple[float, float]]:
    out = []
    for v in range(first, first + n):
        m = sb.after_step(v, metrics, wait)
        out.append((m["staleness/bound"], m["staleness/bound_changed"]))
    return out


def test_the_step_measures_the_controller_reads():
    m = step_measures({**IDLE, "guard/abs_err_p99": 0.3}, wait_s=0.3)
    assert (m.idle_frac, m.iw_p99, m.guard_err) == (pytest.approx(0.75), 1.0, 0.3)  # 0.3 / (0.3 + 0.1)
    assert step_measures(IDLE, wait_s=0.0).guard_err is None  # a step the guard did not check


def test_the_guards_tightened_bound_is_the_controllers_ceiling():
    sb, guard = _bound({**ADAPTIVE, "guard_every": 1, "guard_policy": "tighten"})
    assert (sb.bound, sb.ceiling) == (1, 4)
    # Patience 2 (the default): idle steps raise the bound every second step.
    assert _steps(sb, 4) == [(1.0, 0.0), (2.0, 1.0), (2.0, 0.0), (3.0, 1.0)]
    guard.bound = 3  # the guard tightened 4 -> 3: the controller stays at or below 3 from now on
    assert _steps(sb, 3, first=4) == [(3.0, 0.0)] * 3
    guard.bound = 2  # below the bound in force: the bound follows at once, the step's one move
    assert _steps(sb, 1, first=7) == [(2.0, -1.0)]
    assert _steps(sb, 4, first=8) == [(2.0, 0.0)] * 4
    # The guard's error is a signal too: above rl.guard_max_err (1 nat) two steps in a row lower the bound.
    assert _steps(sb, 2, {**IDLE, "guard/abs_err_p99": 1.5}, first=12) == [(2.0, 0.0), (1.0, -1.0)]


def test_a_fixed_bound_moves_only_when_the_guard_lowers_it():
    sb, _ = _bound({"variant": "loglinear", "max_staleness": 4})
    assert _steps(sb, 3, wait=10.0) == [(4.0, 0.0)] * 3  # however long the trainer waits
    sb, guard = _bound({"variant": "loglinear", "max_staleness": 3, "schedule": "threaded", "guard_every": 1,
                        "guard_policy": "tighten"})
    guard.bound = 2
    assert _steps(sb, 2) == [(2.0, -1.0), (2.0, 0.0)]
    sync, _ = _bound({"variant": "sync"})
    assert _steps(sync, 2) == [(0.0, 0.0)] * 2


def test_an_adaptive_micro_run_raises_its_bound_and_the_producer_admits_under_it(core_stub_rewards, monkeypatch, caplog,
                                                                                 tmp_path):
    # Forced: any wait counts as idle (threshold 1e-6 of the step period), no weight lowers it (bound
    # 1e6), patience 1. So the bound goes 1 -> 2 (after step 1) -> 3 (after step 2), the ceiling.
    rl = {**ADAPTIVE, "max_staleness": 3, "steps": 8, "eval_every": 100, "staleness_idle_frac": 1e-6,
          "staleness_max_iw": 1e6, "staleness_raise_iw": 1e6, "staleness_patience": 1}
    cfg = with_overrides(preset("micro"), rl=rl)
    produced = record_produced(monkeypatch)
    train_step = loop.train_step

    ran_ahead = []

    def at_step_3_let_the_producer_run_ahead(model, optimizer, scored, step, *args, **kwargs):
        if step == 3:
            # Version 3 is the newest, bound 3: admission lets batches 0..6 in ((3 + 3 + 1) batches);
            # under the starting bound 1 only 0..4. Batch 6 is then sampled by version 3 alone.
            t0 = time.monotonic()
            while 6 not in produced and time.monotonic() - t0 < 30:
                time.sleep(0.01)
            ran_ahead.append(6 in produced)
        return train_step(model, optimizer, scored, step, *args, **kwargs)

    monkeypatch.setattr(loop, "train_step", at_step_3_let_the_producer_run_ahead)
    model, tok = build_tiny_model("micro", WORDS, seed=0)
    train, held, _ = load_rows(cfg.data, tok)
    with caplog.at_level(logging.INFO, logger="a3po.staleness"):
        history = rl_train(cfg, model, tok, train, held, warmstart_acc=0.0,
                           actions_path=str(tmp_path / "actions.jsonl")).history
    assert [h["staleness/bound"] for h in history] == [2.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0]
    assert [h["staleness/bound_changed"] for h in history] == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert "step 1: staleness bound 1 -> 2 (trainer idle" in caplog.text
    assert "step 2: staleness bound 2 -> 3" in caplog.text
    rows = read_actions(tmp_path / "actions.jsonl")  # the same moves, with their reasons and measures
    assert [(a.step, a.source, a.setting, a.action) for a in rows] == [
        (1, "staleness", "rl.staleness_control adaptive", "staleness bound 1 -> 2"),
        (2, "staleness", "rl.staleness_control adaptive", "staleness bound 2 -> 3")]
    for a, bound in zip(rows, (2.0, 3.0), strict=True):
        assert a.reason.startswith("trainer idle ") and "> rl.staleness_idle_frac 1e-06" in a.reason, a.reason
        assert a.figures["staleness/bound"] == bound and a.figures["trainer_idle_frac"] > 1e-6
        assert a.figures["stability/behav_iw_p99"] == history[a.step - 1]["stability/behav_iw_p99"]
    assert ran_ahead == [True]
    st_max = [h["staleness/max"] for h in history]
    # No batch is staler than the bound it was admitted under: 1 until step 1 ended, then 2, then 3.
    assert all(m <= b for m, b in zip(st_max, [1, 2, 3, 3, 3, 3, 3, 3], strict=True)), st_max
    assert st_max[6] == 3.0  # batch 6, sampled by version 3 and trained at version 6: the raised bound in use
