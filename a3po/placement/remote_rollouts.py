"""The trainer's side of rollout workers in processes of their own (``distributed.rollout_workers:
N``, the ``disaggregated`` placement): :class:`RemoteRollouts` on trainer rank 0, and with several
trainer ranks :class:`SharedRollouts` on each. The worker's side is :mod:`a3po.placement.worker_loop`,
the bytes between them :mod:`a3po.placement.worker_wire`.

The launch is T trainer ranks (global ranks 0..T-1; T > 1 under DeepSpeed, data parallel over
their own world) followed by N rollout workers (ranks T..T+N-1), e.g. ``torchrun
--nproc_per_node 2`` with ``rollout_workers: 1`` (one trainer) or ``--nproc_per_node 3`` with
``rollout_workers: 1`` and ``distributed.deepspeed_config`` (two ZeRO trainer ranks). Trainer
rank 0 ("the trainer" below) talks to the workers. Worker ``k`` generates batches
``j = k, k + N, ...`` with the trainer process's own code, so under ``rl.schedule: deterministic``
a disaggregated run makes the very samples of the threaded single-process run, bit for bit.

The trainer pushes every version its weight store publishes (whole weights, gathered by every
trainer rank under ZeRO-3; with ``model.lora`` the adapters alone), each with the staleness bound
in force when it was published (it moves under ``rl.staleness_control: adaptive`` and the guard's
``tighten``; :class:`VersionBounds`): where the trainer moves its bound after step ``t``, the
workers admit under the new one from version ``t + 1`` on (in one process the producer's admission
takes it just before that version is published; here with it). Batches admitted under the old
bound stay, as in one process.

OPPO (docs/oppo.md) runs where generation runs, in each worker. ``oppo.inter``: worker ``k`` keeps
its own carry-over buffer and admits the groups ``k, k + N, ...`` (:mod:`a3po.oppo.overcommit`);
carried groups never change hands. Each batch brings back its worker's state after it; the trainer
keeps the newest of every worker up to the batch it delivers (:class:`WorkerStates`), so the
checkpoint written after training batch ``j`` holds, per worker, its state after its last batch
``<= j``: exactly where that worker restarts (its first batch ``> j``), the hello hands it back.
Each admitted group is trained once: by the batch that takes it, before or after a resume (batches
generated but not trained when a run stops are made again from the checkpointed state, the same
under ``rl.schedule: deterministic``). ``oppo.intra``: the scorers run in the worker; the trainer
pushes its critic's versions beside the policy's, and the streamed tensors come back with the batch.

With several trainer ranks, rank 0 broadcasts each batch, in the same framing, to the others over
a gloo group of the trainers' world (:class:`SharedRollouts`); each trains on its shard.

A worker that dies (SIGKILL, OOM) breaks the trainer's receive: the run fails naming the
worker's rank, and the launcher stops the other processes; rerunning the command resumes from
the newest checkpoint (the hello tells the workers where to restart and with which versions).
"""

from __future__ import annotations

import queue
import threading
import time

import torch
import torch.distributed as dist

from a3po.devices import model_device
from a3po.models.lora import trained_state
from a3po.oppo.intra import IntraScoring
from a3po.oppo.overcommit import per_worker_states
from a3po.parallel.ranks import Ranks, launch_links
from a3po.placement.in_process import RolloutInputs
from a3po.placement.worker_wire import (
    TRAINER,
    push_stop,
    push_version,
    put_batch,
    put_failure,
    receive_batch,
    rollout_links,
    state_layout,
    take_batch,
    tied_names,
    version_wire,
    wire_name,
)
from a3po.producer.producer import ProducerFailed, ScoredBatch
from a3po.producer.weight_store import WeightStore


class VersionBounds:
    """The staleness bound in force from each weight version on: the bound a version carries to
    the workers is the one the trainer had set when it published that version (the pusher may
    send it later, after the bound has moved again)."""

    def __init__(self, start: int) -> None:
        self._moves: list[tuple[int, int]] = [(0, start)]  # (first version, bound), versions rising

    def move(self, first_version: int, bound: int) -> None:
        if first_version < self._moves[-1][0]:
            raise ValueError(f"the bound moved from version {first_version}, before its last move "
                             f"(from version {self._moves[-1][0]})")
        self._moves.append((first_version, bound))

    def at(self, version: int) -> int:
        return next(b for first, b in reversed(self._moves) if first <= version)


