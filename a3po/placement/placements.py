"""Where rollouts are generated, one registered placement per topology; the trainer picks one by
config and sees the same interface (:class:`Producer`) whichever it gets.

* ``in_process`` (``distributed.rollout_workers: 0``): a thread of the trainer process samples
  from its own copy of the policy (:class:`a3po.producer.producer.RolloutProducer`).
* ``workers`` (``rollout_workers: N``): N processes of their own generate and score; the trainer
  side pushes each weight version to them and receives their batches
  (:class:`a3po.placement.rollout_workers.RemoteRollouts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from a3po.algorithms.proximal import PROXIMAL_METHODS
from a3po.config import DistributedConfig, TrainConfig, effective_max_staleness, mid_batch_updates, proximal_method_name
from a3po.data.datasets import prompt_style
from a3po.oppo.overcommit import DeltaController, OverlapProducer
from a3po.parallel.ranks import Ranks
from a3po.producer.producer import Admission, PromptSampler, RolloutProducer, ScoredBatch, WeightStore
from a3po.registry import Registry
from a3po.rollout.engines import build_engine
from a3po.rollout.logprob_mismatch import BehaviourCheck
from a3po.rollout.torch_engine import SamplingParams


class Producer(Protocol):
    """What the training loop asks of a placement."""

    def start(self) -> None: ...

    def next_batch(self, timeout: float = 600.0) -> ScoredBatch: ...

    def stop(self) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class RolloutInputs:
    """What generating and scoring need, whichever process does it."""

    cfg: TrainConfig
    policy: torch.nn.Module
    tokenizer: object
    train_rows: list[dict]
    score: Callable[[list[str], list[dict]], list[float]]  # (completions, meta) -> rewards
    intra: object | None = None  # a3po.oppo.intra.IntraScoring with oppo.intra (in-process placement only)


def local_producer(
    inp: RolloutInputs, store: WeightStore, start: int, stride: int = 1, end: int | None = None, check: Callable | None = None
) -> RolloutProducer:
    """A producer thread (with OPPO's carry-over when ``oppo.inter``) sampling from the engine
    ``rollout.engine`` names, which starts on the store's newest weights; the same construction
    in a trainer process and in a rollout worker. ``check(rollout)``: extra per-batch figures."""
    rl, tok = inp.cfg.rl, inp.tokenizer
    s = effective_max_staleness(rl)
    engine = build_engine(inp.policy, tok, store.get(store.latest), store.latest, inp.cfg)
    batch_size = rl.batch_prompts * rl.group_size
    # OPPO's inter-step overlap is the same producer with over-commitment and carry-over.
    oppo = inp.cfg.oppo
    overlap = dict(batch_groups=rl.batch_prompts, group_size=rl.group_size, delta=DeltaController(
        oppo.delta_init, oppo.delta_min, oppo.delta_max, oppo.d_inc, oppo.d_dec, oppo.window)) if oppo.inter else {}
    return (OverlapProducer if oppo.inter else RolloutProducer)(
        engine,
        store,
        Admission(store, s, batch_size, admitted=start * batch_size),
        PromptSampler(inp.train_rows, tok, rl.batch_prompts, rl.group_size, rl.seed, prompt_style(inp.cfg.data)),
        SamplingParams(rl.max_new_tokens, rl.temperature, rl.top_p),
        score=inp.score,
        decode=lambda toks: tok.decode([t for t in toks if t != tok.eos_token_id], skip_special_tokens=True),
        max_staleness=s,
        schedule=rl.schedule,
        seed=rl.seed,
        start=start,
        stride=stride,
        end=end,
        mid_batch_updates=mid_batch_updates(inp.cfg.rollout),
        check=check,
        **overlap,
        **({"intra": inp.intra} if inp.intra is not None else {}),
    )


PlacementFactory = Callable[[RolloutInputs, WeightStore, int, Ranks], Producer]
ROLLOUT_PLACEMENTS: Registry[PlacementFactory] = Registry("rollout placement")


def placement_name(distributed: DistributedConfig) -> str:
    return "workers" if distributed.rollout_workers else "in_process"


@ROLLOUT_PLACEMENTS.register("in_process")
def in_process(inp: RolloutInputs, store: WeightStore, start: int, ranks: Ranks) -> Producer:
    # ``proximal: metrics`` also measures the engine's log-prob mismatch against a trainer forward.
    checks = PROXIMAL_METHODS.get(proximal_method_name(inp.cfg.rl)).checks_behaviour
    return local_producer(inp, store, start, check=BehaviourCheck(inp.policy, store.get, inp.cfg.rl.temperature) if checks else None)


@ROLLOUT_PLACEMENTS.register("workers")
def workers(inp: RolloutInputs, store: WeightStore, start: int, ranks: Ranks) -> Producer:
    from a3po.placement.rollout_workers import RemoteRollouts  # it builds on this module

    return RemoteRollouts(inp, store, start, ranks)
