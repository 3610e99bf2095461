"""Groups without signal, filtered before the update and refilled (``rl.filter_groups``; DAPO's
dynamic sampling, Yu et al., 2025, sec. 3.2).

A GRPO group whose rewards are all equal has zero advantage under a group-relative estimator:
it costs a full update and moves nothing. With the filter on, the producer grades batch ``j``,
keeps the groups whose rewards differ (:func:`~a3po.algorithms.advantages.groups_with_signal`)
and draws further prompts for the missing ones, round ``k = 1, 2, ...`` of
``B - kept`` prompts each (a function of (seed, j, k): a resumed run draws the same), until the
batch has ``B`` groups with signal or the step has drawn ``max_prompts`` prompts (the batch's own
``B`` included). Short of ``B``, the batch is filled up with the earliest groups without signal,
so every batch keeps the size the staleness bound counts, and the step says so
(``filter/short_groups``).

Refills never train on older weights than the batch's own: they are sampled after it, on the
version the engine holds when it ends (deterministic schedule: the version the batch switched
to; threaded: the newest published), so the staleness bound holds for every row.

The step's figures (``filter/*``): ``prompts_drawn``, ``filtered_frac`` (the drawn groups
without signal), ``signal_groups`` and ``short_groups`` (of the ``B`` trained),
``prompts_per_signal_group`` (drawn over trained with signal; absent at a step with none),
``generated_reward_mean`` (over every sample drawn: ``reward/mean`` is the trained batch's, which
the filter raises or lowers) and ``refill_gen_s`` (the refills' generation and grading time, inside
the batch's ``gen_time_s``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from a3po.algorithms.advantages import groups_with_signal
from a3po.rollout.types import RolloutBatch, stack_rows


@dataclass(frozen=True)
class GroupFilter:
    max_prompts: int
    """Prompts a step may draw in all (its batch's included), >= the batch's prompts."""


def refill_seed(seed: int, index: int, round_: int) -> int:
    """Sampling seed of refill round ``round_`` of batch ``index`` (never a batch's own seed)."""
    return (seed * 1_000_003 + index * 7919 + round_ * 104_729 + 2_147_483_000) % (2**31 - 1)


def refill_picks(n_rows: int, n: int, seed: int, index: int, round_: int, drawn: set[int]) -> list[int]:
    """``n`` row indices for refill round ``round_`` of batch ``index``, a function of those alone
    (and of ``drawn``, the rows this step drew already, avoided while enough others remain)."""
    rng = random.Random(f"{seed}:refill:{index}:{round_}")
    fresh = [i for i in range(n_rows) if i not in drawn]
    return rng.sample(fresh if len(fresh) >= n else range(n_rows), n)


@dataclass
class Drawn:
    """One graded draw of the step: its rollout, per-row rewards and decoded completions."""

    rollout: RolloutBatch
    rewards: torch.Tensor
    completions: list[str]


def _groups(draw: Drawn) -> dict[int, list[int]]:
    rows: dict[int, list[int]] = {}
    for i, m in enumerate(draw.rollout.meta):
        rows.setdefault(int(m["group"]), []).append(i)
    return rows


def signal_of(draw: Drawn) -> dict[int, bool]:
    ids = torch.tensor([int(m["group"]) for m in draw.rollout.meta], device=draw.rewards.device)
    return groups_with_signal(draw.rewards, ids)


def assemble(draws: list[Drawn], batch_prompts: int, index: int, pad_id: int) -> tuple[Drawn, dict[str, float]]:
    """Batch ``index`` from the step's draws: the first ``batch_prompts`` groups with signal in
    draw order, then (short of that) the first without; groups renumbered
    ``index * batch_prompts + position`` as the sampler numbers a batch's. Returns the batch and
    the ``filter/*`` counts (not the refill time, which the producer measures)."""
    with_signal, without = [], []
    for d, draw in enumerate(draws):
        signal = signal_of(draw)
        for g, rows in _groups(draw).items():
            (with_signal if signal[g] else without).append((d, rows))
    chosen = with_signal[:batch_prompts]
    short = batch_prompts - len(chosen)
    chosen += without[:short]
    if len(chosen) < batch_prompts:
        raise RuntimeError(f"batch {index}: {len(chosen)} groups drawn, {batch_prompts} needed")
    batch = stack_rows([(draws[d].rollout, rows) for d, rows in chosen], pad_id)
    offset = 0
    for pos, (_, rows) in enumerate(chosen):
        for r in range(offset, offset + len(rows)):
            batch.meta[r]["group"] = index * batch_prompts + pos
        offset += len(rows)
    rewards = torch.cat([draws[d].rewards[torch.tensor(rows, device=draws[d].rewards.device)] for d, rows in chosen])
    completions = [draws[d].completions[r] for d, rows in chosen for r in rows]
    drawn = len(with_signal) + len(without)
    trained_signal = batch_prompts - short
    metrics = {"filter/prompts_drawn": float(drawn), "filter/filtered_frac": len(without) / drawn,
               "filter/signal_groups": float(trained_signal), "filter/short_groups": float(short),
               # reward/mean is the trained batch's, raised by the filter; this one compares with an unfiltered run
               "filter/generated_reward_mean": float(torch.cat([d.rewards for d in draws]).mean())}
    if trained_signal:
        metrics["filter/prompts_per_signal_group"] = drawn / trained_signal
    return Drawn(batch, rewards, completions), metrics
