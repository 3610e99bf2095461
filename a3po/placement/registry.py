"""Where rollouts are generated, one registered placement per topology; the trainer picks the one
the run's plan names (:attr:`a3po.config.plan.RunPlan.placement`) and sees the same interface
(:class:`Producer`) whichever it gets.

The names are the placements users name (:mod:`a3po.config.axes`: ``--placements``, the arms' names):

* ``colocated`` (``distributed.rollout_workers: 0``): a thread of the trainer process samples
  from its own copy of the policy (:func:`a3po.placement.in_process.local_producer`).
* ``disaggregated`` (``rollout_workers: N``): N processes of their own generate and score; trainer
  rank 0 pushes each weight version to them and receives their batches
  (:class:`a3po.placement.remote_rollouts.RemoteRollouts`), and with several (DeepSpeed) trainer
  ranks hands each batch to the others (:class:`a3po.placement.remote_rollouts.SharedRollouts`).
"""

from __future__ import annotations

from typing import Callable, Protocol

from a3po.devices import model_device
from a3po.parallel.ranks import Ranks
from a3po.placement.in_process import RolloutInputs, behaviour_check, local_producer
from a3po.placement.remote_rollouts import RemoteRollouts, SharedRollouts
from a3po.producer.producer import ScoredBatch
from a3po.producer.weight_store import WeightStore
from a3po.registry import Registry


class Producer(Protocol):
    """What the training loop asks of a placement."""

    def start(self) -> None: ...

    def next_batch(self, timeout: float = 600.0) -> ScoredBatch: ...

    def set_bound(self, bound: int) -> None:
        """The staleness bound for the admissions from the next published version on."""

    def stop(self) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...

    def close(self) -> None: ...


PlacementFactory = Callable[[RolloutInputs, WeightStore, int, Ranks], Producer]
ROLLOUT_PLACEMENTS: Registry[PlacementFactory] = Registry("rollout placement")


@ROLLOUT_PLACEMENTS.register("colocated")
def colocated(inp: RolloutInputs, store: WeightStore, start: int, ranks: Ranks) -> Producer:
    # Up to the run's last batch: a batch past it would read a version the store no longer keeps.
    return local_producer(inp, store, start, end=inp.plan.steps, check=behaviour_check(inp, store))


@ROLLOUT_PLACEMENTS.register("disaggregated")
def disaggregated(inp: RolloutInputs, store: WeightStore, start: int, ranks: Ranks) -> Producer:
    if ranks.world_size == 1:
        return RemoteRollouts(inp, store, start, ranks)
    # Several trainer ranks: rank 0 receives the workers' batches and hands each to the others.
    return SharedRollouts(RemoteRollouts(inp, store, start, ranks) if ranks.is_main else None, ranks,
                          model_device(inp.policy))
