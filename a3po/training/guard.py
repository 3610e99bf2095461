"""The guard on loglinear's approximation in a run (``rl.guard_every``; the statistics, bounds and
policies are :mod:`a3po.algorithms.guard`'s).

On a checked step the trainer runs one no-grad forward of the weights before the update over the
rows of one minibatch (the step's first, drawn as the step draws it): the exact anchor of those
rows. The run's method builds its anchor from the same rows as it would for the step's first
minibatch (whose training forward runs on those weights), and the two are compared. So the guard's
extra work is one minibatch's forward every ``guard_every`` steps, whatever fires; only the
``recompute`` policy adds a full-batch forward, on the steps where it fires. The drift of the
training forward across a step's later minibatches is not part of what it measures.

Its figures and actions are metrics (``guard/*``, every checked step), a warning on the
``a3po.guard`` logger naming the step, the bounds crossed and the action, and the same as a row of
the run's actions (:mod:`a3po.training.actions`) where the loop keeps them.

A check that cannot compute its figure fires, never passes: a NaN statistic counts as over its
bound (:func:`a3po.algorithms.guard.over`), so the policy acts (``recompute`` trains the step on the
exact anchor, which holds where the approximation broke), and an exact forward that is itself
non-finite stops the run there with a line naming the step and the guard (no anchor is left to
train on).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from a3po.algorithms.checks import NonFiniteError
from a3po.algorithms.guard import GUARD_POLICIES, GuardBounds, GuardPolicy, approximation_stats, breaches, over
from a3po.algorithms.proximal import ProximalMethod, ProxInputs
from a3po.config import RLConfig
from a3po.devices import synchronize
from a3po.models.logprobs import token_logprobs
from a3po.parallel.ranks import Ranks
from a3po.producer.producer import ScoredBatch
from a3po.training.actions import Action, OnAction

log = logging.getLogger("a3po.guard")


@dataclass
class GuardVerdict:
    """A checked step's outcome: its ``guard/*`` figures, the bounds it crossed (empty: quiet) and
    the policy that then acts (None when quiet)."""

    metrics: dict[str, float]
    reasons: list[str] = field(default_factory=list)
    policy: GuardPolicy | None = None


class ApproximationGuard:
    """The run's guard: which steps it checks, the check, and the staleness bound it holds in force
    (lowered by the ``tighten`` policy; the loop hands a lowered bound to the producer's admission).
    ``on_action`` takes each firing's :class:`~a3po.training.actions.Action` on the main rank."""

    def __init__(self, rl: RLConfig, bound: int, on_action: OnAction | None = None) -> None:
        self.every, self.bounds = rl.guard_every, GuardBounds(rl.guard_max_err, rl.guard_max_iw)
        self.policy_name, self.policy = rl.guard_policy, GUARD_POLICIES.get(rl.guard_policy)
        self.bound = bound
        self.on_action = on_action

    def due(self, version: int) -> bool:
        """Whether step ``version`` (0-based: the guard_every-th, 2 guard_every-th ... steps) is checked."""
        return self.every > 0 and (version + 1) % self.every == 0

    def check(self, policy: torch.nn.Module, scored: ScoredBatch, rows: torch.Tensor, staleness: torch.Tensor,
              method: ProximalMethod, cfg: RLConfig, ranks: Ranks, version: int) -> GuardVerdict:
        """Compare ``method``'s anchor with the exact one on ``rows`` (call before the step's first update).
        Under data parallelism every rank runs the forward (a collective under ZeRO-3) and acts on rank 0's verdict."""
        batch = scored.rollout
        device = batch.input_ids.device
        synchronize(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            exact = token_logprobs(policy, batch.input_ids[rows], batch.attention_mask[rows], cfg.temperature,
                                   start=batch.prompt_len, share_prompt=cfg.shared_prompt_forward)
        mask, behav = batch.response_mask[rows], batch.behav_logp[rows]
        bad_exact = int((~torch.isfinite(exact) & mask.bool()).sum())
        local: dict[str, float] = {}
        if not bad_exact:
            # The step's first minibatch trains on these weights, so its training forward is `exact` here.
            approx, _ = method(ProxInputs(behav, exact, staleness[rows], mask, recompute_logp=lambda: exact))
            local = approximation_stats(approx, exact, behav, mask)
        stats, reasons, bad_exact = ranks.from_main([local, breaches(local, self.bounds) if local else [], bad_exact])
        if bad_exact:  # no anchor to fall back on: the weights being trained give NaN or inf themselves
            raise NonFiniteError(
                f"step {version + 1}: the guard's exact forward (rl.guard_every {self.every}: the weights before the "
                f"update) gave {bad_exact} non-finite log-prob(s) of the {int(mask.sum())} generated tokens checked; "
                "the policy cannot train on them, the run stops, its checkpoints hold the steps before")
        synchronize(device)
        metrics = {**stats, "guard/fired": float(bool(reasons)), "guard/recomputed": 0.0, "guard/tightened": 0.0,
                   # the reason, as MLflow shows it: which bound was crossed (a NaN figure counts as crossed)
                   "guard/over_max_err": float(over(stats["guard/abs_err_p99"], self.bounds.max_err)),
                   "guard/over_max_iw": float(over(stats["guard/behav_iw_p99"], self.bounds.max_iw)),
                   "guard/time_s": time.perf_counter() - t0}
        verdict = GuardVerdict(metrics, reasons, self.policy if reasons else None)
        if reasons:
            metrics["guard/recomputed"] = float(self.policy.anchor is not None)
            action = f"this step trains on the {self.policy.anchor} anchor" if self.policy.anchor else "no change"
            if self.policy.tightens:
                if self.bound > 1:
                    self.bound -= 1
                    metrics["guard/tightened"] = 1.0
                    action = f"staleness bound lowered to {self.bound} for the batches not yet admitted"
                else:
                    action = "staleness bound already 1: no change"
            if ranks.is_main:
                log.warning("step %d: the proximal approximation crossed its bounds (%s); rl.guard_policy %r: %s",
                            version + 1, "; ".join(reasons), self.policy_name, action)
                if self.on_action is not None:
                    figures = {**self._crossed(stats), "guard/bound": float(self.bound)}
                    self.on_action(Action(version + 1, "guard", f"rl.guard_policy {self.policy_name}", action,
                                          "; ".join(reasons), figures))
        metrics["guard/bound"] = float(self.bound)
        return verdict

    def _crossed(self, stats: dict[str, float]) -> dict[str, float]:
        """The figures of ``stats`` past their bounds, each with its bound."""
        out = {}
        if over(stats["guard/abs_err_p99"], self.bounds.max_err):
            out.update({"guard/abs_err_p99": stats["guard/abs_err_p99"], "rl.guard_max_err": self.bounds.max_err})
        if over(stats["guard/behav_iw_p99"], self.bounds.max_iw):
            out.update({"guard/behav_iw_p99": stats["guard/behav_iw_p99"], "rl.guard_max_iw": self.bounds.max_iw})
        return out
