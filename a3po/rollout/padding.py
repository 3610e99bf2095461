"""Left padding: the one layout of token batches in this project (rollout prompts, supervised
warm-start sequences). Every row ends at the same column, so decoding appends to all rows at
once; position ids come from the mask (:func:`a3po.models.logprobs.position_ids_from_mask`)."""

from __future__ import annotations

from typing import Sequence

import torch


def left_pad(seqs: Sequence[Sequence[int]], pad_value: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, mask)``, both ``(N, max_len)`` int64 on the CPU: each sequence right-aligned,
    ``pad_value`` before it, ``mask`` 1 on the sequence and 0 on the padding."""
    width = max(len(s) for s in seqs)
    values = torch.full((len(seqs), width), pad_value, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            values[i, width - len(s) :] = torch.tensor(list(s), dtype=torch.long)
            mask[i, width - len(s) :] = 1
    return values, mask
