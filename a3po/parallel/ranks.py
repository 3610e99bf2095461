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

import io
import json
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Mapping

import torch


@dataclass(frozen=True)
class Ranks:
    """This process's place among the trainer ranks; collectives are identities at world size 1.

    With rollout workers (``distributed.rollout_workers``, :mod:`a3po.placement.remote_rollouts`) the launch
    is ``world_size`` trainer ranks followed by ``rollout_workers`` processes that only generate;
    the trainer ranks form torch's default world (DeepSpeed's), so the trainer collectives below
    (``shard``, ``sum``, ``gather_rows``, ``from_main``, ``barrier``) are theirs alone; ``share``
    reaches the whole launch (a :class:`Link` of its own, see :func:`init_ranks`)."""

    rank: int = 0
    world_size: int = 1  # trainer ranks
    local_rank: int = 0
    rollout_workers: int = 0

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
        torch.distributed.all_reduce(x, op=torch.distributed.ReduceOp.SUM)
        return x

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` (same shape on all ranks) along dim 0, in rank order."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, x.detach().contiguous())
        return torch.cat(parts, dim=0)

    def gather_to_main(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` (tensors in plain containers, as a checkpoint holds them) as a list
        on rank 0 (None elsewhere). It travels in torch's save format and is read back with
        ``weights_only=True``, so what a rank receives can never run code."""
        if self.world_size == 1:
            return [obj]
        buf = io.BytesIO()
        torch.save(obj, buf)
        data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        sizes = [int(n) for n in _all_gather_in_world(torch.tensor([data.numel()], dtype=torch.int64))]
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        padded[: data.numel()] = data
        parts = _all_gather_in_world(padded)
        if not self.is_main:
            return None
        return [torch.load(io.BytesIO(bytes(p[:n].numpy())), map_location="cpu", weights_only=True)
                for p, n in zip(parts, sizes, strict=True)]

    def from_main(self, obj: Any) -> Any:
        """Rank 0's ``obj`` (JSON values) on every trainer rank (rollout workers take no part)."""
        if self.world_size == 1:
            return obj
        return broadcast_json(obj, self.is_main, _broadcast_in_world)

    def share(self, obj: Any) -> Any:
        """Rank 0's ``obj`` (JSON values) on every process of the launch, rollout workers included."""
        if self.launch_size == 1:
            return obj
        if self.rollout_workers:
            return launch_links().launch.share(obj)
        return broadcast_json(obj, self.is_main, _broadcast_in_world)

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()


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
            f"launch {rollout_workers + 1}, e.g. torchrun --nproc_per_node {rollout_workers + 1} (trainer ranks "
            "first, then the workers)"
        )
    return Ranks(rank, world - rollout_workers, local, rollout_workers)


