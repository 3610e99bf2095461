"""The loop's held-out evaluations (:mod:`a3po.training.heldout`), in the trainer's thread or beside it.

``rl.eval_mode: inline`` (the default): the evaluation of version ``v`` runs in the trainer's thread
at step ``v``; rollouts that need a new version and the next update wait for all of it.

``rl.eval_mode: background``: at step ``v`` the trainer takes a snapshot of version ``v``
(:func:`a3po.models.factory.snapshot`: the trainable weights copied, the frozen ones shared, so with
LoRA the adapters alone) and a thread of its own evaluates it while rollouts and updates go on. The
record is the inline run's:

* the figures are the same bit for bit: the same weights, the fixed sampling seed, and the
  evaluating thread computes on the trainer thread's intra-op thread count (another count may
  round differently);
* they are logged at step ``v`` whatever the step at which they are collected (a second
  ``log_metrics`` call at step ``v`` when that step's line is out already; a metrics file then
  holds two lines of step ``v``, which its readers merge), and merged into step ``v``'s history
  entry; the eval curve and the completion table of step ``v`` are written when they are collected;
* at most one evaluation is in flight, so at most one snapshot is held: when the next one is due
  while one runs, the step waits for it;
* a finished evaluation is collected at the next step's end; the evaluations of earlier
  versions are collected before a checkpoint is written (it records the eval curve and the
  history), and all of them at the last step, whose own evaluation runs in the trainer's thread
  as inline (no snapshot);
* the evaluation of a checkpoint's own step ``v`` runs on beside training like any other: the
  checkpoint records it as pending (:class:`~a3po.training.run_state.PendingEvaluation`: version
  ``v``, whose weights it holds, and the training rows of step ``v``'s completion table, which
  exist only at the step). So that checkpoint holds one figure fewer than the inline run's of the
  same step (its eval curve ends before ``v``, its history entry of ``v`` has no ``eval/*``), the
  weights and the rest being equal (timings aside); the next checkpoint has those figures;
* a failure of the evaluation is raised in the trainer's thread when it is collected, naming the
  step (:class:`EvaluationFailed`);
* a process that dies with an evaluation in flight loses nothing. A version past the last
  checkpoint: its figures were not logged yet, and the resumed run trains those steps again and
  evaluates them again. The last checkpoint's own version, pending there: the resumed run
  evaluates the restored weights (version ``v``) first, in the trainer's thread
  (:meth:`Evaluations.resume`), logs the figures at step ``v`` by a call of their own (the
  rewound metrics file has step ``v``'s line without them) and writes step ``v``'s table from
  the saved training rows; its eval curve, history and tables are the inline run's;
* a stop of the trainer (Ctrl-C, a non-finite step, a full disk, any error) with an evaluation in
  flight cancels it at its next decode step and joins its thread before the error goes on
  (:meth:`Evaluations.close`), unrecorded: the process ends as the same stop ends it inline (a
  thread left in torch code at interpreter exit aborts the process), and the steps after the last
  checkpoint are redone on resume.

``time/eval_wait_s``: what each step spent on evaluations: the whole evaluation inline; the
snapshot and the waits for a running evaluation in background (0 where there is none).

The step-0 (warm start) evaluation stays inline: nothing trains beside it. Background mode is one
trainer process's thread: the config refuses it under DeepSpeed, where the figures are a collective
of the trainer ranks and ZeRO-3 partitions the weights.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from a3po.config import TrainConfig
from a3po.models.factory import snapshot
from a3po.parallel.ranks import Ranks
from a3po.parallel.updaters import Updater, plain_model
from a3po.producer.weight_store import WeightStore
from a3po.rollout.torch_engine import DecodingCancelled
from a3po.training.heldout import HeldOutEvaluation, heldout_evaluation
from a3po.training.run_state import PendingEvaluation


class HeldOut:
    """The held-out evaluation of the newest weights: rank 0 evaluates, every rank gets the
    figures. A ZeRO-3 policy is evaluated through a plain copy of its weights (its partitioned
    forward would wait for the other ranks' all-gathers)."""

    def __init__(self, cfg: TrainConfig, policy: torch.nn.Module, tokenizer, rows: list[dict], updater: Updater,
                 store: WeightStore, ranks: Ranks):
        self.cfg, self.policy, self.tokenizer, self.rows = cfg, policy, tokenizer, rows
        self.updater, self.store, self.ranks = updater, store, ranks
        self._copy: torch.nn.Module | None = None
        # the last evaluation's greedy answers and scores (rank 0)
        self.greedy: tuple[list[str], list[float]] | None = None

    def __call__(self) -> dict[str, float]:
        return self.ranks.from_main(self._evaluate() if self.ranks.is_main else None)

    def _evaluate(self) -> dict[str, float]:
        model = self.policy
        if self.updater.partitioned:
            model = self._copy = plain_model(self.policy, self.store.get(self.store.latest), self._copy)
        ev = self.evaluate(model)
        self.greedy = (ev.greedy, ev.greedy_scores)
        return ev.figures

    def evaluate(self, model: torch.nn.Module, cancel: threading.Event | None = None) -> HeldOutEvaluation:
        """The figures of ``model`` (any thread: it reads ``model`` alone); ``cancel`` set: it stops
        within a decode step (:class:`~a3po.rollout.torch_engine.DecodingCancelled`)."""
        return heldout_evaluation(model, self.tokenizer, self.rows, self.cfg, cancel=cancel)

    def snapshot(self) -> torch.nn.Module:
        """A copy of the newest weights that stays as it is while the policy trains on."""
        if self.updater.partitioned:
            raise RuntimeError("a ZeRO-3 policy has no whole weights to snapshot (rl.eval_mode 'background' is "
                               "refused under DeepSpeed)")
        return snapshot(self.policy)


@dataclass(frozen=True)
class Evaluated:
    """The held-out evaluation of ``version``: its figures (``eval/*``), the greedy answers and
    scores behind the greedy one, and the completion table's rows of the batch trained just before
    it (:meth:`a3po.training.completions.CompletionTables.training_rows`; None: no table)."""

    version: int
    figures: dict[str, float]
    greedy: tuple[list[str], list[float]] | None
    train_rows: list[dict] | None


class EvaluationFailed(RuntimeError):
    """A background held-out evaluation raised; the message names its step, the cause is chained."""


Evaluate = Callable[[torch.nn.Module, threading.Event], HeldOutEvaluation]


class _InFlight:
    """One evaluation running in a thread of its own on ``model`` (dropped when it ends); the
    trainer joins it, by :meth:`join` or, on a stop, :meth:`cancel`."""

    def __init__(self, version: int, train_rows: list[dict] | None, model: torch.nn.Module,
                 evaluate: Evaluate, threads: int) -> None:
        self.version, self.train_rows = version, train_rows
        self.result: HeldOutEvaluation | None = None
        self.error: Exception | None = None
        self._cancel = threading.Event()
        # A daemon only so that a trainer killed outright does not hang on it; every exit of the loop joins it.
        self.thread = threading.Thread(target=self._run, args=(model, evaluate, threads), daemon=True,
                                       name=f"heldout-eval-{version}")
        self.thread.start()

    def _run(self, model: torch.nn.Module, evaluate: Evaluate, threads: int) -> None:
        torch.set_num_threads(threads)  # the trainer thread's count: the inline figures' rounding
        try:
            self.result = evaluate(model, self._cancel)
        except DecodingCancelled:
            pass  # the trainer stopped: nothing to record
        except Exception as e:  # noqa: BLE001 - raised in the trainer's thread by join
            self.error = e

    def done(self) -> bool:
        return not self.thread.is_alive()

    def cancel(self) -> None:
        """Stop the evaluation at its next decode step and wait for its thread to end."""
        self._cancel.set()
        self.thread.join()

    def join(self) -> Evaluated:
        self.thread.join()
        if self.error is not None:
            raise EvaluationFailed(f"the background held-out evaluation of step {self.version} failed: "
                                   f"{type(self.error).__name__}: {self.error}") from self.error
        ev = self.result
        return Evaluated(self.version, ev.figures, (ev.greedy, ev.greedy_scores), self.train_rows)


class Evaluations:
    """The run's held-out evaluations after the warm start, inline or in the background (see the
    module's docstring); the loop calls :meth:`after_step` once per step."""

    def __init__(self, heldout: HeldOut, background: bool) -> None:
        if background and heldout.ranks.world_size > 1:
            raise RuntimeError("a background held-out evaluation runs in one trainer process; the config refuses "
                               "rl.eval_mode 'background' with several trainer ranks (distributed.deepspeed_config)")
        self.heldout, self.background = heldout, background
        self._running: _InFlight | None = None

    def after_step(self, version: int, train_rows: list[dict] | None, due: bool, settle: bool,
                   last: bool) -> tuple[list[Evaluated], float]:
        """At the end of the step that made ``version``: evaluate it when ``due`` (inline, and at the
        ``last`` step), or start its evaluation (background; ``train_rows``: its table's, kept till
        then); collect the evaluations finished by now, and those of earlier versions when
        ``settle`` (a checkpoint is written next, or the run ends). Returns those collected, oldest
        first, and the seconds the step spent on evaluations."""
        t0 = time.perf_counter()
        done: list[Evaluated] = []
        # One in flight at most (its snapshot goes before the next is taken); none past the last step.
        if self._running is not None and (due or settle or self._running.done()):
            done.append(self._collect())
        if due and self.background and not last:
            self._running = _InFlight(version, train_rows, self.heldout.snapshot(), self.heldout.evaluate,
                                      torch.get_num_threads())
        elif due:  # inline, or the last step, which waits for its evaluation anyway: no snapshot needed
            figures = self.heldout()
            done.append(Evaluated(version, figures, self.heldout.greedy, train_rows))
        return done, time.perf_counter() - t0

    def pending(self) -> PendingEvaluation | None:
        """The evaluation in flight, as a checkpoint written now records it (after a settling step:
        the evaluation of that step's own version)."""
        running = self._running
        return None if running is None else PendingEvaluation(running.version, running.train_rows)

    def resume(self, pending: PendingEvaluation) -> Evaluated:
        """The evaluation a checkpoint left pending, of the weights it restored (version
        ``pending.version``, not trained further yet), in this thread."""
        figures = self.heldout()
        return Evaluated(pending.version, figures, self.heldout.greedy, pending.train_rows)

    def close(self) -> None:
        """Cancel and join the evaluation in flight, if any (the trainer stops: its figures are
        not recorded). After the last step there is none: it has collected them all."""
        running, self._running = self._running, None
        if running is not None:
            running.cancel()

    def _collect(self) -> Evaluated:
        running, self._running = self._running, None
        return running.join()
