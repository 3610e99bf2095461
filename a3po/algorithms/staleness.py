"""Staleness that adapts: the bound on how many versions the producer may run ahead, moved between
steps by what the last step measured (``rl.staleness_control``, :data:`STALENESS_CONTROLS`).

A fixed bound ``s`` (``rl.max_staleness``) trades two costs it cannot see. Too low, and the trainer
waits for its batches; too high, and the samples are further off-policy: the behaviour weight
``w = pi_prox / pi_behav`` spreads, and loglinear's anchor moves away from the exact one. With
``adaptive`` the bound in force ``b`` moves within ``[1, c]`` after every step, one version at a
time, where the ceiling ``c`` is ``s``, or the guard's lowered bound when ``rl.guard_policy: tighten``
has lowered it (the guard is the hard limit, the controller moves below it).

What step ``t`` measured (:class:`StepMeasures`):

* ``idle``: the trainer's idle fraction, ``wait / (wait + step)``: the time it waited for the batch
  over its step period (``perf/idle_s``, ``perf/train_s``);
* ``iw``: the p99 of ``w`` over the step's tokens (``stability/behav_iw_p99``);
* ``err``: the guard's p99 |approximate - exact| anchor log-prob (``guard/abs_err_p99``), on the
  steps the guard checks (``rl.guard_every``); none on the others.

The step's signal, first match:

==========  =====================================================  ================================
signal      when                                                   why
==========  =====================================================  ================================
``lower``   ``iw > max_iw``, or ``err > max_err``                  samples too far off-policy
``raise``   ``idle > idle_frac`` and ``iw <= raise_iw``            the trainer waits, and the
                                                                   weights have room
``hold``    otherwise                                              ``raise_iw < iw <= max_iw`` is
                                                                   the band where nothing moves
==========  =====================================================  ================================

The streak ``n_t`` counts the steps in a row with the step's signal since the bound last changed
(a ``hold`` sets it to 0; the other signal starts it again at 1), and

    b_{t+1} = b_t - 1    if lower and n_t >= patience and b_t > 1
              b_t + 1    if raise and n_t >= patience and b_t < c
              b_t        otherwise;                 n = 0 after a change.

A bound above the ceiling (the guard has just lowered it) is set to the ceiling first, and that is
the step's one change. So the bound moves by at most one a step, never outside ``[1, c]``, and
after a move it holds for at least ``patience`` steps: the batches admitted under the old bound are
still being trained, and what the move did shows only after them. The band between ``raise_iw``
and ``max_iw`` and the patience keep the bound from moving back and forth every step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from a3po.registry import Registry


@dataclass(frozen=True)
class StalenessControl:
    """How a run's staleness bound is chosen (registered by name in :data:`STALENESS_CONTROLS`)."""

    adapts: bool
    """Whether the bound moves mid-run (:func:`next_bound` after each step); else it stays where it
    starts (only the guard's ``tighten`` lowers it)."""

    def start(self, max_staleness: int) -> int:
        """The bound of a run's first admissions. Fixed: ``max_staleness``. Adaptive: 1, and the bound
        rises only where a step measures that the trainer waits with the weights in their band: a
        run that starts at the top pays the staleness before any step has measured whether it buys
        anything, and lowers only after a step has crossed ``max_iw`` (the harm done first)."""
        return min(1, max_staleness) if self.adapts else max_staleness


STALENESS_CONTROLS: Registry[StalenessControl] = Registry("staleness control")
STALENESS_CONTROLS.register("fixed")(StalenessControl(adapts=False))
STALENESS_CONTROLS.register("adaptive")(StalenessControl(adapts=True))


@dataclass(frozen=True)
class StalenessSettings:
    """The controller's thresholds (``rl.staleness_*``; ``max_err`` is ``rl.guard_max_err``), with the
    defaults a config's null takes."""

    idle_frac: float = 0.1
    """Raise above this idle fraction: a tenth of the step period spent waiting."""
    max_iw: float = 2.0
    """Lower above this p99 weight: 1% of the tokens weigh more than double. Healthy loglinear runs of
    the tiny preset at bound 2 have a p99 near 1.06 (docs/history.md), so this is a limit, not a target."""
    raise_iw: float = 1.5
    """Raise only at or below this p99 weight (the band up to ``max_iw`` holds)."""
    max_err: float = 1.0
    """Lower above this guard error p99, nats (``rl.guard_max_err``'s default)."""
    patience: int = 2
    """Steps in a row a signal must hold before the bound moves."""


@dataclass(frozen=True)
class StepMeasures:
    """What one training step measured; ``guard_err`` None where the guard did not check the step."""

    idle_frac: float
    iw_p99: float
    guard_err: float | None = None


@dataclass(frozen=True)
class BoundState:
    """The bound in force and the streak of its signal (> 0: raise, < 0: lower, steps in a row)."""

    bound: int
    streak: int = 0


@dataclass(frozen=True)
class Decision:
    """The controller's answer: the next state, the change of the bound (+1, -1 or 0) and why."""

    state: BoundState
    change: int
    reason: str


def step_signal(m: StepMeasures, s: StalenessSettings) -> tuple[int, str]:
    """The step's signal (-1 lower, +1 raise, 0 hold) and the measures that decided it."""
    if m.iw_p99 > s.max_iw:
        return -1, f"stability/behav_iw_p99 {m.iw_p99:.4g} > rl.staleness_max_iw {s.max_iw:g}"
    if m.guard_err is not None and m.guard_err > s.max_err:
        return -1, f"guard/abs_err_p99 {m.guard_err:.4g} > rl.guard_max_err {s.max_err:g}"
    if m.idle_frac > s.idle_frac and m.iw_p99 <= s.raise_iw:
        return 1, (f"trainer idle {m.idle_frac:.3g} > rl.staleness_idle_frac {s.idle_frac:g}, "
                   f"stability/behav_iw_p99 {m.iw_p99:.4g} <= rl.staleness_raise_iw {s.raise_iw:g}")
    return 0, f"trainer idle {m.idle_frac:.3g}, stability/behav_iw_p99 {m.iw_p99:.4g}: hold"


def next_bound(state: BoundState, m: StepMeasures, ceiling: int, s: StalenessSettings) -> Decision:
    """The bound after a step that measured ``m`` (the rule of the module docstring), within
    ``[1, ceiling]``."""
    if ceiling < 1 or state.bound < 1:
        raise ValueError(f"an adaptive staleness bound lives in [1, ceiling], got bound {state.bound}, "
                         f"ceiling {ceiling}")
    if state.bound > ceiling:
        return Decision(BoundState(ceiling), ceiling - state.bound,
                        f"the ceiling fell to {ceiling} (the guard's tightened bound)")
    signal, why = step_signal(m, s)
    if signal == 0:
        return Decision(replace(state, streak=0), 0, why)
    streak = state.streak + signal if state.streak * signal > 0 else signal
    bound = state.bound + signal
    if abs(streak) < s.patience or not 1 <= bound <= ceiling:
        return Decision(BoundState(state.bound, streak), 0, why)
    return Decision(BoundState(bound), signal, f"{why} for {abs(streak)} step(s)")
