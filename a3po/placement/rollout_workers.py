"""Rollout workers in processes of their own (``distributed.rollout_workers: N``).

The launch is T trainer ranks (global ranks 0..T-1; T > 1 under DeepSpeed, data parallel over
their own world) followed by N rollout workers (ranks T..T+N-1), e.g. ``torchrun
--nproc_per_node 2`` with ``rollout_workers: 1`` (one trainer) or ``--nproc_per_node 3`` with
``rollout_workers: 1`` and ``distributed.deepspeed_config`` (two ZeRO trainer ranks). Trainer
rank 0 ("the trainer" below) talks to the workers. Worker ``k`` generates batches
``j = k, k + N, ...`` with the trainer process's own code (:func:`a3po.placement.in_process.local_producer`:
same engine, sampling parameters, per-batch seed ``batch_seed(seed, j)``, reward function), so
under ``rl.schedule: deterministic`` a disaggregated run makes the very samples of the threaded
single-process run, bit for bit. With ``rollout.engine: vllm`` the worker holds the vLLM engine
(reloaded in place for each version it receives) and the trainer ranks none; with ``proximal:
metrics`` the worker re-scores each batch with its own trainer-precision copy of the policy and
the engine-vs-trainer figures (``rollout/behav_logp_*``) travel with the batch.

Two gloo links (:class:`a3po.parallel.ranks.Link`: process groups of their own, outside the
trainer ranks' world) over {trainer rank 0, workers}, each used by one thread per process:

* **weights** (broadcast from the trainer): a JSON hello (first batch, last batch, the weights'
  layout, the versions that follow at once: the checkpoint's history on resume; with OPPO the
  critic's layout and each worker's checkpointed OPPO state), then every version the trainer
  publishes, in order: an int64 header ``[version, bound]`` and the state dict as one byte buffer
  (exact: bytes, not values; in bf16 where the workers' engine decodes from a bf16 copy and nothing
  there needs more, :func:`version_wire`: the engine's own rounding, done before sending), with
  ``oppo.intra`` and a critic followed by the critic's state of that version; header ``[-1, 0]``
  ends the run. ``bound`` is the staleness bound in force when the trainer published the version (it
  moves under ``rl.staleness_control: adaptive`` and the guard's ``tighten``); each worker's
  admission takes it before the version enters its store. The versions are the trainer's weight
  store's: whole weights, gathered by every trainer rank under ZeRO-3. With ``model.lora`` a version
  is the adapters alone (what the store holds): the worker builds the trainer's peft model on the
  same warm start (:func:`worker_inputs`; the adapters' ``A`` is drawn from a fixed seed and ``B``
  is 0, so the two start equal) and merges each version into its own frozen base (``W0 + s B A``, as
  the trainer process's engine does). Adapters rather than merged weights: a push is the adapters'
  size, ~r (in + out) / (in out) of the model's (~1/190 at r 16 on a 7B model), the merge costs a
  fraction of one decode step per version, and the worker's engine then loads exactly what a
  single-process run's engine loads.
* **samples** (send / recv, worker -> trainer): per batch an int64 header ``[index, rows,
  columns, prompt width, JSON bytes]``, the batch's tensors (token ids, masks, behaviour
  log-probs, per-token versions, finished flags, rewards), a JSON blob (meta, completions,
  grader counters, generation time, the producer's per-batch figures, its OPPO states after the
  batch, the names and shapes of the streamed tensors) and the streamed tensors (``oppo.intra``:
  reference log-probs, critic values, reward-model scores). Index ``-1`` carries a worker's error
  text instead.

OPPO (docs/oppo.md) runs where generation runs, in each worker:

* ``oppo.inter``: worker ``k`` keeps its own carry-over buffer and admits the groups ``k, k + N,
  ...`` (:mod:`a3po.oppo.overcommit`); carried groups never change hands. Each batch brings back
  its worker's state after it; the trainer's :class:`RemoteRollouts` keeps the newest of every
  worker up to the batch it delivers, so the checkpoint written after training batch ``j`` holds,
  per worker, its state after its last batch ``<= j``: exactly where that worker restarts (its
  first batch ``> j``), the hello hands it back. Each admitted group is trained once: by the batch
  that takes it, before or after a resume (batches generated but not trained when a run stops are
  made again from the checkpointed state, the same under ``rl.schedule: deterministic``).
* ``oppo.intra``: the scorers run in the worker on the worker's reference and reward model and on
  the trainer's critic versions pushed with the weights (:mod:`a3po.oppo.intra`); the streamed
  tensors come back with the batch, so the trainer uses them as in one process.

With several trainer ranks, rank 0 broadcasts each batch, in the same framing, to the others over
a gloo group of the trainers' world (:class:`SharedRollouts`); each trains on its shard.

The staleness bound holds across processes: a worker admits batch ``j`` only once *it* has
received version ``j - b`` (:class:`a3po.producer.producer.Admission` on its own store), and what
it has received is never newer than what the trainer has published. ``b`` is the bound that came
with the newest version the worker holds: where the trainer moves its bound after step ``t``, the
workers admit under the new one from version ``t + 1`` on (in one process the producer's admission
takes it just before that version is published; here with it). Batches admitted under the old
bound stay, as in one process. Tensors travel
through host memory (gloo), on GPUs too: one transport, and exact.

A worker that dies (SIGKILL, OOM) breaks the trainer's receive: the run fails naming the
worker's rank, and the launcher stops the other processes; rerunning the command resumes from
the newest checkpoint (the hello tells the workers where to restart and with which versions).
"""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import replace
from typing import Any, Callable

