"""OPPO intra-step overlap: score generated tokens chunk by chunk while the actor decodes.

In PPO-style RLHF the reference model, the critic and the reward model wait for the actor to
finish decoding, then prefill the whole batch. Here each of them keeps its own KV cache: the
prompt is prefilled once, then every chunk of ``k`` new tokens is prefilled incrementally in a
thread of its own while the actor decodes the next chunk (OPPO, "intra-step overlap"). The
figures are those of one-shot scoring (same model, same positions, same mask), up to float
rounding of cached vs full attention (~1e-7 in fp32; tests pin 1e-5).

Conventions are those of :mod:`a3po.rollout.torch_engine` and :mod:`a3po.models.logprobs`: prompts are left-padded,
a generated token's attention-mask column is 1 while its row is alive (the EOS included) and 0
after, and positions skip the padding (:func:`~a3po.models.logprobs.position_ids_from_mask` over the
whole mask so far).

Any causal-LM-shaped model works: the scorer runs the model's base transformer
(``model.base_model``) and a :class:`Head` reads the hidden states. Three heads:

* :class:`LogProbHead`: per-token log-probs through the LM head (reference model, KL);
* :class:`ValueHead`: per-position values through a value head (critic): ``model.score`` of a
  ``*ForTokenClassification`` with ``num_labels=1``, or any ``Linear(hidden, 1)``;
* :class:`RewardHead`: a scalar per sequence at its last attended token through ``model.score``
  of a ``*ForSequenceClassification`` with ``num_labels=1`` (reward model).
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import DynamicCache

from a3po.devices import autocast_for
from a3po.models.logprobs import cache_kwarg, position_ids_from_mask, sampling_log_softmax


class Head(Protocol):
    """Reads a chunk's hidden states into per-position figures.

    ``read`` gets the model, the chunk's hidden states ``(B, T, H)``, the chunk's token ids
    ``(B, T)`` and the carry of the previous chunk (None at the prompt), and returns the chunk's
    figures ``(B, T)`` (float32) and the carry for the next chunk. ``finish`` turns the figures of
    the whole sequence ``(B, L)`` into the result, given the attention mask ``(B, L)``."""

    def read(self, model: torch.nn.Module, hidden: torch.Tensor, ids: torch.Tensor,
             carry: Any) -> tuple[torch.Tensor, Any]: ...

    def finish(self, per_position: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class LogProbHead:
    """``log pi(x_t | x_<t)`` aligned to ``input_ids`` as :func:`a3po.models.logprobs.token_logprobs`
    returns it (column 0 is 0). Token ``t`` is scored by the logits at ``t - 1``: the first
    token of a chunk by the last row of the previous chunk's log-softmax (the carry, ``(B, V)``)."""

    temperature: float = 1.0
    top_p: float = 1.0

    def read(self, model, hidden, ids, carry):
        logp = sampling_log_softmax(model.get_output_embeddings()(hidden), self.temperature, self.top_p)  # (B, T, V)
        first = carry.gather(-1, ids[:, :1]) if carry is not None else torch.zeros_like(logp[:, :1, 0])
        rest = logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
        return torch.cat([first, rest], 1), logp[:, -1]

    def finish(self, per_position, attention_mask):
        return per_position


@dataclass(frozen=True)
class ValueHead:
    """Per-position values ``V(x_<=t)`` of the critic: ``module(hidden)[..., 0]``; ``module``
    None uses ``model.score`` (a ``*ForTokenClassification`` with ``num_labels=1``)."""

    module: torch.nn.Module | None = None

    def read(self, model, hidden, ids, carry):
        head = self.module if self.module is not None else model.score
        return head(hidden)[..., 0].float(), None

    def finish(self, per_position, attention_mask):
        return per_position


@dataclass(frozen=True)
class RewardHead:
    """One score per sequence: ``model.score`` (``*ForSequenceClassification``, ``num_labels=1``)
    at the last attended column, the EOS of a finished answer. ``(B,)``."""

    def read(self, model, hidden, ids, carry):
        return model.score(hidden)[..., 0].float(), None

    def finish(self, per_position, attention_mask):
        cols = torch.arange(attention_mask.shape[1], device=attention_mask.device)
        last = (cols * attention_mask.long()).argmax(-1)  # (B,): rightmost column with mask 1
        return per_position.gather(1, last[:, None]).squeeze(1)


