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
