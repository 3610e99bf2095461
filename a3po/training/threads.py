"""Intra-op threads of one block of the calling thread. How many each role gets (the update, generation)
is decided by :mod:`a3po.placement.cores`."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """The calling thread computes on ``n`` intra-op threads inside the block; its count is restored after.
    torch keeps an intra-op thread count per Python thread (OpenMP's count belongs to the calling
    thread; a thread that has not set one takes the count last set anywhere when it runs its first op)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
