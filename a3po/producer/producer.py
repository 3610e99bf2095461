"""The asynchronous rollout producer: a thread generates rollouts while the trainer consumes
them, with a bound on how stale a sample may be.

* :class:`~a3po.producer.weight_store.WeightStore` holds versioned policy weights. The trainer
  publishes version ``v+1`` after each update; the producer loads new versions, also between
  decode steps of a batch already under way, so a sequence can mix tokens of two versions (each
  token records its own). The store keeps a version only while a batch not yet trained can read
  it (:class:`~a3po.producer.weight_store.Retention`).
* :class:`Admission` is the staleness bound: never more samples admitted than
  ``(max_staleness + version + 1) * batch_size``. ``max_staleness = 0`` is synchronous RL. Under
  the threaded schedule the trainer may move the bound between steps (:meth:`RolloutProducer.set_bound`:
  the guard's ``tighten``, ``rl.staleness_control: adaptive``).
* Two schedules. ``threaded``: the producer free-runs (loads the newest weights whenever they
  appear). ``deterministic``: the same threads, but batch ``j`` always starts on version
  ``max(0, j - s)`` and switches to ``j - s + 1`` halfway through decoding, the point where the
  trainer finishes its concurrent step in the steady state. Runs are then reproducible bit for
  bit, and a run resumed from a checkpoint equals an uninterrupted one.
* With ``mid_batch_updates=False`` (``rollout.weight_updates: batch``, the only mode of engines
  such as vLLM that cannot swap weights inside a batch) weights change only between batches:
  ``deterministic`` runs batch ``j`` on version ``max(0, j - s)`` from its first token to its
  last (so from step ``s`` on every token is ``s`` versions stale, where the mid-batch switch
  makes half of them ``s - 1``: another trajectory than the default), ``threaded`` loads the
  newest version when a batch starts.
* Work beside decoding (scoring the tokens with other models as they come) plugs in as a
  :class:`StreamHook`; a producer with another batching rule subclasses :class:`RolloutProducer`.
"""

from __future__ import annotations

import queue
import random
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from a3po.data.prompts import PromptStyle
from a3po.grading.rewards import grader_counts
from a3po.producer.group_filter import Drawn, GroupFilter, assemble, refill_picks, refill_seed, signal_of
from a3po.producer.weight_store import Stopped, WeightStore
from a3po.rollout.types import Engine, RolloutBatch, SamplingParams


def batch_seed(seed: int, index: int) -> int:
    """Seed of batch ``index``'s sampling (not ``hash()``: Python salts string hashes per process)."""
    return (seed * 1_000_003 + index * 7919 + 17) % (2**31 - 1)


DEFAULT_STYLE = PromptStyle()


class Admission:
    """Staleness bound by admission control, counted in samples. The bound in force,
    ``max_staleness``, may move mid-run within ``[0, limit]`` (:meth:`set_bound`), ``limit`` being the
    bound the run's store was built for (default: the starting bound)."""

    def __init__(self, store: WeightStore, max_staleness: int, batch_size: int, admitted: int = 0,
                 limit: int | None = None) -> None:
        self.store, self.max_staleness, self.batch_size = store, max_staleness, batch_size
        self.limit = max_staleness if limit is None else limit
        if not 0 <= max_staleness <= self.limit:
            raise ValueError(f"staleness bound {max_staleness} outside [0, {self.limit}]")
        self.admitted = admitted

    def capacity(self, version: int) -> int:
        return (self.max_staleness + version + 1) * self.batch_size

    def set_bound(self, bound: int) -> None:
        """The bound for every admission from now on, within ``[0, limit]``. Samples already admitted
        stay. A waiting :meth:`admit` re-reads the bound under the store's lock: a lowered one at its
        next check, a raised one at once (the waiters are woken: more samples may fit now)."""
        with self.store.cond:
            if not 0 <= bound <= self.limit:
                raise ValueError(f"the staleness bound moves within [0, {self.limit}] (the bound the weight store "
                                 f"was built for), got {bound}")
            self.max_staleness = bound
            self.store.cond.notify_all()

    def lower(self, bound: int) -> None:
        """Lower the bound for every admission from now on (the guard's ``tighten``); see :meth:`set_bound`."""
        with self.store.cond:
            if not 0 <= bound <= self.max_staleness:
                raise ValueError(f"the staleness bound can only be lowered, from {self.max_staleness}, got {bound}")
            self.set_bound(bound)

    def admit(self, n: int) -> None:
        """Block until ``n`` more samples fit under the bound for the current version."""
        self.store.wait_until(lambda: self.admitted + n <= self.capacity(self.store.latest))
        self.admitted += n

    def admit_batch(self, index: int, n: int) -> None:
        """Batch ``index`` of ``n`` samples (batches all have ``n``): every batch before it counts
        as admitted, whoever generated it (rollout workers each take every k-th batch)."""
        # the bound counts batches of batch_size: another size would let the producer run ahead
        if n != self.batch_size:
            raise ValueError(f"batch {index} has {n} samples but admission counts batches of {self.batch_size}")
        self.admitted = index * n
        self.admit(n)


