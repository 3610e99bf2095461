"""Rollout engine in plain torch + transformers: batched sampling with a KV cache.

Prompts are left-padded so every row decodes at the same column; finished rows keep
decoding pad tokens that are masked out. Each generated token records the behaviour
log-prob of the distribution it was actually sampled from (temperature and top-p applied)
and the policy version of the weights that produced it. Between decode steps an optional
``between_steps`` hook may swap the weights (asynchronous RL's weight push): later tokens
then carry the new version, and the KV cache of earlier tokens is recomputed with the new
weights (as AReaL's interruptible generation discards the stale cache), so a token's
behaviour log-prob is exactly that of its recorded version given its prefix.

The model runs through an incremental decoder (:mod:`a3po.models.decoders`): a fast one for Qwen2 /
Llama-style models (KV cache preallocated at full width, a few tensor ops per layer and step, a
GRPO group's shared prompt prefilled once) or the model's own forward with a DynamicCache.

Everything stays on the model's device (the returned batch too); the sampling generator must
live there as well (see :mod:`a3po.devices`).
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch

from a3po.devices import model_device, sampling_generator
from a3po.models.decoders import decoder_for, forget_fused
from a3po.models.logprobs import position_ids_from_mask, sampling_log_softmax
from a3po.rollout.padding import left_pad
from a3po.rollout.sampling import SAMPLERS
from a3po.rollout.types import BetweenSteps, OnToken, RolloutBatch, SamplingParams, StopEarly


class RolloutEngine:
    """Samples from ``model`` in batches. ``version`` is the policy version of the current
    weights; ``between_steps(step)`` may load new weights and return their version. ``decoder``:
    the incremental decoder (:mod:`a3po.models.decoders`; ``auto`` = the fast one registered for the
    model's type where it applies, else the model's own forward). ``sampler``: how a token is drawn
    (:data:`a3po.rollout.sampling.SAMPLERS`)."""

    def __init__(self, model: torch.nn.Module, eos_token_id: int, pad_token_id: int, version: int = 0,
                 decoder: str = "auto", sampler: str = "multinomial") -> None:
        self.model = model
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.version = version
        self.decoder = decoder
        self.draw = SAMPLERS.get(sampler)  # an unknown sampler fails here, not at the first batch
        decoder_for(model, decoder)  # an unknown or unsupported decoder fails here, not at the first batch
        forget_fused(model)  # the model may have changed since another engine decoded it

    # --- the rollout-engine interface (a3po.rollout.types.Engine): what the producer calls ----------------
    mid_batch_updates = True  # between_steps may swap weights between decode steps

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        self.model.load_state_dict(state)
        forget_fused(self.model)
        self.version = version

    def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seed: int,
        between_steps: BetweenSteps | None = None,
        meta: list[dict] | None = None,
        on_token: OnToken | None = None,
    ) -> RolloutBatch:
        """:meth:`generate` with a sampling generator seeded by ``seed`` on the model's device."""
        gen = sampling_generator(model_device(self.model), seed)
        return self.generate(prompts, params, generator=gen, between_steps=between_steps, meta=meta, on_token=on_token)

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
        """OPPO's over-committed decoding (:mod:`a3po.oppo.overcommit`): :meth:`generate` seeded as
        :meth:`generate_batch` is, row ``i`` capped at ``row_budget[i]`` new tokens, stopped when
        ``stop_early(done)`` says so; unfinished rows come back with their tokens so far."""
        gen = sampling_generator(model_device(self.model), seed)
        return self.generate(prompts, params, generator=gen, between_steps=between_steps, on_token=on_token,
                             row_budget=row_budget, stop_early=stop_early)

    @property
    def device(self) -> torch.device:
        """Where the batches it returns live."""
        return model_device(self.model)

    def close(self) -> None:
        """Nothing to release: the model is the caller's."""

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        generator: torch.Generator | None = None,
        between_steps: BetweenSteps | None = None,
        meta: list[dict] | None = None,
        on_token: OnToken | None = None,
        row_budget: torch.Tensor | None = None,
        stop_early: StopEarly | None = None,
    ) -> RolloutBatch:
        """Sample up to ``params.max_new_tokens`` per row. Options of OPPO (all None: plain
        decoding): ``on_token(t, tokens, alive)`` sees each decode step's ``(n,)`` tokens and
        alive mask (streamed scoring); ``row_budget`` ``(n,)`` caps each row's new tokens (a row
        that reaches it stops unfinished); ``stop_early(done)`` gets the ``(n,)`` mask of rows
        done so far after each step and may end decoding there (over-commitment)."""
        if len(prompts) == 0:
            raise ValueError("generate() needs at least one prompt")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
        device = model_device(self.model)
        if generator is not None and generator.device.type != device.type:
            raise ValueError(f"the sampling generator is on {generator.device} but the model is on {device}; "
                             "create it with a3po.devices.sampling_generator(device, seed)")
        n = len(prompts)
        ids, mask = left_pad(prompts, self.pad_token_id)
        width = ids.shape[1]
        ids, mask = ids.to(device), mask.to(device)

        new_tokens = torch.full((n, params.max_new_tokens), self.pad_token_id, dtype=torch.long, device=device)
        new_logp = torch.zeros((n, params.max_new_tokens), dtype=torch.float32, device=device)
        new_version = torch.full((n, params.max_new_tokens), -1, dtype=torch.long, device=device)
        alive = torch.ones(n, dtype=torch.bool, device=device)
        finished = torch.zeros(n, dtype=torch.bool, device=device)

        make_decoder = decoder_for(self.model, self.decoder)
        max_width = width + params.max_new_tokens
        # Attention mask of everything fed so far: the prompt's, then per generated column whether
        # its row was still alive when it sampled it (padding after EOS is ignored).
        attn = torch.zeros((n, max_width), dtype=mask.dtype, device=device)
        attn[:, :width] = mask
        was_training = self.model.training
        self.model.eval()
        decoder = None
        # The previous step's tokens and alive mask, fed to decoder.step; a prefill (step 0, or
        # after new weights) never reads them.
        tok = torch.full((n,), self.pad_token_id, dtype=torch.long, device=device)
        alive_before = alive
        for t in range(params.max_new_tokens):
            if between_steps is not None:
                v = between_steps(t)
                if v is not None:
                    # New weights: a cache built by the old ones would make later tokens come
                    # from neither version, so the prefix (prompt + tokens so far) is run again.
                    self.version, decoder = v, None
            if decoder is None:
                decoder = make_decoder(self.model, n, max_width)
                prefix_mask = attn[:, : width + t]
                prefix_pos = position_ids_from_mask(prefix_mask)
                logits = decoder.prefill(torch.cat([ids, new_tokens[:, :t]], dim=1), prefix_mask, prefix_pos)
                positions = prefix_pos[:, -1]
            else:
                positions = positions + 1
                logits = decoder.step(tok, alive_before, positions)
            logp = sampling_log_softmax(logits, params.temperature, params.top_p)  # (n, V)
            if params.temperature == 0:
                tok = logp.argmax(-1)
            else:
                tok = self.draw(logp.exp(), generator)
            tok = torch.where(alive, tok, torch.full_like(tok, self.pad_token_id))
            new_tokens[:, t] = tok
            new_logp[:, t] = torch.where(alive, logp.gather(-1, tok[:, None]).squeeze(-1),
                                         torch.zeros_like(new_logp[:, t]))
            new_version[:, t] = torch.where(alive, torch.full_like(tok, self.version), new_version[:, t])
            hit_eos = alive & (tok == self.eos_token_id)
            finished |= hit_eos
            alive_before = alive
            alive = alive & ~hit_eos
            if on_token is not None:
                on_token(t, tok, alive_before)
            if row_budget is not None:
                alive = alive & (row_budget.to(device) > t + 1)
            # A CPU-GPU sync point per decode step: the price of stopping early.
            if not bool(alive.any()) or (stop_early is not None and stop_early(~alive)):
                break
            attn[:, width + t] = alive_before
        self.model.train(was_training)

        steps = t + 1
        resp_mask = new_version[:, :steps] >= 0
        return RolloutBatch(
            input_ids=torch.cat([ids, new_tokens[:, :steps]], 1),
            attention_mask=torch.cat([mask, resp_mask.long()], 1),
            response_mask=torch.cat([torch.zeros_like(mask, dtype=torch.bool), resp_mask], 1),
            behav_logp=torch.cat([torch.zeros_like(mask, dtype=torch.float32), new_logp[:, :steps]], 1),
            versions=torch.cat([torch.full_like(mask, -1), new_version[:, :steps]], 1),
            finished=finished,
            prompt_len=width,
            meta=list(meta) if meta is not None else [{} for _ in range(n)],
        )


