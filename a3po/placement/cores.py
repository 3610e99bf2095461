"""Which cores each role computes on: thread budgets, and CPU affinity where the roles are processes.

Generation and the training update are the two roles of a run. Where they run decides how they
may share the machine:

* **colocated** (``distributed.rollout_workers: 0``): one process, the producer and the trainer
  are two of its threads. Where they overlap (asynchronous variants: the producer decodes batch
  j + 1 while the trainer trains on batch j) each keeps ``torch_threads`` intra-op threads, so the
  two share the cores; where they take turns (staleness bound 0: the producer starts batch j only
  once version j is published, and the trainer waits for that batch) the update takes every core
  the process may use (``update_threads``), and so may generation (``generate_threads: 0``; 1 by
  default: with decode steps of milliseconds its OpenMP pool still spins when the update starts),
  since the other phase idles meanwhile.
* **disaggregated** (``rollout_workers: N``): generation in processes of their own. With
  ``distributed.rollout_cores: r`` each rollout worker owns ``r`` cores and the trainer ranks on
  the node share the rest: every process pins itself to its slice (CPU affinity) and computes on
  as many intra-op threads as it owns, so a synchronous trainer waiting for its workers leaves
  their cores idle, as a synchronous trainer leaves its rollout GPUs idle while it updates.
  ``rollout_cores: 0`` pins nothing: every process may use every core (``torch_threads`` each).

The thread budgets that follow (``update_threads``, ``generate_threads``) are resolved once per run,
with the run's other derived facts, by :class:`a3po.config.plan.RunPlan`; this module pins the cores.

Thread counts can change bits: the update's forward, backward and AdamW gave the same bits on 1 or
2 threads (tiny preset, measured), but decoding need not (the generic decoder's CPU attention
splits its key sum by thread count; MKL picks its GEMM split by thread count and shape). A run is
reproducible bit for bit for a given config on a given machine.
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence

from a3po.config import TrainConfig
from a3po.parallel.ranks import Ranks


def usable_core_ids() -> list[int]:
    """The cores this process may run on (its affinity mask, not the machine's cores)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call on this platform
        return list(range(os.cpu_count() or 1))


def usable_cores() -> int:
    return len(usable_core_ids())


def core_slices(cores: Sequence[int], is_worker: Sequence[bool], rollout_cores: int) -> list[tuple[int, ...]]:
    """The cores each process of a node owns, in local-rank order: rollout workers take
    ``rollout_cores`` each from the top of ``cores`` (the first worker the highest), the trainer
    ranks split the rest evenly from the bottom (a remainder stays unused, so trainer ranks are
    alike). Raises ValueError when a role would get no core."""
    cores, n_workers = sorted(cores), sum(is_worker)
    n_trainers = len(is_worker) - n_workers
    left = len(cores) - n_workers * rollout_cores
    if left < 0 or (n_trainers and left < n_trainers):
        raise ValueError(f"distributed.rollout_cores {rollout_cores}: {n_workers} rollout worker(s) x "
                         f"{rollout_cores} core(s) and {n_trainers} trainer rank(s) need "
                         f"{n_workers * rollout_cores + n_trainers} cores, but this node's processes may use "
                         f"{len(cores)}; lower rollout_cores or launch fewer processes here")
    per_trainer = left // n_trainers if n_trainers else 0
    slices: list[tuple[int, ...]] = []
    worker_k = trainer_k = 0
    for w in is_worker:
        if w:
            hi = len(cores) - worker_k * rollout_cores
            slices.append(tuple(cores[hi - rollout_cores : hi]))
            worker_k += 1
        else:
            slices.append(tuple(cores[trainer_k * per_trainer : (trainer_k + 1) * per_trainer]))
            trainer_k += 1
    return slices


def local_roles(ranks: Ranks, env: Mapping[str, str] = os.environ) -> list[bool]:
    """Per process of this node, in local-rank order, whether it is a rollout worker. torchrun
    gives each node a contiguous block of global ranks (``LOCAL_WORLD_SIZE`` of them, this
    process at ``LOCAL_RANK`` within it)."""
    local_world = int(env.get("LOCAL_WORLD_SIZE", ranks.launch_size))
    first = ranks.rank - ranks.local_rank
    return [first + i >= ranks.world_size for i in range(local_world)]


def pin_process(cores: Sequence[int]) -> bool:
    """Restrict every thread of this process (OpenMP's pool included, which exists by now) to
    ``cores``; threads started later inherit it. False where the OS has no affinity call."""
    if not hasattr(os, "sched_setaffinity"):
        return False
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile; a mask the OS refuses
            continue
    return True


def own_cores(cfg: TrainConfig, ranks: Ranks, env: Mapping[str, str] = os.environ) -> tuple[int, ...] | None:
    """This process's slice under ``distributed.rollout_cores`` (None when it is 0), pinned.
    Call once, at the start of the process: the slices divide the cores it may use then."""
    r = cfg.distributed.rollout_cores
    if not r:
        return None
    mine = core_slices(usable_core_ids(), local_roles(ranks, env), r)[ranks.local_rank]
    pin_process(mine)
    return mine
