"""How a training batch is cut into the minibatches of its optimizer steps (``rl.minibatch_split``).

Each split returns an order of the batch's rows, drawn from the trainer's seeded generator; the
trainer cuts it into ``rl.minibatches`` equal, consecutive chunks.

* ``rows`` (default): rows in a random order (as TRL's GRPOTrainer shuffles): a minibatch
  mixes samples of many prompts, a few of each.
* ``groups``: whole GRPO groups in a random order, so a minibatch holds whole groups where its
  size is a multiple of the group size (as verl splits). The rows of a group share their prompt,
  which the training forward then runs once (``a3po.models.logprobs.response_logits``), and each
  minibatch carries every sample of its prompts. On the tiny preset it learned less than
  ``rows`` in the same steps (docs/variants.md).
"""

from __future__ import annotations

from typing import Callable

import torch

from a3po.registry import Registry

# (group id of each row (n,), generator) -> an order of the n rows
MinibatchSplit = Callable[[torch.Tensor, torch.Generator], torch.Tensor]
MINIBATCH_SPLITS: Registry[MinibatchSplit] = Registry("minibatch split")


@MINIBATCH_SPLITS.register("rows")
def shuffled_rows(group_ids: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return torch.randperm(len(group_ids), generator=generator)


@MINIBATCH_SPLITS.register("groups")
def shuffled_groups(group_ids: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Rows group by group, the groups in a random order, each group's rows in batch order."""
    groups, of_row = torch.unique(group_ids.cpu(), return_inverse=True)
    rank = torch.empty_like(groups)
    rank[torch.randperm(len(groups), generator=generator)] = torch.arange(len(groups))
    return torch.sort(rank[of_row], stable=True).indices