class DecodingCancelled(RuntimeError):
    """:func:`generate_text` stopped because its ``cancel`` event was set."""


def generate_text(
    model: torch.nn.Module,
    tokenizer,
    prompts: Sequence[str],
    params: SamplingParams,
    seed: int = 0,
    batch_size: int = 32,
    cancel: threading.Event | None = None,
) -> list[str]:
    """Decode completions for text prompts (the evaluation entry point). Greedy when
    ``params.temperature == 0``; EOS and padding are stripped from the returned text. ``cancel``:
    set from another thread, decoding stops at its next token with :class:`DecodingCancelled`
    (a stop of the trainer ends an evaluation beside it within one decode step)."""
    engine = RolloutEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    gen = sampling_generator(model_device(model), seed)
    on_token = None if cancel is None else _raise_when_set(cancel)
    out: list[str] = []
    for start in range(0, len(prompts), batch_size):
        chunk = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts[start : start + batch_size]]
        batch = engine.generate(chunk, params, generator=gen, on_token=on_token)
        for resp in batch.responses:
            if resp and resp[-1] == tokenizer.eos_token_id:
                resp = resp[:-1]
            out.append(tokenizer.decode(resp, skip_special_tokens=True))
    return out


def _raise_when_set(cancel: threading.Event) -> OnToken:
    def check(t: int, tokens: torch.Tensor, alive: torch.Tensor) -> None:
        if cancel.is_set():
            raise DecodingCancelled(f"decoding cancelled at token {t}")
    return check