import torch
import torch.distributed as dist

from a3po.devices import DType, model_device
from a3po.models.lora import is_lora, trained_state, with_lora
from a3po.oppo.intra import IntraScoring
from a3po.oppo.overcommit import per_worker_states
from a3po.parallel.ranks import Link, Ranks, launch_links
from a3po.placement.in_process import RolloutInputs, behaviour_check, local_producer, weight_retention
from a3po.producer.producer import ProducerFailed, ScoredBatch
from a3po.producer.weight_store import Retention, WeightStore
from a3po.rollout.types import RolloutBatch

TRAINER = 0  # global rank of the trainer, and its rank in the weights and samples links (worker k's is 1 + k)
STOP = -1  # weight header: the run is over; batch header index: an error text follows

Layout = list[list[Any]]  # [[name, dtype, shape], ...] in state-dict order


def rollout_links() -> tuple[Link, Link]:
    """(weights link, samples link) over trainer rank 0 and the workers, made by
    :func:`a3po.parallel.ranks.init_ranks`."""
    links = launch_links()
    assert links.weights is not None and links.samples is not None, (
        "only trainer rank 0 and the workers talk over these")
    return links.weights, links.samples


def version_wire(inp: RolloutInputs) -> torch.dtype | None:
    """The dtype a version's floating tensors travel in to the workers; None: the trainer's own
    (exact bytes). bf16 where the workers' torch engine decodes from a bf16 copy and nothing there
    needs the trainer's precision: the engine rounds each weight to bf16 as it loads it anyway (the
    same rounding, so the same samples), and a version is then half the bytes to pack, send, take
    in and keep. The trainer's own bytes where a worker re-scores in the trainer's precision
    (:attr:`~a3po.config.plan.RunPlan.rescore`), with LoRA (a version is the adapters, merged into
    the worker's own base) and with vLLM (whose loader casts as it loads; not checked on bf16 input)."""
    plan = inp.plan
    narrow = plan.engine_dtype is DType.BFLOAT16 and inp.cfg.rollout.engine == "torch"
    return torch.bfloat16 if narrow and not plan.rescore and not is_lora(inp.policy) else None


def _wire_name(wire: torch.dtype | None) -> str | None:
    return None if wire is None else str(wire).removeprefix("torch.")


# --- weights: one byte buffer per version --------------------------------------------------------


