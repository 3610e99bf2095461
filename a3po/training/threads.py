"""Intra-op threads of the training updates where the trainer has the machine to itself.

torch keeps an intra-op thread count per Python thread (OpenMP's count belongs to the calling
thread; a thread that has not set one takes the count last set anywhere when it runs its first
op). The trainer and the in-process rollout producer are two threads of one process:

* where they overlap (asynchronous variants: the producer decodes batch j + 1 while the trainer
  trains on batch j) each keeps ``torch_threads``, so the two share the cores;
* where they take turns (staleness bound 0, rollouts in process: the producer starts batch j
  only once version j is published, and the trainer waits for that batch) the training update
  takes every core the process may use (``update_threads``), since the producer is idle meanwhile.

Only the update: its forward, backward and AdamW give the same bits on 1 or 2 threads (tiny
preset, measured), whereas decoding need not. The generic decoder's CPU
``scaled_dot_product_attention`` with one query splits its key sum by thread count (behaviour
log-probs move by ~1e-6). The fast ``llama_like`` decoder (:mod:`a3po.models.decoders`) avoids that
kernel and gave the same bits on 1, 2 and 3 threads for the tiny preset (16 x 8 rows, 24 tokens,
measured), but not for every shape: a GEMM as small as a 32 -> 40 head already differs between 1
and 3 threads (MKL picks its split by thread count and shape). So generation and evaluation stay
on ``torch_threads``, and a run is reproducible bit for bit for a given config on a given machine.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

from a3po.config import TrainConfig, effective_max_staleness


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call on this platform
        return os.cpu_count() or 1


def producer_and_trainer_alternate(cfg: TrainConfig) -> bool:
    """Whether the trainer thread and the in-process producer thread never compute at once. Not
    so under DeepSpeed ranks or rollout workers: other processes share the machine."""
    return (effective_max_staleness(cfg.rl) == 0 and not cfg.distributed.rollout_workers
            and cfg.distributed.deepspeed_config is None and not cfg.oppo.inter)


def update_threads(cfg: TrainConfig) -> int:
    """Intra-op threads of the trainer thread during a training update (``cfg.update_threads``,
    0 = every core, where the producer idles meanwhile; ``torch_threads`` elsewhere)."""
    if not producer_and_trainer_alternate(cfg):
        return cfg.torch_threads
    return cfg.update_threads or max(cfg.torch_threads, usable_cores())


@contextlib.contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """The calling thread computes on ``n`` intra-op threads inside the block; its count is restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
