"""The adaptive staleness bound's rule (a3po.algorithms.staleness), step by step by hand.

Settings throughout: raise above idle 0.1 with the p99 weight <= 1.5, lower above a p99 weight of 2
or a guard error of 0.1 nats, patience 2 (a signal must hold 2 steps in a row before the bound moves).
"""

from __future__ import annotations

import pytest

from a3po.algorithms.staleness import STALENESS_CONTROLS, BoundState, StalenessSettings, StepMeasures, next_bound, step_signal

S = StalenessSettings(idle_frac=0.1, max_iw=2.0, raise_iw=1.5, max_err=0.1, patience=2)
IDLE = StepMeasures(idle_frac=0.4, iw_p99=1.0)  # the trainer waits 40% of its period, weights at 1: raise
BUSY = StepMeasures(idle_frac=0.05, iw_p99=1.0)  # waits 5%: hold
SPREAD = StepMeasures(idle_frac=0.4, iw_p99=2.5)  # p99 weight 2.5 > 2: lower, however idle
BAND = StepMeasures(idle_frac=0.4, iw_p99=1.8)  # idle, but 1.5 < 1.8 <= 2: the band, hold


def _run(bound: int, steps: list[StepMeasures], ceiling: int = 4, s: StalenessSettings = S) -> list[tuple[int, int]]:
    """(bound after the step, change) per step."""
    state, out = BoundState(bound), []
    for m in steps:
        d = next_bound(state, m, ceiling, s)
        state = d.state
        out.append((state.bound, d.change))
    return out


def test_idle_steps_raise_the_bound_one_at_a_time_after_the_patience():
    # streaks 1, 2 -> raise to 2 (streak 0), 1, 2 -> raise to 3, 1
    assert _run(1, [IDLE] * 5) == [(1, 0), (2, 1), (2, 0), (3, 1), (3, 0)]


def test_a_spread_of_the_weights_lowers_the_bound_whatever_the_idle_time():
    assert _run(3, [SPREAD] * 4) == [(3, 0), (2, -1), (2, 0), (1, -1)]
    assert step_signal(SPREAD, S) == (-1, "stability/behav_iw_p99 2.5 > rl.staleness_max_iw 2")


def test_the_guards_error_lowers_the_bound_on_the_steps_it_checks():
    checked = StepMeasures(idle_frac=0.4, iw_p99=1.0, guard_err=0.3)  # 0.3 nats > 0.1
    unchecked = StepMeasures(idle_frac=0.4, iw_p99=1.0, guard_err=None)  # an idle step the guard skipped
    quiet = StepMeasures(idle_frac=0.4, iw_p99=1.0, guard_err=0.05)
    assert step_signal(checked, S)[0] == -1 and step_signal(unchecked, S)[0] == 1 and step_signal(quiet, S)[0] == 1
    assert _run(3, [checked, checked]) == [(3, 0), (2, -1)]
    assert "guard/abs_err_p99 0.3 > rl.guard_max_err 0.1" in step_signal(checked, S)[1]


def test_the_band_and_busy_steps_hold_and_reset_the_streak():
    assert _run(2, [BAND] * 6) == [(2, 0)] * 6
    assert _run(2, [BUSY] * 6) == [(2, 0)] * 6
    # A hold between two idle steps: neither streak reaches 2.
    assert _run(2, [IDLE, BAND, IDLE, BUSY, IDLE]) == [(2, 0)] * 5
    # Signals that alternate never move it either (each restarts the other's streak at 1).
    assert _run(2, [IDLE, SPREAD] * 3) == [(2, 0)] * 6
    d = next_bound(BoundState(2, streak=1), SPREAD, 4, S)
    assert (d.state, d.change) == (BoundState(2, streak=-1), 0)


def test_the_bound_stays_within_one_and_the_ceiling():
    assert _run(4, [IDLE] * 6) == [(4, 0)] * 6  # at the ceiling
    assert _run(1, [SPREAD] * 6) == [(1, 0)] * 6  # at 1
    # The ceiling falls (the guard tightened to 3): the bound follows it first, that is the step's move.
    d = next_bound(BoundState(4, streak=1), IDLE, 3, S)
    assert (d.state, d.change) == (BoundState(3), -1) and "ceiling fell to 3" in d.reason
    with pytest.raises(ValueError, match="in \\[1, ceiling\\]"):
        next_bound(BoundState(1), IDLE, 0, S)


def test_patience_one_moves_on_every_step_with_a_signal():
    s1 = StalenessSettings(idle_frac=0.1, max_iw=2.0, raise_iw=1.5, max_err=0.1, patience=1)
    assert _run(1, [IDLE, IDLE, SPREAD, BAND, IDLE], s=s1) == [(2, 1), (3, 1), (2, -1), (2, 0), (3, 1)]


def test_where_each_control_starts():
    assert STALENESS_CONTROLS.names() == ["adaptive", "fixed"]
    assert [STALENESS_CONTROLS.get("adaptive").start(s) for s in (0, 1, 4)] == [0, 1, 1]
    assert [STALENESS_CONTROLS.get("fixed").start(s) for s in (0, 1, 4)] == [0, 1, 4]
    assert STALENESS_CONTROLS.get("adaptive").adapts and not STALENESS_CONTROLS.get("fixed").adapts
