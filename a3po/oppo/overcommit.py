"""OPPO inter-step overlap: over-commit prompts, train on the groups that finish first, carry
the rest over to the next step.

A step admits ``B + Delta`` GRPO groups (B = ``rl.batch_prompts``) and stops decoding as soon
as ``B`` groups are complete (every sample ended on EOS or reached ``rl.max_new_tokens``). The
trainer gets those ``B`` groups; unfinished samples stay in the :class:`CarryBuffer` with their
partial tokens, behaviour log-probs and per-token policy versions and continue next step (the
engine re-prefills prompt + partial answer, so later tokens come from the newer weights). A
few long answers then no longer hold up every step.

Carried tokens are stale by the versions that passed since they were sampled; the loss is
the decoupled PPO loss with a staleness-aware proximal policy (loglinear by default: no extra
forward pass, and ``a = 1/d`` keeps the trust region anchored one version back whatever the
age; ``recompute`` is exact at the cost of a forward). The behaviour-only proximal of ``sync``
would anchor the trust region at stale weights, so the config refuses it with ``oppo.inter``.

``Delta`` adapts to the reward trend (:class:`DeltaController`): while the least-squares slope
of the mean reward over the last ``window`` steps is positive, over-commit more
(``Delta <- min(Delta_max, Delta + delta_grow)``), otherwise back off
(``Delta <- max(Delta_min, Delta - delta_shrink)``).

With OPPO's intra-step overlap too (``oppo.intra``), the scorer threads prefill the same block
the engine re-prefills (prompt + partial answer: a carried answer is rescored from its start in
each step it resumes, so all its values come from one critic version) and take the new tokens chunk
by chunk; a sample that is done keeps the figures of its whole answer (:attr:`Sample.scored`) until
its group is trained (:func:`pack_streamed`).

With rollout workers (``distributed.rollout_workers: N``, :mod:`a3po.placement.worker_loop`)
each worker ``k`` runs its own :class:`OverlapProducer` over its batches ``k, k + N, ...`` and owns
its carry-over: it admits the groups ``k, k + N, k + 2N, ...`` (disjoint between workers, a
function of (seed, g) as in one process) and carried groups stay with the worker that admitted
them, so no group changes hands between processes. With ``N = 1`` the numbering is one process's.
The trainer checkpoints every worker's state (:func:`per_worker_states`); each worker's ``Delta``
follows the rewards of its own batches.

Everything here is plain Python state (lists, ints, floats) so the buffer checkpoints as JSON.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from a3po.producer.producer import RolloutProducer, ScoredBatch, batch_seed
from a3po.rollout.types import RolloutBatch


def reward_slope(values: list[float]) -> float:
    """Least-squares slope of ``values`` against 0, 1, ..., n-1 (0 for fewer than 2 points):
    ``sum((x - x_mean) (y - y_mean)) / sum((x - x_mean)^2)``."""
    n = len(values)
    if n < 2:
        return 0.0
    x_mean, y_mean = (n - 1) / 2, sum(values) / n
    num = sum((i - x_mean) * (y - y_mean) for i, y in enumerate(values))
    den = sum((i - x_mean) ** 2 for i in range(n))
    return num / den


@dataclass
class DeltaController:
    """Over-commitment ``Delta`` (extra groups admitted per step) from the reward trend."""

    delta: int
    delta_min: int
    delta_max: int
    delta_grow: int
    delta_shrink: int
    window: int
    rewards: list[float] = field(default_factory=list)

    def update(self, mean_reward: float) -> int:
        """Record a step's mean reward; returns the ``Delta`` for the next step. Until the
        window is full the slope is taken over the steps seen (at least 2)."""
        self.rewards = (self.rewards + [float(mean_reward)])[-self.window:]
        if len(self.rewards) >= 2:
            if reward_slope(self.rewards) > 0:
                self.delta = min(self.delta_max, self.delta + self.delta_grow)
            else:
                self.delta = max(self.delta_min, self.delta - self.delta_shrink)
        return self.delta

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        self.delta, self.rewards = int(state["delta"]), [float(r) for r in state["rewards"]]


@dataclass
class Sample:
    """One sequence in flight: its prompt, the answer so far and, per answer token, the
    behaviour log-prob and the policy version that sampled it."""

    group: int
    prompt: list[int]
    meta: dict
    admitted_step: int
    tokens: list[int] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finished: bool = False  # ended on EOS
    done: bool = False  # finished, or reached max_new_tokens
    steps_seen: int = 0  # producer steps that decoded part of it (1 = not carried)
    # OPPO intra + inter: what the scorer threads streamed for the whole answer in the step that
    # finished it (per answer token "ref_logp" and "values", the reward model's "score"), and the
    # "version" of the critic that gave the values.
    scored: dict | None = None


class CarryBuffer:
    """GRPO groups in flight, in admission order. A group is complete when all its samples are
    done; :meth:`take` hands out the first ``B`` complete groups (earliest completion first,
    then earliest admission) and keeps everything else."""

    def __init__(self, max_new_tokens: int) -> None:
        self.max_new_tokens = max_new_tokens
        self.groups: dict[int, list[Sample]] = {}
        self.completed_at: dict[int, int] = {}  # group -> producer step at which it completed

    def admit(self, group: int, prompts: list[list[int]], meta: list[dict], step: int) -> None:
        if group in self.groups:
            raise ValueError(f"group {group} admitted twice")
        self.groups[group] = [Sample(group, list(p), dict(m), step) for p, m in zip(prompts, meta, strict=True)]

    def active(self) -> list[Sample]:
        """Samples still generating, in admission order."""
        return [s for g in self.groups.values() for s in g if not s.done]

    def complete(self) -> list[int]:
        return [g for g, samples in self.groups.items() if all(s.done for s in samples)]

    def extend(self, sample: Sample, tokens: list[int], logp: list[float], versions: list[int], finished: bool,
               step: int) -> None:
        sample.tokens += tokens
        sample.logp += logp
        sample.versions += versions
        sample.finished = finished
        sample.done = finished or len(sample.tokens) >= self.max_new_tokens
        sample.steps_seen += 1
        if all(s.done for s in self.groups[sample.group]):
            self.completed_at.setdefault(sample.group, step)

    def take(self, b: int) -> list[list[Sample]]:
        order = sorted(self.complete(), key=lambda g: (self.completed_at[g], list(self.groups).index(g)))[:b]
        if len(order) < b:
            raise RuntimeError(f"only {len(order)} complete groups, {b} needed")
        out = [self.groups.pop(g) for g in order]
        for g in order:
            del self.completed_at[g]
        return out

    def state_dict(self) -> dict:
        """JSON-able: lists of plain values (floats round-trip exactly through JSON)."""
        return {
            "groups": [[asdict(s) for s in samples] for samples in self.groups.values()],
            "completed_at": [[g, s] for g, s in self.completed_at.items()],
        }

    def load_state_dict(self, state: dict) -> None:
        self.groups = {}
        for samples in state["groups"]:
            restored = [Sample(**s) for s in samples]
            self.groups[restored[0].group] = restored
        self.completed_at = {int(g): int(s) for g, s in state["completed_at"]}


def pack_streamed(groups: list[list[Sample]], batch: RolloutBatch) -> dict[str, torch.Tensor]:
    """The samples' streamed figures (:attr:`Sample.scored`) in the layout of :func:`pack_rollout`'s
    ``batch``: ``ref_logp`` and ``values`` ``(N, L)`` on the answer columns (0 elsewhere, where the
    trainer masks them out), ``scores`` ``(N,)``."""
    samples = [s for g in groups for s in g]
    if not samples or samples[0].scored is None:
        return {}
    out: dict[str, torch.Tensor] = {}
    p = batch.prompt_len
    for name in samples[0].scored:
        if name == "version":
            continue
        if name == "score":
            out["scores"] = torch.tensor([s.scored["score"] for s in samples], dtype=torch.float32)
            continue
        t = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        for i, s in enumerate(samples):
            if len(s.scored[name]) != len(s.tokens):
                raise RuntimeError(f"group {s.group}: {len(s.scored[name])} streamed {name} for "
                                   f"{len(s.tokens)} answer tokens")
            t[i, p:p + len(s.tokens)] = torch.tensor(s.scored[name], dtype=torch.float32)
        out[name] = t
    return {k: v.to(batch.input_ids.device) for k, v in out.items()}


def pack_rollout(groups: list[list[Sample]], pad_id: int, device: torch.device | str = "cpu") -> RolloutBatch:
    """The samples of ``groups`` as one :class:`RolloutBatch` (left-padded prompts, answers
    right-padded), keeping each token's behaviour log-prob and version."""
    samples = [s for g in groups for s in g]
    n, p_w, r_w = len(samples), max(len(s.prompt) for s in samples), max(max(len(s.tokens) for s in samples), 1)
    ids = torch.full((n, p_w + r_w), pad_id, dtype=torch.long)
    attn = torch.zeros((n, p_w + r_w), dtype=torch.long)
    logp = torch.zeros((n, p_w + r_w), dtype=torch.float32)
    versions = torch.full((n, p_w + r_w), -1, dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, p_w - len(s.prompt):p_w] = torch.tensor(s.prompt)
        attn[i, p_w - len(s.prompt):p_w + len(s.tokens)] = 1
        if s.tokens:
            ids[i, p_w:p_w + len(s.tokens)] = torch.tensor(s.tokens)
            logp[i, p_w:p_w + len(s.tokens)] = torch.tensor(s.logp, dtype=torch.float32)
            versions[i, p_w:p_w + len(s.tokens)] = torch.tensor(s.versions)
    resp = versions >= 0
    meta = [{**s.meta, "admitted_step": s.admitted_step, "steps_seen": s.steps_seen,
             **({"scored_version": s.scored["version"]} if s.scored is not None else {})} for s in samples]
    return RolloutBatch(ids.to(device), attn.to(device), resp.to(device), logp.to(device), versions.to(device),
                        torch.tensor([s.finished for s in samples], device=device), p_w, meta)