class WorkerStates:
    """The OPPO states of every worker (carry-over ledger, chunk tuner), each as of that worker's
    newest batch delivered so far (or the checkpoint's; None: none yet). Batches are delivered in
    order, so after batch ``j`` they are every worker's state after its last batch ``<= j``: what
    a checkpoint written after training ``j`` holds, and where each worker restarts."""

    def __init__(self, workers: int) -> None:
        self.carry: list[dict | None] = [None] * workers
        self.tuners: list[dict | None] = [None] * workers

    def record(self, k: int, got: ScoredBatch) -> ScoredBatch:
        """Batch ``got`` of worker ``k``, its states replaced by every worker's (``{"workers": [...]}``)."""
        if got.producer_state is not None:
            self.carry[k] = got.producer_state
            got.producer_state = {"workers": list(self.carry)}
        if got.stream_state is not None:
            self.tuners[k] = got.stream_state
            got.stream_state = {"workers": list(self.tuners)}
        return got


class PushFigures:
    """What pushing versions to the workers cost the trainer process since a batch last took the
    figures: ``perf/weights_push_s`` (packing and broadcasting, summed over the versions; it runs
    in a thread of the trainer process, beside the update) and ``perf/weights_push_mb`` (the policy's
    bytes). Zero where no version went out in between."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds, self._bytes = 0.0, 0

    def add(self, seconds: float, nbytes: int) -> None:
        with self._lock:
            self._seconds += seconds
            self._bytes += nbytes

    def take(self) -> dict[str, float]:
        with self._lock:
            figures = {"perf/weights_push_s": self._seconds, "perf/weights_push_mb": self._bytes / 2**20}
            self._seconds, self._bytes = 0.0, 0
        return figures


class RemoteRollouts:
    """The trainer's producer when rollout workers generate: the interface of
    :class:`a3po.producer.producer.RolloutProducer` (``start``, ``next_batch``, ``stop``, ``join``, ``close``).
    A pusher thread broadcasts every version published to ``store`` (with ``oppo.intra`` and a
    critic, the critic's version from ``inp.intra``'s store beside it); a receiver thread collects
    batches ``start .. rl.steps - 1`` in order, batch ``j`` from worker ``j mod N``, and hands each
    on with every worker's newest OPPO states as of it (``{"workers": [...]}``, module docstring)."""

    def __init__(self, inp: RolloutInputs, store: WeightStore, start: int, ranks: Ranks) -> None:
        self.store, self.start_index, self.end = store, start, inp.plan.steps
        self.workers = list(range(ranks.world_size, ranks.launch_size))
        # The critic's versions (oppo.intra): published by the trainer beside the policy's, on the same retention.
        self.critic_store = inp.intra.critic_store if isinstance(inp.intra, IntraScoring) else None
        self.oppo = WorkerStates(len(self.workers))
        saved = inp.intra.worker_states if isinstance(inp.intra, IntraScoring) else None
        if saved is not None and len(saved) == len(self.workers):
            self.oppo.tuners = list(saved)  # else the tuners start afresh: a schedule, not a ledger
        self.device = model_device(inp.policy)
        self.weights_link, self.samples_link = rollout_links()
        self.wire = version_wire(inp)
        self.tied = tied_names(trained_state(inp.policy))  # ties are the model's: the same in every version
        self.pushed = PushFigures()
        self.bounds = VersionBounds(inp.plan.start_bound)  # guarded by the store's lock
        self.out: queue.Queue[ScoredBatch | ProducerFailed] = queue.Queue()
        self._halt = threading.Event()
        self._threads = [threading.Thread(target=self._push, name="weight-push", daemon=True),
                         threading.Thread(target=self._receive, name="rollout-receive", daemon=True)]

    def start(self) -> None:
        self._hold(min(self.store.versions()))
        for t in self._threads:
            t.start()

    def load_state_dict(self, state: dict | None) -> None:
        """A checkpoint's OPPO carry-over (``oppo_state``): each worker's, handed to it in the hello."""
        self.oppo.carry = per_worker_states(state, len(self.workers))

    def _hold(self, version: int) -> None:
        # The store keeps every version not yet pushed, whatever the trainer has moved on to.
        if self.store.retention is not None:
            self.store.retention.hold("weight-push", version)

    def set_bound(self, bound: int) -> None:
        """The staleness bound for the workers' admissions from the next version the trainer
        publishes on; it travels with that version (module docstring)."""
        with self.store.cond:
            self.bounds.move(self.store.latest + 1, bound)

    def _bound_at(self, version: int) -> int:
        with self.store.cond:
            return self.bounds.at(version)

    def _states(self, version: int) -> list[dict[str, torch.Tensor]]:
        return [self.store.get(version)] + ([self.critic_store.get(version)] if self.critic_store is not None else [])

    def _push(self) -> None:
        try:
            versions = self.store.versions()
            layout = state_layout(self.store.get(versions[-1]), self.wire)
            critic_layout = state_layout(self.critic_store.get(versions[-1])) if self.critic_store is not None else None
            self.weights_link.share({"start": self.start_index, "end": self.end, "layout": layout, "versions": versions,
                                     "wire": wire_name(self.wire), "tied": self.tied,
                                     "critic_layout": critic_layout,
                                     "oppo_state": self.oppo.carry,
                                     "intra_state": self.oppo.tuners})
            for v in versions:
                self._push_one(v)
            last = versions[-1]
            self._hold(last + 1)
            while True:
                with self.store.cond:
                    while self.store.latest <= last and not self._halt.is_set():
                        self.store.cond.wait(timeout=1.0)
                    latest, halting = self.store.latest, self._halt.is_set()
                for v in range(last + 1, latest + 1):
                    self._push_one(v)
                    last = v
                    self._hold(last + 1)
                if halting:
                    break
            push_stop(self.weights_link)
        except BaseException as e:
            if not self._halt.is_set():
                self.out.put(ProducerFailed("sending weights to the rollout workers (ranks "
                                            f"{self.workers}) failed: {e!r}; "
                                            "a worker has probably died; rerun the command to resume "
                                            "from the newest checkpoint"))

    def _push_one(self, version: int) -> None:
        t0 = time.perf_counter()
        states = self._states(version)
        sent = push_version(version, self._bound_at(version), states, self.weights_link, self.wire, self.tied)
        self.pushed.add(time.perf_counter() - t0, sent)

    def _receive(self) -> None:
        for j in range(self.start_index, self.end):
            k = j % len(self.workers)
            src = self.workers[k]
            try:
                got = receive_batch(1 + k, self.samples_link, self.device)
            except BaseException as e:
                if not self._halt.is_set():
                    self.out.put(ProducerFailed(f"rollout worker rank {src} is gone (waiting for batch {j}: {e!r}); "
                                                "the run stops; rerun the command to resume "
                                                "from the newest checkpoint"))
                return
            if isinstance(got, str):
                self.out.put(ProducerFailed(f"rollout worker rank {src} failed:\n{got}"))
                return
            got.metrics.update(self.pushed.take())
            self.out.put(self.oppo.record(k, got))

    def next_batch(self, timeout: float = 600.0) -> ScoredBatch:
        try:
            item = self.out.get(timeout=timeout)
        except queue.Empty:
            raise ProducerFailed("no batch from the rollout workers (ranks "
                                 f"{self.workers}) in {timeout:.0f} s") from None
        if isinstance(item, ProducerFailed):
            raise item
        return item

    def stop(self) -> None:
        """Send the versions still unsent, then the end of the run."""
        self._halt.set()
        with self.store.cond:
            self.store.cond.notify_all()

    def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:  # the receiver is done unless a worker failed mid-run
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def is_alive(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def close(self) -> None:
        """Nothing to release here: each worker closes its own engine."""


class SharedRollouts:
    """The producer of every trainer rank when several train (DeepSpeed data parallelism): rank 0
    takes each batch from the rollout workers (``source``, a :class:`RemoteRollouts`) and
    broadcasts it to the other trainer ranks (a gloo group of the trainers' world), so every rank holds
    the whole batch and trains on its shard of each minibatch, as when each rank generates the
    whole batch itself (:mod:`a3po.parallel.ranks`). A failure on rank 0 is broadcast too: every
    trainer rank then stops with rank 0's reason."""

    def __init__(self, source: RemoteRollouts | None, ranks: Ranks, device: torch.device) -> None:
        self.source, self.device, self.group = source, device, launch_links().batches

    def _broadcast(self, t: torch.Tensor) -> None:
        dist.broadcast(t, src=TRAINER, group=self.group)

    def start(self) -> None:
        if self.source is not None:
            self.source.start()

    def next_batch(self, timeout: float = 600.0) -> ScoredBatch:
        if self.source is None:
            got = take_batch(self._broadcast, self.device)
            if isinstance(got, str):
                raise ProducerFailed(f"trainer rank {TRAINER} stopped the run: {got}")
            return got
        try:
            batch = self.source.next_batch(timeout)
        except ProducerFailed as e:
            put_failure(str(e), self._broadcast)
            raise
        put_batch(batch, self._broadcast)
        return batch

    def load_state_dict(self, state: dict | None) -> None:
        if self.source is not None:
            self.source.load_state_dict(state)

    def set_bound(self, bound: int) -> None:
        """Every trainer rank moves its bound alike (rank 0's measures); rank 0 hands it to the workers."""
        if self.source is not None:
            self.source.set_bound(bound)

    def stop(self) -> None:
        if self.source is not None:
            self.source.stop()

    def join(self, timeout: float | None = None) -> None:
        if self.source is not None:
            self.source.join(timeout)

    def close(self) -> None:
        if self.source is not None:
            self.source.close()
