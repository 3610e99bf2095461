"""The rollout interface: what the producer, OPPO and the trainer exchange with an engine, whichever
it is (:mod:`a3po.rollout.engines` names them).

* :class:`SamplingParams`: how to sample (length, temperature, top-p).
* :class:`RolloutBatch`: what comes back, padded for training, with each generated token's
  behaviour log-prob and policy version.
* The decode hooks an engine calls while it decodes: :data:`BetweenSteps` (load newer weights
  between decode steps), :data:`OnToken` (OPPO's streamed scoring), :data:`StopEarly` (OPPO's
  over-commitment).
* :class:`Engine`: every member its callers use. A new engine implements it in a module of
  ``a3po/rollout`` and is registered in :mod:`a3po.rollout.engines` under a name declared in
  :data:`a3po.catalog.ROLLOUT_ENGINE_NAMES`; tests/rollout/test_engines.py checks the engines' classes
  against it.

Nothing here imports an engine, so an engine's module imports this one and no other engine's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class RolloutBatch:
    """Prompt + response per row, padded into one ``(N, L)`` block ready for training.

    ``response_mask`` marks generated tokens (the EOS included); ``behav_logp`` and
    ``versions`` are defined there (0 and -1 elsewhere)."""

    input_ids: torch.Tensor  # (N, L) left-padded prompt, then response, right-padded
    attention_mask: torch.Tensor  # (N, L)
    response_mask: torch.Tensor  # (N, L) bool
    behav_logp: torch.Tensor  # (N, L) float32
    versions: torch.Tensor  # (N, L) int64, -1 outside the response
    finished: torch.Tensor  # (N,) bool: stopped on EOS (False = cut at max_new_tokens)
    prompt_len: int  # padded prompt width P; responses start at column P
    meta: list[dict] = field(default_factory=list)  # per-row data carried along (id, gold, group, ...)

    @property
    def responses(self) -> list[list[int]]:
        """Generated token ids per row, EOS included."""
        return [row[m].tolist() for row, m in zip(self.input_ids, self.response_mask, strict=True)]

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def stack_rows(parts: Sequence[tuple[RolloutBatch, Sequence[int]]], pad_id: int) -> RolloutBatch:
    """The rows ``rows`` of each ``batch`` in ``parts``, in that order, as one batch in the same
    layout: every prompt right-aligned at the widest prompt's column ``P``, every response starting
    there, right-padded to the longest (pad ``pad_id``, attention 0, behaviour log-prob 0, version
    -1, as the engines pad). Batches sampled separately have their own widths; this re-pads them."""
    parts = [(b, list(rows)) for b, rows in parts if len(rows)]
    if not parts:
        raise ValueError("stack_rows needs at least one row")
    p = max(b.prompt_len for b, _ in parts)
    width = p + max(b.input_ids.shape[1] - b.prompt_len for b, _ in parts)
    n = sum(len(rows) for _, rows in parts)
    first = parts[0][0].input_ids
    ids = torch.full((n, width), pad_id, dtype=torch.long, device=first.device)
    attn = torch.zeros((n, width), dtype=torch.long, device=first.device)
    resp = torch.zeros((n, width), dtype=torch.bool, device=first.device)
    logp = torch.zeros((n, width), dtype=torch.float32, device=first.device)
    versions = torch.full((n, width), -1, dtype=torch.long, device=first.device)
    finished, meta, i = [], [], 0
    for b, rows in parts:
        idx = torch.tensor(rows, device=b.input_ids.device)
        left, right = p - b.prompt_len, p - b.prompt_len + b.input_ids.shape[1]  # the batch's columns here
        k = slice(i, i + len(rows))
        ids[k, left:right] = b.input_ids[idx]
        attn[k, left:right] = b.attention_mask[idx]
        resp[k, left:right] = b.response_mask[idx]
        logp[k, left:right] = b.behav_logp[idx]
        versions[k, left:right] = b.versions[idx]
        finished.append(b.finished[idx])
        meta += [dict(b.meta[r]) for r in rows] if b.meta else [{} for _ in rows]
        i += len(rows)
    return RolloutBatch(ids, attn, resp, logp, versions, torch.cat(finished), p, meta)


BetweenSteps = Callable[[int], "int | None"]
"""``between_steps(t)`` before decode step ``t``: the version of newer weights it just loaded, or None."""
OnToken = Callable[[int, torch.Tensor, torch.Tensor], None]
"""``on_token(t, tokens, alive)`` after decode step ``t``: the ``(n,)`` tokens sampled there and which
rows were still alive to sample them."""
StopEarly = Callable[[torch.Tensor], bool]
"""``stop_early(done)`` after a decode step, given the ``(n,)`` mask of rows done: whether to end the batch there."""


class Engine(Protocol):
    """A rollout engine: samples batches of token-id prompts and loads weights tagged with a version."""

    version: int
    """Policy version of the weights now loaded."""
    mid_batch_updates: bool
    """Whether ``between_steps`` may swap weights between decode steps."""
    pad_token_id: int
    """The id a returned batch is padded with (OPPO packs carried rows with it)."""

    def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seed: int,
        between_steps: BetweenSteps | None = None,
        meta: list[dict] | None = None,
        on_token: OnToken | None = None,
    ) -> RolloutBatch:
        """Sample ``params.max_new_tokens`` at most per row, reproducibly for ``seed``; ``meta`` is
        carried per row into the batch; ``on_token``: each decode step's column (OPPO's streamed scoring)."""
        ...

    def generate_until(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seed: int,
        row_budget: torch.Tensor,
        stop_early: StopEarly,
        between_steps: BetweenSteps | None = None,
        on_token: OnToken | None = None,
    ) -> RolloutBatch:
        """OPPO's over-committed decoding: row ``i`` stops at ``row_budget[i]`` new tokens, and the
        whole batch as soon as ``stop_early(done)`` (the ``(n,)`` mask of rows done) is true after
        a decode step; unfinished rows come back with their tokens so far (``finished`` False).
        ``on_token(t, tokens, alive)``: each decode step's column, for OPPO's streamed scoring."""
        ...

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None: ...

    @property
    def device(self) -> torch.device:
        """Where the batches it returns live (the trainer's device)."""
        ...

    def close(self) -> None: ...