def state_layout(state: dict[str, torch.Tensor], wire: torch.dtype | None = None) -> Layout:
    """Each tensor's name, dtype and shape as it travels: a floating tensor in ``wire`` where given."""
    return [[k, str(_on_wire(v.dtype, wire)).removeprefix("torch."), list(v.shape)] for k, v in state.items()]


def _on_wire(dtype: torch.dtype, wire: torch.dtype | None) -> torch.dtype:
    return wire if wire is not None and dtype.is_floating_point else dtype


def _nbytes(dtype: str, shape: list[int]) -> int:
    return getattr(torch, dtype).itemsize * int(torch.Size(shape).numel())


def tied_names(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """``{name: earlier name}`` for each tensor of ``state`` that is an earlier one itself (tied
    weights: a causal LM's output head is often its input embeddings, ~20% of a small model's
    bytes); such a tensor travels once and the worker points both names at it."""
    seen: dict[tuple, str] = {}
    tied = {}
    for name, v in state.items():
        if v.numel() == 0:  # e.g. a parameter partitioned away (ZeRO-3): no storage to compare
            continue
        key = (v.data_ptr(), v.dtype, tuple(v.shape), v.stride())
        if key in seen:
            tied[name] = seen[key]
        else:
            seen[key] = name
    return tied


def packed_size(layout: Layout, tied: dict[str, str] | None = None) -> int:
    """The bytes of a state packed in ``layout`` (:func:`pack_state`), the ``tied`` names not sent."""
    return sum(_nbytes(d, s) for name, d, s in layout if name not in (tied or {}))


def _slot(buf: torch.Tensor, at: int, n: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor | None:
    """``buf[at:at + n]`` seen as a ``dtype`` tensor of ``shape``, or None where ``at`` is not a
    multiple of the element size (a view must be aligned: a bf16 tensor of odd length shifts the rest)."""
    return buf[at : at + n].view(dtype).view(shape) if at % dtype.itemsize == 0 else None


def pack_state(state: dict[str, torch.Tensor], wire: torch.dtype | None = None,
               tied: dict[str, str] | None = None) -> torch.Tensor:
    """The state dict's bytes, concatenated in order (CPU uint8), each of the ``tied`` names left
    out (:func:`tied_names`); with ``wire`` each floating tensor is cast to it on the way, in the
    same pass that copies it in."""
    tied = tied or {}
    layout = state_layout(state, wire)
    buf = torch.empty(packed_size(layout, tied), dtype=torch.uint8)
    at = 0
    for (name, dtype, shape), v in zip(layout, state.values(), strict=True):
        if name in tied:
            continue
        n, target = _nbytes(dtype, shape), getattr(torch, dtype)
        slot = _slot(buf, at, n, target, shape)
        if slot is not None:
            slot.copy_(v.detach())
        else:
            buf[at : at + n] = v.detach().to("cpu", target).reshape(-1).view(torch.uint8)
        at += n
    return buf


def unpack_state(buf: torch.Tensor, layout: Layout, device: torch.device,
                 tied: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors :func:`pack_state` packed: views into ``buf`` where aligned (no copy on the
    worker's core, which is the generation's), a copy where not; each ``tied`` name the very
    tensor of its earlier twin."""
    tied = tied or {}
    out, at = {}, 0
    for name, dtype, shape in layout:
        if name in tied:
            out[name] = out[tied[name]]
            continue
        n = _nbytes(dtype, shape)
        slot = _slot(buf, at, n, getattr(torch, dtype), shape)
        if slot is None:
            slot = buf[at : at + n].clone().view(getattr(torch, dtype)).view(shape)
        out[name] = slot.to(device)
        at += n
    return out


def _push_version(version: int, bound: int, states: list[dict[str, torch.Tensor]], link: Link,
                  wire: torch.dtype | None = None, tied: dict[str, str] | None = None) -> int:
    """Version ``version`` with the staleness bound in force from it on: the policy's state (its
    floating tensors in ``wire`` where given, its ``tied`` names left out), then the critic's with
    ``oppo.intra``. Returns the policy's bytes sent."""
    link.broadcast(torch.tensor([version, bound], dtype=torch.int64), TRAINER)
    sent = 0
    for i, state in enumerate(states):
        buf = pack_state(state, wire, tied) if i == 0 else pack_state(state)
        link.broadcast(buf, TRAINER)
        sent = sent or buf.numel()
    return sent


def _push_stop(link: Link) -> None:
    link.broadcast(torch.tensor([STOP, 0], dtype=torch.int64), TRAINER)


def _receive_version(layouts: list[Layout], device: torch.device, link: Link,
                     tied: dict[str, str] | None = None) -> tuple[int, int, list[dict[str, torch.Tensor]]]:
    """What :func:`_push_version` sent, ``(version, bound, states)`` (one state per layout);
    ``(STOP, 0, [])`` at the end of the run."""
    header = torch.empty(2, dtype=torch.int64)
    link.broadcast(header, TRAINER)
    version, bound = header.tolist()
    if version == STOP:
        return version, 0, []
    states = []
    for i, layout in enumerate(layouts):
        ties = tied if i == 0 else None  # the policy's
        buf = torch.empty(packed_size(layout, ties), dtype=torch.uint8)
        link.broadcast(buf, TRAINER)
        states.append(unpack_state(buf, layout, device, ties))
    return version, bound, states


# --- samples: worker -> trainer ------------------------------------------------------------------


def _text_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8) if text else torch.empty(0, dtype=torch.uint8)


def _put_batch(sb: ScoredBatch, put: Callable[[torch.Tensor], Any]) -> None:
    """Batch ``sb`` as ``put`` calls (one send or broadcast per tensor, CPU): an int64 header, the
    tensors, a JSON blob."""
    b = sb.rollout
    rows, cols = b.input_ids.shape
    info = json.dumps({"meta": b.meta, "completions": sb.completions, "gen_time_s": sb.gen_time_s, "grader": sb.grader,
                       "metrics": sb.metrics, "producer_state": sb.producer_state, "stream_state": sb.stream_state,
                       "streamed": state_layout(sb.streamed)})
    blob = _text_tensor(info)
    header = torch.tensor([sb.index, rows, cols, b.prompt_len, len(blob)], dtype=torch.int64)
    for t in (header, b.input_ids, b.attention_mask, b.response_mask.to(torch.uint8), b.behav_logp, b.versions,
              b.finished.to(torch.uint8), sb.rewards, blob, *sb.streamed.values()):
        put(t.detach().contiguous().cpu())


def _put_failure(text: str, put: Callable[[torch.Tensor], Any]) -> None:
    blob = _text_tensor(text)
    put(torch.tensor([STOP, 0, 0, 0, len(blob)], dtype=torch.int64))
    put(blob)


def _take_batch(take: Callable[[torch.Tensor], Any], device: torch.device) -> ScoredBatch | str:
    """What :func:`_put_batch` (or :func:`_put_failure`) put, ``take`` filling each tensor in turn; on ``device``."""
    header = torch.empty(5, dtype=torch.int64)
    take(header)
    index, rows, cols, prompt_len, nbytes = header.tolist()

    def recv(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype)
        take(t)
        return t.to(device)

    if index == STOP:
        return bytes(recv((nbytes,), torch.uint8).cpu().numpy()).decode()
    grid = (rows, cols)
    input_ids, attention_mask = recv(grid, torch.int64), recv(grid, torch.int64)
    response_mask, behav_logp = recv(grid, torch.uint8).bool(), recv(grid, torch.float32)
    versions = recv(grid, torch.int64)
    finished, rewards = recv((rows,), torch.uint8).bool(), recv((rows,), torch.float32)
    info = json.loads(bytes(recv((nbytes,), torch.uint8).cpu().numpy()))
    streamed = {name: recv(tuple(shape), getattr(torch, dtype)) for name, dtype, shape in info["streamed"]}
    rollout = RolloutBatch(input_ids, attention_mask, response_mask, behav_logp, versions, finished, prompt_len,
                           info["meta"])
    return ScoredBatch(index, rollout, rewards, info["completions"], info["gen_time_s"], info["grader"],
                       metrics=info["metrics"],
                       producer_state=info["producer_state"], stream_state=info["stream_state"], streamed=streamed)


def send_batch(sb: ScoredBatch, link: Link) -> None:
    _put_batch(sb, lambda t: link.send(t, TRAINER))


def send_failure(text: str, link: Link) -> None:
    _put_failure(text, lambda t: link.send(t, TRAINER))


def receive_batch(src: int, link: Link, device: torch.device) -> ScoredBatch | str:
    """The next batch from the worker of link rank ``src``, on ``device``; or the worker's error text."""
    return _take_batch(lambda t: link.recv(t, src), device)


# --- the trainer's side --------------------------------------------------------------------------


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
                                     "wire": _wire_name(self.wire), "tied": self.tied,
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
            _push_stop(self.weights_link)
        except BaseException as e:
            if not self._halt.is_set():
                self.out.put(ProducerFailed("sending weights to the rollout workers (ranks "
                                            f"{self.workers}) failed: {e!r}; "
                                            "a worker has probably died; rerun the command to resume "
                                            "from the newest checkpoint"))

    def _push_one(self, version: int) -> None:
        t0 = time.perf_counter()
        states = self._states(version)
        sent = _push_version(version, self._bound_at(version), states, self.weights_link, self.wire, self.tied)
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
            got = _take_batch(self._broadcast, self.device)
            if isinstance(got, str):
                raise ProducerFailed(f"trainer rank {TRAINER} stopped the run: {got}")
            return got
        try:
            batch = self.source.next_batch(timeout)
        except ProducerFailed as e:
            _put_failure(str(e), self._broadcast)
            raise
        _put_batch(batch, self._broadcast)
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


# --- a worker's side -----------------------------------------------------------------------------


def worker_inputs(inp: RolloutInputs) -> RolloutInputs:
    """``inp`` with the policy the trainer's versions fit: the warm start itself, or with
    ``model.lora`` the warm start with the trainer's adapters injected (:func:`a3po.models.lora.with_lora`)."""
    return replace(inp, policy=with_lora(inp.policy, inp.cfg.model.lora))


def serve_rollouts(inp: RolloutInputs, ranks: Ranks, intra: Callable[[Retention], IntraScoring] | None = None) -> int:
    """Generate this worker's batches for the trainer until the run ends; returns how many it
    sent. The engine starts from ``inp.policy`` (the warm start, as the trainer loaded it).
    ``intra`` (``oppo.intra``): builds the worker's scorers on the retention of its weight stores."""
    inp = worker_inputs(inp)
    weights_link, samples_link = rollout_links()
    hello = weights_link.share(None)
    wire = version_wire(inp)
    if hello["wire"] != _wire_name(wire):  # e.g. nodes that differ in native bf16 under dtype: auto
        raise RuntimeError(f"rollout worker rank {ranks.rank}: the trainer sends its weight versions as "
                           f"{hello['wire'] or 'its own full-precision bytes'}, this worker takes them as "
                           f"{_wire_name(wire) or 'full-precision bytes'} (its engine's dtype here: "
                           f"{inp.plan.engine_dtype.value}); both decide from the same config, so their machines "
                           "differ in native bf16 under dtype: auto: set rollout.dtype to pin the engine's dtype")
    layout = state_layout(trained_state(inp.policy), wire)  # the versions' layout: the whole state, or the adapters
    if hello["layout"] != layout:
        diff = next((a, b) for a, b in zip(hello["layout"] + [None], layout + [None], strict=False) if a != b)
        raise RuntimeError(f"rollout worker rank {ranks.rank}: the trainer's weights do not fit this worker's model "
                           f"(trainer {diff[0]} vs worker {diff[1]}); both must load the same model")
    tied = hello["tied"]
    entries = {name: (d, s) for name, d, s in layout}
    if any(entries.get(a) != entries.get(b) or b not in entries for a, b in tied.items()):
        raise RuntimeError(f"rollout worker rank {ranks.rank}: the trainer sends tied weights {tied} once, but "
                           "this worker's model does not have them alike; both must load the same model")
    device = model_device(inp.policy)
    store = WeightStore(weight_retention(inp.plan, end=hello["end"]))
    k, n = ranks.rank - ranks.world_size, ranks.rollout_workers
    scoring = intra(store.retention) if intra is not None else None
    if scoring is not None:
        inp = replace(inp, intra=scoring)
        if hello["intra_state"][k] is not None:  # this worker's chunk tuner continues its schedule
            scoring.load_state_dict(hello["intra_state"][k])
    critic_store = scoring.critic_store if scoring is not None else None
    if (hello["critic_layout"] is None) != (critic_store is None):
        raise RuntimeError(f"rollout worker rank {ranks.rank}: the trainer "
                           f"{'sends no' if critic_store is not None else 'sends'} critic weights for oppo.intra and "
                           f"this worker {'scores with' if critic_store is not None else 'has no'} a critic")
    layouts = [layout] + ([hello["critic_layout"]] if critic_store is not None else [])

    def publish(version: int, states: list[dict[str, torch.Tensor]]) -> None:
        if critic_store is not None:  # before the policy's: a batch on that version finds its critic
            critic_store.publish(version, states[1])
        store.publish(version, states[0])

    bound = inp.plan.start_bound
    for _ in hello["versions"]:  # the versions the first batches start on (a checkpoint's history on resume)
        version, bound, states = _receive_version(layouts, device, weights_link, tied)
        publish(version, states)
    first = hello["start"] + (k - hello["start"]) % n
    # The engine's log-prob error against this worker's trainer-precision copy (proximal: metrics)
    # travels to the trainer in each batch's figures. The rollout correction's own log-probs do not:
    # with workers it runs synchronously only, the trainer computing them (a3po.config.train).
    producer = local_producer(inp, store, first, stride=n, end=hello["end"], check=behaviour_check(inp, store))
    if inp.cfg.oppo.inter:  # this worker's carry-over as the checkpoint kept it (None: none trained yet)
        producer.load_state_dict(hello["oppo_state"][k])
    if bound != producer.max_staleness:
        producer.set_bound(bound)

    def receive_weights() -> None:
        try:
            while True:
                version, bound, states = _receive_version(layouts, device, weights_link, tied)
                if version == STOP:  # normally after this worker's last batch; earlier if the trainer failed
                    producer.out.put(None)
                    return
                if bound != producer.max_staleness:  # before the version: admissions on it see its bound
                    producer.set_bound(bound)
                publish(version, states)
        except BaseException as e:
            producer.out.put(ProducerFailed(f"rollout worker rank {ranks.rank} lost the trainer (rank {TRAINER}) "
                                            f"waiting for weights: {e!r}"))
            store.close()

    receiver = threading.Thread(target=receive_weights, name="weight-receive", daemon=True)
    receiver.start()
    producer.start()
    sent = 0
    try:
        for _ in range(first, hello["end"], n):
            batch = producer.next_batch(timeout=None)
            if batch is None:  # the trainer ended the run early: its own error is the run's
                break
            send_batch(batch, samples_link)
            sent += 1
    except BaseException as e:
        try:  # tell the trainer why, so its error names this worker and the cause
            send_failure(f"{e}", samples_link)
        except BaseException:
            pass
        producer.stop()
        if scoring is not None:
            scoring.close()
        raise
    receiver.join()  # every broadcast needs all members: take the trainer's versions until it stops
    producer.stop()
    if scoring is not None:  # scorer threads end before the producer is joined, as in the trainer process
        scoring.close()
    producer.join(timeout=30)
    return sent