def per_worker_states(state: dict | None, workers: int) -> list[dict | None]:
    """A checkpoint's carry-over state (``oppo_state``) as one entry per rollout worker. One
    process writes its producer's state, ``N`` workers ``{"workers": [state_0, ..., state_{N-1}]}``
    (None: the worker had no batch trained yet, it starts afresh). The two forms are the same
    ledger when ``N = 1`` (same group numbering); another number of workers would renumber the
    groups in flight, so it is refused rather than losing or repeating one."""
    if state is None:
        return [None] * workers
    states = state["workers"] if "workers" in state else [state]
    if len(states) != workers:
        raise ValueError(f"the checkpoint's OPPO carry-over belongs to {len(states)} rollout producer(s) "
                         f"(distributed.rollout_workers {len(states) if 'workers' in state else 0}), this launch has "
                         f"{workers}: each owns the groups it admitted; "
                         "resume with the same number of rollout workers")
    return states


class OverlapProducer(RolloutProducer):
    """:class:`~a3po.producer.producer.RolloutProducer` with over-commitment and carry-over (OPPO
    inter-step overlap) for GRPO groups. Group ``g`` is the first group of the sampler's batch
    ``g``: a function of (seed, g) alone, so a resumed run admits the same prompts. A producer of
    every ``stride``-th batch (rollout worker ``k`` of ``stride``) admits the groups ``k, k + stride,
    ...``. Each delivered :class:`ScoredBatch` carries the producer's state *after* it was produced,
    which the trainer checkpoints with the step that trains it."""

    def __init__(self, *args, batch_groups: int, group_size: int, delta: DeltaController, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.name = "rollout-producer-oppo"
        self.batch_groups, self.group_size, self.delta = batch_groups, group_size, delta
        self.buffer = CarryBuffer(self.params.max_new_tokens)
        # A fresh run: group k of worker k (0 in one process); a resumed one: see load_state_dict.
        k = self.next_index % self.stride
        self.next_group = k + self.stride * (self.next_index // self.stride) * batch_groups

    def _group(self, g: int) -> tuple[list[list[int]], list[dict]]:
        prompts, meta = self.sampler.batch(g)
        return prompts[: self.group_size], [{**m, "group": g} for m in meta[: self.group_size]]

    def _stop_when_b_complete(self, rows: list[Sample]) -> Callable[[torch.Tensor], bool]:
        groups = sorted({s.group for s in rows})
        local = torch.tensor([groups.index(s.group) for s in rows])
        already = len(self.buffer.complete())

        def stop(done: torch.Tensor) -> bool:
            running = torch.zeros(len(groups), dtype=torch.long).index_add_(0, local, (~done.cpu()).long())
            return already + int((running == 0).sum()) >= self.batch_groups

        return stop

    def produce(self, j: int) -> ScoredBatch:
        """Batch ``j``: top up to ``B + Delta`` groups, decode until ``B`` are complete, take them."""
        t0 = time.perf_counter()
        while len(self.buffer.groups) < self.batch_groups + self.delta.delta:
            prompts, meta = self._group(self.next_group)
            self.buffer.admit(self.next_group, prompts, meta, j)
            self.next_group += self.stride
        rows = self.buffer.active()
        stream_metrics: dict[str, float] = {}
        if rows and len(self.buffer.complete()) < self.batch_groups:
            budget = torch.tensor([self.params.max_new_tokens - len(s.tokens) for s in rows])
            resumed = [s.prompt + s.tokens for s in rows]
            # Intra: the scorers prefill prompt + partial answer, as the engine does (see a3po.oppo.intra).
            scored_on = self.engine.version  # the critic version the scorers read
            on_token = self.stream.begin(resumed, scored_on) if self.stream is not None else None
            rollout = self.engine.generate_until(
                resumed, self.params, batch_seed(self.seed, j), row_budget=budget,
                stop_early=self._stop_when_b_complete(rows),
                between_steps=self._between_steps(j) if self.mid_batch_updates else None, on_token=on_token,
            )
            streamed, stream_metrics = self.stream.finish(rollout.input_ids) if self.stream is not None else ({}, {})
            # e.g. the engine's log-prob error, on the tokens decoded here (earlier ones were checked when decoded)
            if self.check is not None:
                stream_metrics.update({k: v for k, v in self.check(rollout).items() if not isinstance(v, torch.Tensor)})
            p = rollout.prompt_len
            n_new = 0
            for i, s in enumerate(rows):
                m = rollout.response_mask[i, p:].cpu()
                n_new += int(m.sum())
                self.buffer.extend(s, rollout.input_ids[i, p:].cpu()[m].tolist(),
                                   rollout.behav_logp[i, p:].cpu()[m].tolist(),
                                   rollout.versions[i, p:].cpu()[m].tolist(), bool(rollout.finished[i]), j)
                if self.stream is not None and s.done:  # the whole answer sits left of column p + new tokens
                    end = p + int(m.sum())
                    s.scored = {"version": scored_on, **{k: streamed[k][i, end - len(s.tokens):end].cpu().tolist()
                                                         for k in ("ref_logp", "values") if k in streamed}}
                    if "scores" in streamed:
                        s.scored["score"] = float(streamed["scores"][i])
            if self.stream is not None:  # the chunk tuner's cost: producing time per generated token
                self.stream.record(time.perf_counter() - t0, n_new, n_new / len(rows))
        taken = self.buffer.take(self.batch_groups)
        batch = pack_rollout(taken, self.engine.pad_token_id, self.engine.device)
        streamed_batch = pack_streamed(taken, batch) if self.stream is not None else {}
        carried = self.buffer.active() + [s for g in self.buffer.groups.values() for s in g if s.done]
        metrics = {
            "oppo/delta": float(self.delta.delta),
            "oppo/carried": float(sum(1 for s in carried if s.tokens)),
            "oppo/carried_age_max": float(max((j + 1 - s.admitted_step for s in carried if s.tokens), default=0)),
            "oppo/trained_age_max": float(max(j - m["admitted_step"] for m in batch.meta)),
            **stream_metrics,
        }
        scored = self._score(j, batch, t0, streamed_batch, metrics)
        self.delta.update(scored.rewards.mean().item())
        scored.producer_state = self.state_dict()  # after the Delta update: the state batch j + 1 starts from
        return scored

    def _produce_next(self, j: int) -> ScoredBatch:
        # The bound counts trained samples, as without OPPO; batches before j count whoever made them (workers).
        self.admission.admit_batch(j, self.batch_groups * self.group_size)
        self._load_start(j)
        return self.produce(j)

    def state_dict(self) -> dict:
        return {"buffer": self.buffer.state_dict(), "delta": self.delta.state_dict(), "next_group": self.next_group}

    def load_state_dict(self, state: dict | None) -> None:
        """Restore :meth:`state_dict` (a one-worker checkpoint's ``{"workers": [state]}`` too);
        None: nothing was trained yet, start afresh."""
        if state is None or "workers" in state:
            [state] = per_worker_states(state, 1)
            if state is None:
                return
        self.buffer.load_state_dict(state["buffer"])
        self.delta.load_state_dict(state["delta"])
        self.next_group = int(state["next_group"])
