"""Trainer ranks: data-parallel training under DeepSpeed, and the single process as world size 1.

Rank plumbing is read from the launcher's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``: torchrun and the deepspeed launcher set them), nanoGPT style:
one process is the same code with ``world_size == 1`` and every collective is then the identity.

The design of the data-parallel step (``a3po.training.step.train_step``):

* every rank runs the same deterministic rollout producer (same seed, same batches), so all
  ranks hold the whole batch; each takes a contiguous shard of every minibatch's rows;
* each rank's loss is its tokens' share of the token mean over the *whole* minibatch (the
  denominator is the all-reduced token count), and DeepSpeed averages gradients over ranks, so
  :class:`a3po.parallel.updaters.DeepSpeedUpdater` scales the loss by the world size: the reduced
  gradient is then the gradient of the single-process loss, whatever the number of ranks;
* metrics are computed on the whole minibatch after gathering the shards' detached log-probs,
  exactly as one process computes them (a p99 does not reduce from per-rank figures).

The optimizer step is in :mod:`a3po.parallel.updaters`, the DeepSpeed JSON's checks in
:mod:`a3po.config.preflight`.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import torch


@dataclass(frozen=True)
class Ranks:
    """This process's place among the trainer ranks; collectives are identities at world size 1.

    With rollout workers (``distributed.rollout_workers``, :mod:`a3po.placement.rollout_workers`) the launch
    is ``world_size`` trainer ranks followed by ``rollout_workers`` processes that only generate;
    the trainer collectives below (``shard``, ``sum``, ``gather_rows``, ``from_main``, ``barrier``)
    concern the trainer ranks (over ``group``), ``share`` the whole launch."""

    rank: int = 0
    world_size: int = 1  # trainer ranks
    local_rank: int = 0
    rollout_workers: int = 0
    # The trainer ranks' process group when it is not the launch's whole world (rollout workers
    # beside several trainer ranks); None: the default group, which is then the trainer ranks.
    group: Any = field(default=None, compare=False, repr=False)

    @property
    def is_rollout_worker(self) -> bool:
        return self.rank >= self.world_size

    @property
    def launch_size(self) -> int:
        return self.world_size + self.rollout_workers

    @property
    def is_main(self) -> bool:
        """Rank 0 alone writes checkpoints, metrics files, the export, and prints."""
        return self.rank == 0

    def shard(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous share of a minibatch's row indices (all of them in one process).
        Contiguous, so gathering the shards in rank order restores the minibatch's order."""
        if self.world_size == 1:
            return rows
        if len(rows) % self.world_size:
            raise ValueError(f"a minibatch of {len(rows)} rows does not split over {self.world_size} ranks")
        return rows.chunk(self.world_size)[self.rank]

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        x = x.detach().clone()
        torch.distributed.all_reduce(x, op=torch.distributed.ReduceOp.SUM, group=self.group)
        return x

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` (same shape on all ranks) along dim 0, in rank order."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, x.detach().contiguous(), group=self.group)
        return torch.cat(parts, dim=0)

    def gather_to_main(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` as a list on rank 0 (None elsewhere). Pickled in memory between
        the ranks of this run only; nothing here is read from disk."""
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size if self.is_main else None
        torch.distributed.gather_object(obj, out, dst=0, group=self.group)
        return out

    def from_main(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every trainer rank (rollout workers take no part)."""
        if self.world_size == 1:
            return obj
        box = [obj if self.is_main else None]
        torch.distributed.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def share(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every process of the launch, rollout workers included."""
        if self.launch_size == 1:
            return obj
        box = [obj if self.is_main else None]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier(group=self.group)


def ranks_from_env(environ: Mapping[str, str] = os.environ, rollout_workers: int = 0) -> Ranks:
    """Rank and world size as the launcher set them; no variables means one process. The last
    ``rollout_workers`` processes of the launch are rollout workers, the others trainer ranks."""
    try:
        rank = int(environ.get("RANK", 0))
        world = int(environ.get("WORLD_SIZE", 1))
        local = int(environ.get("LOCAL_RANK", rank))
    except ValueError:
        raise ValueError(
            f"RANK / WORLD_SIZE / LOCAL_RANK must be integers, got {environ.get('RANK')!r} / "
            f"{environ.get('WORLD_SIZE')!r} / {environ.get('LOCAL_RANK')!r}"
        ) from None
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is not in [0, WORLD_SIZE={world})")
    if rollout_workers and world <= rollout_workers:
        raise ValueError(
            f"distributed.rollout_workers is {rollout_workers} but the launch has {world} process(es) (WORLD_SIZE): "
            f"launch {rollout_workers + 1}, e.g. torchrun --nproc_per_node {rollout_workers + 1} (trainer ranks first, then the workers)"
        )
    return Ranks(rank, world - rollout_workers, local, rollout_workers)


def init_ranks(deepspeed_config: str | None, rollout_workers: int = 0) -> Ranks:
    """Join the trainer ranks (idempotent). Without a DeepSpeed config this is one plain process,
    and a launch of several ranks is refused: they would train independent copies into one folder.
    With rollout workers: the trainer ranks and the workers in one gloo world (see
    :func:`launch_groups`; the weights and samples travel through host memory, see
    a3po.placement.rollout_workers)."""
    ranks = ranks_from_env(rollout_workers=rollout_workers)
    if deepspeed_config is None and ranks.world_size > 1:
        if rollout_workers:
            raise RuntimeError(
                f"launched as {ranks.launch_size} processes with distributed.rollout_workers {rollout_workers}: that leaves "
                f"{ranks.world_size} trainer ranks, but distributed.deepspeed_config is null: set it (e.g. "
                f"infra/deepspeed_zero2.json) for data-parallel trainer ranks, or launch {rollout_workers + 1} processes"
            )
        raise RuntimeError(
            f"launched as {ranks.world_size} ranks (WORLD_SIZE) but distributed.deepspeed_config is null: "
            "set it (e.g. infra/deepspeed_zero2.json) or launch one process"
        )
    if rollout_workers:
        return _join_launch(ranks, deepspeed_config is not None)
    if deepspeed_config is None:
        return ranks
    if "MASTER_ADDR" not in os.environ and ranks.world_size == 1:
        # DeepSpeed without a launcher (one rank, e.g. `a3po train --config ds.yaml`): a private
        # loopback rendezvous, so init does not go looking for MPI.
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    _init_deepspeed_comm()
    return ranks


@dataclass(frozen=True)
class LaunchGroups:
    """The process groups of a launch with rollout workers (trainer ranks ``0..N-1``, workers
    ``N..N+M-1``), made once per process by :func:`init_ranks`: ``new_group`` is collective over
    the whole launch, so every process makes them all, in this order."""

    trainers: Any  # ranks 0..N-1: DeepSpeed's data-parallel group (None without DeepSpeed); the accelerator's backend
    weights: Any  # rank 0 + workers, gloo: every version, broadcast from rank 0
    samples: Any  # rank 0 + workers, gloo: each worker's batches, sent to rank 0
    batches: Any  # ranks 0..N-1, gloo: rank 0 broadcasts each batch to the other trainer ranks (None with one)


_launch: tuple[Ranks, LaunchGroups] | None = None


def launch_groups() -> LaunchGroups:
    """This process's groups of a launch with rollout workers (after :func:`init_ranks`)."""
    if _launch is None:
        raise RuntimeError("launch_groups() before init_ranks() with distributed.rollout_workers")
    return _launch[1]


def _join_launch(ranks: Ranks, deepspeed: bool) -> Ranks:
    """The launch's world is gloo on every process (control messages, weights and samples go
    through host memory); the trainer ranks' own group, under DeepSpeed, takes the accelerator's
    backend (nccl on CUDA), so their gradients never leave the devices."""
    global _launch
    if _launch is not None:
        return _launch[0]
    dist = torch.distributed
    if not dist.is_initialized():
        if torch.cuda.is_available():  # each process on its own GPU when there are enough
            torch.cuda.set_device(ranks.local_rank % torch.cuda.device_count())
        dist.init_process_group("gloo")  # env:// (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE)
    trainer_ranks, rollout_members = list(range(ranks.world_size)), [0, *range(ranks.world_size, ranks.launch_size)]
    # A process outside a group only takes part in naming it: the backend is built by its members.
    backend = _accelerator_backend() if deepspeed and not ranks.is_rollout_worker else None
    groups = LaunchGroups(
        trainers=dist.new_group(trainer_ranks, backend=backend) if deepspeed else None,
        weights=dist.new_group(rollout_members, backend="gloo"),
        samples=dist.new_group(rollout_members, backend="gloo"),
        batches=dist.new_group(trainer_ranks, backend="gloo") if ranks.world_size > 1 else None,
    )
    if deepspeed and not ranks.is_rollout_worker:
        _init_deepspeed_comm()  # adopts the launch's world; DeepSpeed is handed the trainers' group (a3po.parallel.updaters)
    joined = replace(ranks, group=None if ranks.is_rollout_worker else groups.trainers)
    _launch = (joined, groups)
    return joined


def _accelerator_backend() -> str:
    from deepspeed.accelerator import get_accelerator

    # gloo with DS_ACCELERATOR=cpu, nccl on CUDA: the accelerator names its own backend.
    return get_accelerator().communication_backend_name()


def _init_deepspeed_comm() -> None:
    import deepspeed

    deepspeed.init_distributed(dist_backend=_accelerator_backend())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