class PromptSampler:
    """Batch ``j`` is a function of (seed, j) alone, so a resumed run draws the same prompts.
    Prompts are formatted by ``style`` (chat template, instruction) before tokenising."""

    def __init__(self, rows: list[dict], tokenizer, batch_prompts: int, group_size: int, seed: int,
                 style: PromptStyle = DEFAULT_STYLE) -> None:
        if batch_prompts > len(rows):  # a batch cut to the rows would be smaller than the size admission counts
            raise ValueError(f"{len(rows)} training rows, fewer than the {batch_prompts} distinct prompts of a "
                             "batch (rl.batch_prompts)")
        self.rows, self.batch_prompts, self.group_size, self.seed = rows, batch_prompts, group_size, seed
        self._ids = [tokenizer(style.render(r["prompt"], tokenizer), add_special_tokens=False)["input_ids"]
                     for r in rows]

    def picks(self, j: int) -> list[int]:
        """The row indices of batch ``j``'s prompts."""
        return random.Random(f"{self.seed}:prompts:{j}").sample(range(len(self.rows)), self.batch_prompts)

    def batch(self, j: int) -> tuple[list[list[int]], list[dict]]:
        return self.groups(self.picks(j), j * self.batch_prompts)

    def groups(self, picks: list[int], first_group: int) -> tuple[list[list[int]], list[dict]]:
        """Each row of ``picks`` ``group_size`` times, the groups numbered from ``first_group``."""
        prompts, meta = [], []
        for g, i in enumerate(picks):
            for _ in range(self.group_size):
                prompts.append(self._ids[i])
                meta.append({"id": self.rows[i]["id"], "gold": self.rows[i]["gold"], "group": first_group + g})
        return prompts, meta


class StreamHook(Protocol):
    """Work done beside decoding, fed token by token (e.g. reference, critic and reward-model
    scores computed while the policy decodes). The producer calls, per batch: :meth:`begin` before
    decoding (the ``on_token`` hook it returns goes to the engine), :meth:`finish` after it,
    :meth:`record` with the batch's production time, and :meth:`state_dict` for the batch's
    checkpoint."""

    def begin(self, prompts: list[list[int]], version: int) -> Callable: ...

    def finish(self, input_ids: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, float]]: ...

    def record(self, seconds: float, generated_tokens: int, mean_length: float) -> None: ...

    def state_dict(self) -> dict: ...


@dataclass
class ScoredBatch:
    index: int
    rollout: RolloutBatch
    rewards: torch.Tensor  # (N,)
    completions: list[str]
    gen_time_s: float
    grader: dict[str, int] = field(default_factory=dict)  # the grader's counters for this batch (grader/*)
    metrics: dict[str, float] = field(default_factory=dict)  # the producer's own per-batch figures (perf/*, the hook's)
    # JSON state of the producer after this batch (e.g. a carry-over buffer), for checkpoints
    producer_state: dict | None = None
    stream_state: dict | None = None  # JSON state of the stream hook after this batch, for checkpoints
    # what the stream hook scored while decoding (e.g. ref_logp, values, scores)
    streamed: dict[str, torch.Tensor] = field(default_factory=dict)


class ProducerFailed(RuntimeError):
    pass