class IncrementalScorer:
    """Scores one left-padded batch: :meth:`prefill` the prompt, :meth:`extend` with each chunk
    of generated tokens, :meth:`result` for the whole sequence. Single-threaded; see
    :class:`ScorerThread` for the overlapped version."""

    def __init__(self, model: torch.nn.Module, head: Head) -> None:
        self.model, self.head = model, head
        self.base = model.base_model
        self._kw = cache_kwarg(self.base) or "past_key_values"
        self._reset()

    def _reset(self) -> None:
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None
        self.ids: list[torch.Tensor] = []
        self.parts: list[torch.Tensor] = []
        self.carry: Any = None

    @torch.no_grad()
    def _forward(self, ids: torch.Tensor, new_mask: torch.Tensor) -> None:
        self.mask = new_mask if self.mask is None else torch.cat([self.mask, new_mask], 1)
        positions = position_ids_from_mask(self.mask)[:, -ids.shape[1]:]
        with autocast_for(self.model):
            out = self.base(input_ids=ids, attention_mask=self.mask, position_ids=positions, use_cache=True,
                            **{self._kw: self.cache})
        part, self.carry = self.head.read(self.model, out.last_hidden_state, ids, self.carry)
        self.ids.append(ids)
        self.parts.append(part.float())

    def prefill(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> None:
        """``(B, P)`` left-padded prompt and its mask; starts a new batch."""
        self._reset()
        self.cache = DynamicCache()
        self._forward(prompt_ids, prompt_mask.long())

    def extend(self, tokens: torch.Tensor, alive: torch.Tensor) -> None:
        """``(B, k)`` generated tokens and ``(B, k)`` mask (1 while the row was alive when the
        token was sampled: the EOS counts, the padding after it does not)."""
        if self.cache is None:
            raise RuntimeError("extend() before prefill()")
        if tokens.shape[1] > 0:
            self._forward(tokens, alive.long())

    def result(self) -> torch.Tensor:
        """The head's result over the whole sequence so far (``(B, L)`` or ``(B,)``)."""
        return self.head.finish(torch.cat(self.parts, 1), self.mask)


_END = object()


class ScorerThread(threading.Thread):
    """An :class:`IncrementalScorer` in its own thread, fed through a queue: the actor's
    decode loop only enqueues tensors and never waits for the scorer until :meth:`result`."""

    def __init__(self, name: str, model: torch.nn.Module, head: Head) -> None:
        super().__init__(name=f"scorer-{name}", daemon=True)
        self.scorer = IncrementalScorer(model, head)
        self.inbox: queue.Queue = queue.Queue()
        self._done = threading.Event()
        self._result: torch.Tensor | None = None
        self._error: str | None = None
        self.busy_s = 0.0  # time spent scoring (the rest is waiting for chunks)
        # The builder's intra-op thread count: a thread that never sets one takes whatever count was
        # set last anywhere (e.g. a synchronous update's every-core count), oversubscribing the cores.
        self.threads = torch.get_num_threads()

    def run(self) -> None:
        torch.set_num_threads(self.threads)
        try:
            while True:
                item = self.inbox.get()
                if item is _END:
                    break
                kind, a, b = item
                t0 = time.perf_counter()
                if kind == "prompt":
                    self.scorer.prefill(a, b)
                elif kind == "chunk":
                    self.scorer.extend(a, b)
                else:  # "finish": the batch is complete
                    self._result = self.scorer.result()
                    self._done.set()
                self.busy_s += time.perf_counter() - t0
        except BaseException as e:  # surfaced by result(), with the traceback
            self._error = f"scorer {self.name} failed: {e!r}\n{traceback.format_exc()}"
            self._done.set()

    def put(self, kind: str, a: torch.Tensor | None = None, b: torch.Tensor | None = None) -> None:
        self.inbox.put((kind, a, b))

    def result(self, timeout: float = 600.0) -> torch.Tensor:
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self.name}: no result within {timeout}s")
        if self._error:
            raise RuntimeError(self._error)
        self._done.clear()
        out, self._result = self._result, None
        return out

    def close(self) -> None:
        self.inbox.put(_END)


class ChunkFeeder:
    """The rollout engine's per-token callback (``on_token`` of either engine's
    ``generate_batch`` / ``generate_until``, :mod:`a3po.rollout.engines`): it collects generated
    tokens and hands every ``chunk_size`` of them to each scorer thread.

    Use: ``feeder.start(prompt_ids, prompt_mask)``, pass ``feeder.on_token`` to ``generate``,
    then ``feeder.finish()`` returns ``{name: result}`` once every scorer has caught up."""

    def __init__(self, scorers: dict[str, ScorerThread], chunk_size: int) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.scorers, self.chunk_size = scorers, chunk_size
        self._tokens: list[torch.Tensor] = []
        self._alive: list[torch.Tensor] = []
        self.chunks_sent = 0

    def start(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> None:
        self._tokens, self._alive, self.chunks_sent = [], [], 0
        for s in self.scorers.values():
            s.put("prompt", prompt_ids, prompt_mask)

    def _flush(self) -> None:
        if not self._tokens:
            return
        tokens, alive = torch.stack(self._tokens, 1), torch.stack(self._alive, 1)
        self._tokens, self._alive = [], []
        for s in self.scorers.values():
            s.put("chunk", tokens, alive)
        self.chunks_sent += 1

    def on_token(self, t: int, token: torch.Tensor, alive: torch.Tensor) -> None:
        """``token`` ``(B,)`` sampled at decode step ``t``; ``alive`` ``(B,)`` whether each row was
        still generating (its mask column)."""
        self._tokens.append(token.clone())
        self._alive.append(alive.long().clone())
        if len(self._tokens) >= self.chunk_size:
            self._flush()

    def finish(self, timeout: float = 600.0) -> dict[str, torch.Tensor]:
        self._flush()
        for s in self.scorers.values():
            s.put("finish")
        return {name: s.result(timeout) for name, s in self.scorers.items()}


def start_scorers(models_and_heads: dict[str, tuple[torch.nn.Module, Head]]) -> dict[str, ScorerThread]:
    """One started :class:`ScorerThread` per name (e.g. ``ref``, ``critic``, ``reward``)."""
    threads = {name: ScorerThread(name, m, h) for name, (m, h) in models_and_heads.items()}
    for t in threads.values():
        t.start()
    return threads


def stop_scorers(threads: dict[str, ScorerThread], timeout: float = 30.0) -> None:
    for t in threads.values():
        t.close()
    for t in threads.values():
        t.join(timeout)