def init_ranks(deepspeed_config: str | None, rollout_workers: int = 0) -> Ranks:
    """Join the trainer ranks (idempotent). Without a DeepSpeed config this is one plain process,
    and a launch of several ranks is refused: they would train independent copies into one folder.
    With rollout workers: torch's world is the trainer ranks' (under DeepSpeed), the workers
    reach trainer rank 0 through links of their own (:func:`_join_launch`; the weights and samples
    travel through host memory, see a3po.placement.worker_wire)."""
    ranks = ranks_from_env(rollout_workers=rollout_workers)
    if deepspeed_config is None and ranks.world_size > 1:
        if rollout_workers:
            raise RuntimeError(
                f"launched as {ranks.launch_size} processes with distributed.rollout_workers "
                f"{rollout_workers}: that leaves {ranks.world_size} trainer ranks, but "
                "distributed.deepspeed_config is null: set it (e.g. infra/deepspeed_zero2.json) for data-parallel "
                f"trainer ranks, or launch {rollout_workers + 1} processes"
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
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    _init_deepspeed_comm()
    return ranks


def _broadcast_in_world(t: torch.Tensor) -> None:
    """Broadcast the CPU tensor ``t`` from rank 0 of the trainers' world, through the device NCCL
    needs where the world is NCCL's."""
    if torch.distributed.get_backend() != "nccl":
        torch.distributed.broadcast(t, src=0)
        return
    on_device = t.to(torch.device("cuda", torch.cuda.current_device()))
    torch.distributed.broadcast(on_device, src=0)
    t.copy_(on_device.cpu())


def _all_gather_in_world(t: torch.Tensor) -> list[torch.Tensor]:
    """Every trainer rank's CPU tensor ``t`` (same shape on all), in rank order, through the device
    NCCL needs where the world is NCCL's."""
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.distributed.get_backend() == "nccl" else t.device
    parts = [torch.empty_like(t, device=dev) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(parts, t.to(dev))
    return [p.cpu() for p in parts]


def broadcast_json(obj: Any, is_src: bool, broadcast: Callable[[torch.Tensor], None]) -> Any:
    """The source's ``obj`` on every member of a broadcast, as JSON text: what one process sends
    another can never run code there (a pickle could)."""
    data = json.dumps(obj).encode() if is_src else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    broadcast(size)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if is_src else torch.empty(int(size), dtype=torch.uint8)
    broadcast(buf)
    return json.loads(bytes(buf.numpy()))


class Link:
    """A gloo process group of its own over some processes of the launch, outside torch's default
    world (which is the trainer ranks'): built on the launcher's rendezvous store under its own
    prefix. Its ranks are the positions in ``members`` (global ranks), so the launch's rank 0 is
    the link's rank 0 whenever it is a member. Blocking calls, one thread per link at a time."""

    def __init__(self, store: Any, name: str, members: list[int], launch_rank: int) -> None:
        self.rank, self.size = members.index(launch_rank), len(members)
        self.pg = torch.distributed.ProcessGroupGloo(torch.distributed.PrefixStore(f"a3po/{name}/", store), self.rank,
                                                     self.size, _TIMEOUT)

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([t], opts).wait()

    def send(self, t: torch.Tensor, dst: int) -> None:
        self.pg.send([t], dst, 0).wait()

    def recv(self, t: torch.Tensor, src: int) -> None:
        self.pg.recv([t], src, 0).wait()

    def share(self, obj: Any) -> Any:
        """Link rank 0's ``obj`` (JSON values) on every member."""
        return broadcast_json(obj, self.rank == 0, lambda t: self.broadcast(t, 0))


_TIMEOUT = timedelta(minutes=30)  # torch's default for gloo


@dataclass(frozen=True)
class LaunchLinks:
    """What a process of a launch with rollout workers (trainer ranks ``0..T-1``, workers
    ``T..T+N-1``) talks over besides the trainers' world, made once per process by :func:`init_ranks`."""

    launch: Link  # every process: Ranks.share
    weights: Link | None  # rank 0 + workers: every version, broadcast from rank 0
    samples: Link | None  # rank 0 + workers: each worker's batches, sent to rank 0
    # ranks 0..T-1, a gloo group of the trainers' world: rank 0 broadcasts each batch (None with one trainer)
    batches: Any


_launch: tuple[Ranks, LaunchLinks] | None = None


def launch_links() -> LaunchLinks:
    """This process's links of a launch with rollout workers (after :func:`init_ranks`)."""
    if _launch is None:
        raise RuntimeError("launch_links() before init_ranks() with distributed.rollout_workers")
    return _launch[1]


def _join_launch(ranks: Ranks, deepspeed: bool) -> Ranks:
    """Torch's default world is the trainer ranks' alone, so DeepSpeed (whose world it is: ZeRO-3
    checks its parameter trace and builds its optimizer over the whole world) sees data-parallel
    ranks only, with the accelerator's backend (nccl on CUDA). Rank 0 reaches the workers, and
    the launch its processes, through gloo :class:`Link` s of their own on the launcher's store:
    control messages, weights and samples through host memory."""
    global _launch
    if _launch is not None:
        return _launch[0]
    dist = torch.distributed
    if torch.cuda.is_available():  # each process on its own GPU when there are enough
        torch.cuda.set_device(ranks.local_rank % torch.cuda.device_count())
    store, _, _ = next(dist.rendezvous("env://"))  # the launcher's store (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE)
    batches = None
    if deepspeed and not ranks.is_rollout_worker:
        dist.init_process_group(_accelerator_backend(), store=dist.PrefixStore("a3po/trainers/", store),
                                rank=ranks.rank,
                                world_size=ranks.world_size, timeout=_TIMEOUT)
        _init_deepspeed_comm()  # adopts the trainers' world
        batches = dist.new_group(list(range(ranks.world_size)), backend="gloo") if ranks.world_size > 1 else None
    rollout = [0, *range(ranks.world_size, ranks.launch_size)]
    in_rollout = ranks.rank in rollout
    links = LaunchLinks(
        launch=Link(store, "launch", list(range(ranks.launch_size)), ranks.rank),
        weights=Link(store, "weights", rollout, ranks.rank) if in_rollout else None,
        samples=Link(store, "samples", rollout, ranks.rank) if in_rollout else None,
        batches=batches,
    )
    _launch = (ranks, links)
    return ranks


def close_ranks() -> None:
    """Leave the launch in step: every process waits for the others (rank 0 exports last), then
    the process groups are torn down before the interpreter exits. A rank that exits with its
    groups alive can abort in their destructors ("terminate called without an active
    exception") while the others still finish, failing a run that trained to the end."""
    global _launch
    dist = torch.distributed
    if _launch is not None:
        _launch[1].launch.share(None)  # a barrier over the whole launch, workers included
        _launch = None  # the links' gloo groups go with it
    elif dist.is_available() and dist.is_initialized():
        dist.barrier()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


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