class RolloutProducer(threading.Thread):
    """Generates batches ``start, start + stride, ...`` (before ``end`` when given) into ``out``
    under the admission bound. In a trainer process: every batch; in one of k rollout workers
    (:mod:`a3po.placement.worker_loop`): every k-th. Subclasses change how a batch is
    generated (:meth:`_produce_next`) and share how it is scored (:meth:`_score`)."""

    def __init__(
        self,
        engine: Engine,
        store: WeightStore,
        admission: Admission,
        sampler: PromptSampler,
        params: SamplingParams,
        score: Callable[[list[str], list[dict]], list[float]],
        decode: Callable[[list[int]], str],
        max_staleness: int,
        schedule: str,
        seed: int,
        start: int = 0,
        stride: int = 1,
        end: int | None = None,
        mid_batch_updates: bool = True,
        check: Callable[[RolloutBatch], dict[str, float | torch.Tensor]] | None = None,
        stream: StreamHook | None = None,
        threads: int | None = None,
        group_filter: GroupFilter | None = None,
    ) -> None:
        super().__init__(name="rollout-producer", daemon=True)
        self.stream, self.group_filter = stream, group_filter
        if group_filter is not None and stream is not None:  # the config refuses it (rl.filter_groups)
            raise ValueError("the group filter grades whole batches: it cannot refill a batch scored while decoding")
        if mid_batch_updates and not engine.mid_batch_updates:
            raise ValueError(f"{type(engine).__name__} cannot swap weights inside a batch; use mid_batch_updates=False")
        self.mid_batch_updates, self.check = mid_batch_updates, check
        self.engine, self.store, self.admission, self.sampler = engine, store, admission, sampler
        self.params, self.score, self.decode = params, score, decode
        self.max_staleness, self.schedule, self.seed, self.next_index = max_staleness, schedule, seed, start
        self.stride, self.end = stride, end
        self.out: queue.Queue[ScoredBatch | ProducerFailed] = queue.Queue()
        self._halt = threading.Event()
        # Decode on ``threads`` (default: the builder's count), whatever the trainer thread sets later
        # (a3po.placement.cores).
        self.threads = threads or torch.get_num_threads()
        self._hold_key = f"producer-{id(self)}"
        self._hold(engine.version)

    def _hold(self, version: int) -> None:
        # Threaded: the store keeps what this batch may load from here on (see Retention).
        if self.store.retention is not None and self.schedule == "threaded":
            self.store.retention.hold(self._hold_key, version)

    def _load(self, version: int) -> None:
        if version != self.engine.version:
            self.engine.load_weights(self.store.get(version), version)

    def _load_start(self, j: int) -> None:
        """The version batch ``j`` starts on."""
        self._load(max(0, j - self.max_staleness) if self.schedule == "deterministic" else self.store.latest)
        self._hold(self.engine.version)

    def _between_steps(self, j: int) -> Callable[[int], int | None]:
        if self.schedule == "deterministic":
            switch_to, switch_at = j - self.max_staleness + 1, self.params.max_new_tokens // 2

            def hook(t: int) -> int | None:
                # The trainer's concurrent step (on batch j - s) lands halfway through batch j.
                if self.max_staleness >= 1 and switch_to >= 1 and t == switch_at:
                    self._load(switch_to)
                    return switch_to
                return None
        else:

            def hook(t: int) -> int | None:
                latest = self.store.latest
                if latest > self.engine.version:
                    self._load(latest)
                    return latest
                return None

        return hook

    def _produce_next(self, j: int) -> ScoredBatch:
        prompts, meta = self.sampler.batch(j)
        self.admission.admit_batch(j, len(prompts))
        self._load_start(j)
        t0 = time.perf_counter()
        hook = self._between_steps(j) if self.mid_batch_updates else None
        on_token = self.stream.begin(prompts, self.engine.version) if self.stream is not None else None
        rollout = self.engine.generate_batch(prompts, self.params, batch_seed(self.seed, j), between_steps=hook,
                                             meta=meta, on_token=on_token)
        streamed, stream_metrics = self.stream.finish(rollout.input_ids) if self.stream is not None else ({}, {})
        scored = self._score(j, rollout, t0, streamed, stream_metrics, record_stream=True)
        if self.group_filter is not None:
            scored = self._refill(j, scored, t0)
        if self.check is not None:  # e.g. the engine's log-prob mismatch (rollout/*); not part of the producing time
            # figures to metrics, per-token tensors beside the streamed ones
            for name, value in self.check(rollout).items():
                (scored.streamed if isinstance(value, torch.Tensor) else scored.metrics)[name] = value
        return scored

    def _refill(self, j: int, scored: ScoredBatch, t0: float) -> ScoredBatch:
        """Batch ``j`` with its groups without signal replaced by refills (:mod:`a3po.producer.group_filter`),
        each round sampled on the weights the engine holds after the batch (threaded: the newest
        published), never older ones."""
        b = self.sampler.batch_prompts
        draws = [Drawn(scored.rollout, scored.rewards, scored.completions)]
        drawn_rows, n_drawn, kept = set(self.sampler.picks(j)), b, sum(signal_of(draws[0]).values())
        grader, score_s, t_refill, round_ = dict(scored.grader), scored.metrics["perf/score_s"], time.perf_counter(), 0
        while kept < b and n_drawn < self.group_filter.max_prompts:
            round_ += 1
            n = min(b - kept, self.group_filter.max_prompts - n_drawn)
            picks = refill_picks(len(self.sampler.rows), n, self.seed, j, round_, drawn_rows)
            # numbered after every batch's groups: unique within the step, renumbered by assemble
            prompts, meta = self.sampler.groups(picks, (j + 1) * b + n_drawn)
            if self.schedule == "threaded":  # the batch's hold keeps every version from its start on
                self._load(self.store.latest)
            rollout = self.engine.generate_batch(prompts, self.params, refill_seed(self.seed, j, round_), meta=meta)
            extra = self._score(j, rollout, time.perf_counter(), {}, {})
            draws.append(Drawn(extra.rollout, extra.rewards, extra.completions))
            for name, count in extra.grader.items():
                grader[name] = grader.get(name, 0) + count
            score_s += extra.metrics["perf/score_s"]
            drawn_rows.update(picks)
            n_drawn += n
            kept += sum(signal_of(draws[-1]).values())
        batch, figures = assemble(draws, b, j, self.engine.pad_token_id)
        now = time.perf_counter()
        metrics = {**scored.metrics, **figures, "perf/score_s": score_s, "filter/refill_gen_s": now - t_refill}
        return ScoredBatch(j, batch.rollout, batch.rewards, batch.completions, now - t0, grader, metrics,
                           stream_state=scored.stream_state)

    def _score(
        self, j: int, rollout: RolloutBatch, t0: float, streamed: dict[str, torch.Tensor], metrics: dict[str, float],
        record_stream: bool = False
    ) -> ScoredBatch:
        """The shared tail: decode, grade, and pack batch ``j``; its ``gen_time_s`` runs from ``t0``
        (generation began) to graded, and ``perf/score_s`` is the grading part of it. With
        ``record_stream`` the stream hook (e.g. a chunk-size tuner) is told the producing time per
        generated token: generation and decoding, ``gen_time_s - perf/score_s``."""
        completions = [self.decode(r) for r in rollout.responses]
        t1 = time.perf_counter()
        if record_stream and self.stream is not None:
            n_gen = int(rollout.response_mask.sum())
            self.stream.record(t1 - t0, n_gen, n_gen / len(rollout))
        with grader_counts() as grader:
            rewards = torch.tensor(self.score(completions, rollout.meta), dtype=torch.float32,
                                   device=rollout.input_ids.device)
        t2 = time.perf_counter()
        return ScoredBatch(j, rollout, rewards, completions, t2 - t0, grader,
                           metrics={"perf/score_s": t2 - t1, **metrics}, streamed=streamed,
                           stream_state=self.stream.state_dict() if self.stream is not None else None)

    def run(self) -> None:
        torch.set_num_threads(self.threads)
        try:
            while not self._halt.is_set() and (self.end is None or self.next_index < self.end):
                j = self.next_index
                self.out.put(self._produce_next(j))
                self.next_index = j + self.stride
        except Stopped:
            pass
        except BaseException as e:  # surfaced in the trainer thread, with the traceback
            self.out.put(ProducerFailed(f"rollout producer failed: {e!r}\n{traceback.format_exc()}"))

    def set_bound(self, bound: int) -> None:
        """Admit the batches not yet admitted under staleness bound ``bound`` (lower or higher than the
        current one, within the admission's limit). The threaded schedule only: the deterministic one
        derives each batch's versions (and the store the versions it keeps) from the bound it was built with."""
        if self.schedule != "threaded":
            raise RuntimeError("the staleness bound can change mid-run under rl.schedule 'threaded' only")
        if bound != self.admission.max_staleness:
            self.admission.set_bound(bound)
            self.max_staleness = bound

    def stop(self) -> None:
        self._halt.set()
        self.store.close()
        if self.store.retention is not None:
            self.store.retention.release(self._hold_key)

    def close(self) -> None:
        """Release the engine (after ``stop`` and ``join``; a vLLM engine holds a process and memory)."""
        self.engine.close()

    def next_batch(self, timeout: float = 600.0) -> ScoredBatch:
        item = self.out.get(timeout=timeout)
        if isinstance(item, ProducerFailed):
            raise item
        return item
