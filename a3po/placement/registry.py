"""Where rollouts are generated, one registered placement per topology; the trainer picks one by
config and sees the same interface (:class:`Producer`) whichever it gets.

* ``in_process`` (``distributed.rollout_workers: 0``): a thread of the trainer process samples
  from its own copy of the policy (:func:`a3po.placement.in_process.local_producer`).
* ``workers`` (``rollout_workers: N``): N processes of their own generate and score; trainer
  rank 0 pushes each weight version to them and receives their batches
  (:class:`a3po.placement.rollout_workers.RemoteRollouts`), and with several (DeepSpeed) trainer
  ranks hands each batch to the others (:class:`a3po.placement.rollout_workers.SharedRollouts`).
"""

from __future__ import annotations

from typing import Callable, Protocol

from a3po.algorithms.rollout_correction import trainer_logp_source
from a3po.config import DistributedConfig, effective_max_staleness
from a3po.devices import model_device
from a3po.parallel.ranks import Ranks
from a3po.placement.in_process import RolloutInputs, behaviour_check, local_producer
from a3po.placement.rollout_workers import RemoteRollouts, SharedRollouts
from a3po.producer.producer import ScoredBatch
from a3po.producer.weight_store import WeightStore
from a3po.registry import Registry


class Producer(Protocol):
    """What the training loop asks of a placement."""

    def start(self) -> None: ...

    def next_batch(self, timeout: float = 600.0) -> ScoredBatch: ...

    def stop(self) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...

    def close(self) -> None: ...


PlacementFactory = Callable[[RolloutInputs, WeightStore, int, Ranks], Producer]
ROLLOUT_PLACEMENTS: Registry[PlacementFactory] = Registry("rollout placement")


def placement_name(distributed: DistributedConfig) -> str:
    return "workers" if distributed.rollout_workers else "in_process"


@ROLLOUT_PLACEMENTS.register("in_process")
def in_process(inp: RolloutInputs, store: WeightStore, start: int, ranks: Ranks) -> Producer:
    # ``proximal: metrics`` also measures the engine's log-prob mismatch against a trainer forward;
    # an asynchronous rollout correction keeps that forward's log-probs for the loss.
    rl = inp.cfg.rl
    check = behaviour_check(inp, store, keep_logp=trainer_logp_source(rl.rollout_correction, effective_max_staleness(rl)) == "producer")
    # Up to the run's last batch: a batch past it would read a version the store no longer keeps.
    return local_producer(inp, store, start, end=inp.cfg.rl.steps, check=check)


@ROLLOUT_PLACEMENTS.register("workers")
def workers(inp: RolloutInputs, store: WeightStore, start: int, ranks: Ranks) -> Producer:
    if ranks.world_size == 1:
        return RemoteRollouts(inp, store, start, ranks)
    # Several trainer ranks: rank 0 receives the workers' batches and hands each to the others.
    return SharedRollouts(RemoteRollouts(inp, store, start, ranks) if ranks.is_main else None, ranks, model_device(inp.policy))
