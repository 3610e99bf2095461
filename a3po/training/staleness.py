"""The staleness bound in force in a run: where it starts, the controller's move after each step
(``rl.staleness_control``; the rule is :mod:`a3po.algorithms.staleness`'s), the guard's ceiling
(``rl.guard_policy: tighten`` lowers it, and the bound never stays above it), and the metrics.

Every step logs ``staleness/bound`` (the bound for the batches admitted from now on) and
``staleness/bound_changed`` (+1, -1 or 0: this step's move, so the MLflow UI shows the moves); each
move is logged with its reason on the ``a3po.staleness`` logger, and handed as an
:class:`~a3po.training.actions.Action` to ``on_action`` (the run's actions). The loop hands a moved bound to the
producer's admission before it publishes the next version. A resumed run starts again from the
plan's start bound (as the guard's tightened bound starts again from ``rl.max_staleness``).
"""

from __future__ import annotations

import logging
from dataclasses import astuple

from a3po.algorithms.staleness import STALENESS_CONTROLS, BoundState, Decision, StepMeasures, next_bound
from a3po.config import RLConfig, RunPlan, staleness_settings
from a3po.parallel.ranks import Ranks
from a3po.training.actions import Action, OnAction
from a3po.training.guard import ApproximationGuard

log = logging.getLogger("a3po.staleness")


def step_measures(metrics: dict[str, float], wait_s: float) -> StepMeasures:
    """What the controller reads of a step: the trainer's idle fraction ``wait / (wait + step)``
    (``perf/idle_s`` over the step period, as :mod:`a3po.training.loop` measures them), the p99
    behaviour weight, and the guard's error where the guard checked the step."""
    period = max(wait_s + metrics["perf/step_time_s"], 1e-9)
    return StepMeasures(wait_s / period, metrics["stability/behav_iw_p99"], metrics.get("guard/abs_err_p99"))


class StalenessBound:
    """The run's bound in force: :attr:`bound`, within ``[1, ceiling]`` once it moves (the plan's
    ``max_staleness``, or the guard's bound when ``tighten`` lowered it). Under data parallelism
    every rank moves its bound on rank 0's measures (each rank's wait is its own)."""

    def __init__(self, rl: RLConfig, plan: RunPlan, guard: ApproximationGuard | None = None,
                 ranks: Ranks | None = None, on_action: OnAction | None = None) -> None:
        self.control_name, self.control = plan.staleness_control, STALENESS_CONTROLS.get(plan.staleness_control)
        self.settings, self.limit = staleness_settings(rl), plan.max_staleness
        self.guard = guard if guard is not None and guard.policy.tightens else None
        self.ranks = ranks if ranks is not None else Ranks()
        self.state = BoundState(plan.start_bound)
        self.on_action = on_action

    @property
    def bound(self) -> int:
        return self.state.bound

    @property
    def ceiling(self) -> int:
        return self.guard.bound if self.guard is not None else self.limit

    def after_step(self, version: int, metrics: dict[str, float], wait_s: float) -> dict[str, float]:
        """Move the bound after step ``version`` (0-based) that measured ``metrics`` and waited
        ``wait_s`` for its batch; returns the step's ``staleness/bound*`` metrics."""
        figures: dict[str, float] = {}
        if self.control.adapts:
            measures = StepMeasures(*self.ranks.from_main(list(astuple(step_measures(metrics, wait_s)))))
            decision = next_bound(self.state, measures, self.ceiling, self.settings)
            figures = {"trainer_idle_frac": measures.idle_frac, "stability/behav_iw_p99": measures.iw_p99}
            if measures.guard_err is not None:
                figures["guard/abs_err_p99"] = measures.guard_err
        elif self.bound > self.ceiling:  # fixed: only the guard moves it
            decision = Decision(BoundState(self.ceiling), self.ceiling - self.bound,
                                f"the guard lowered the bound to {self.ceiling}")
        else:
            decision = Decision(self.state, 0, "fixed")
        if decision.change and self.ranks.is_main:
            log.info("step %d: staleness bound %d -> %d (%s)", version + 1, self.bound, decision.state.bound,
                     decision.reason)
            if self.on_action is not None:
                self.on_action(Action(version + 1, "staleness", f"rl.staleness_control {self.control_name}",
                                      f"staleness bound {self.bound} -> {decision.state.bound}", decision.reason,
                                      {**figures, "staleness/bound": float(decision.state.bound)}))
        self.state = decision.state
        return {"staleness/bound": float(self.bound), "staleness/bound_changed": float(decision.change)}
