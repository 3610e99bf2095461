"""Log-probs of the distribution tokens are actually sampled from, shared by the rollout
engine (behaviour log-probs, one decode step at a time) and the trainer (one full forward, or
one forward per distinct prompt plus one over the responses: :func:`response_logits`)."""

from __future__ import annotations

import functools
import inspect

import torch
from transformers import DynamicCache

from a3po.devices import autocast_for


def sampling_log_softmax(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0) -> torch.Tensor:
    """``log softmax(logits / T)`` restricted to the top-p nucleus and renormalised.

    Tokens outside the nucleus get ``-inf``. ``temperature == 0`` means greedy and is scored as
    ``T = 1`` (the greedy choice has no sampling distribution of its own). Shape ``(..., V)``.
    """
    logits = logits.float()
    if temperature > 0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    if top_p >= 1.0:
        return logp
    sorted_logp, order = torch.sort(logp, dim=-1, descending=True)
    cum = sorted_logp.exp().cumsum(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
    drop_sorted = (cum - sorted_logp.exp()) >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    logp = logp.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logp, dim=-1)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: 0 at each row's first real token."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    top_p: float = 1.0,
    return_entropy: bool = False,
    start: int = 1,
    share_prompt: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-prob of ``input_ids[:, t]`` given the prefix, aligned to ``input_ids``.

    Returns ``(B, L)``, 0 in the columns before ``start`` (column 0 has no prefix; the trainer
    passes the prompt width, so the head and the softmax run on the response's positions only).
    With ``share_prompt``, rows whose first ``start`` columns are the same run them once
    (:func:`response_logits`). With ``return_entropy`` also the entropy of the next-token
    distribution at each position, same alignment.
    """
    length = input_ids.shape[1]
    start = max(1, min(start, length))
    with autocast_for(model):
        logits = response_logits(model, input_ids, attention_mask, start, share_prompt)
    picked, ent = picked_logprobs(logits, input_ids[:, start:], temperature, top_p, return_entropy)
    logp = torch.cat([picked.new_zeros((picked.shape[0], start)), picked], dim=1)
    if not return_entropy:
        return logp
    return logp, torch.cat([ent.new_zeros((ent.shape[0], start)), ent], dim=1)


def picked_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0,
                    return_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log p(targets)`` under :func:`sampling_log_softmax` of ``logits`` ``(..., V)``, in fp32, and with
    ``return_entropy`` the (no-grad) entropy ``H = -sum_v p_v log p_v`` of each position's distribution.

    Without a nucleus (``top_p >= 1``) it runs :class:`_PickedLogProb`: ``log p(y) = z_y - logsumexp(z)``,
    ``z = logits / T``, a few rows of the vocabulary at a time, so no ``(..., V)`` fp32 tensor (log-softmax,
    probabilities, their gradient) is ever held whole; its backward rebuilds ``p`` from the saved logits:
    ``d log p(y) / d z = onehot(y) - p``. With a nucleus: the full log-softmax (rows renormalised by top-p)."""
    if top_p < 1.0:
        logp_all = sampling_log_softmax(logits, temperature, top_p)
        picked = logp_all.gather(-1, targets[..., None]).squeeze(-1)
        if not return_entropy:
            return picked, None
        with torch.no_grad():
            p = logp_all.exp()
            return picked, -(p * torch.where(p > 0, logp_all, torch.zeros_like(logp_all))).sum(-1)
    scale = 1.0 / temperature if temperature > 0 else 1.0  # T = 0 (greedy) is scored as T = 1
    shape = targets.shape
    picked, ent = _PickedLogProb.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), scale,
                                       return_entropy)
    return picked.view(shape), (ent.view(shape) if return_entropy else None)


# fp32 elements of one chunk of vocabulary rows (16 MiB): a few rows of a 49,152-entry vocabulary at a time.
_CHUNK_ELEMENTS = 1 << 22


class _PickedLogProb(torch.autograd.Function):
    """``(N, V)`` logits (any float dtype), ``(N,)`` targets -> fp32 ``log p(target)`` ``(N,)`` and the entropy
    ``(N,)`` (``H = logsumexp(z) - sum_v p_v z_v``; zeros when not asked), ``z = logits * scale`` taken in fp32
    a chunk of rows at a time. Saves the logits in their own dtype and the ``(N,)`` log-normalisers."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, scale: float, entropy: bool):
        n = logits.shape[0]
        picked = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(picked)
        ent = torch.zeros_like(picked)
        for c in _row_chunks(logits):
            z = _scaled(logits[c], scale)
            lse[c] = torch.logsumexp(z, dim=-1)
            picked[c] = z.gather(-1, targets[c, None]).squeeze(-1) - lse[c]
            if entropy:
                p = (z - lse[c, None]).exp_()
                # 0 * -inf would be nan: a token the logits rule out (-inf) contributes nothing.
                ent[c] = lse[c] - (p * z.clamp_min(torch.finfo(torch.float32).min)).sum(-1)
        ctx.save_for_backward(logits, targets, lse)
        ctx.scale = scale
        ctx.mark_non_differentiable(ent)
        return picked, ent

    @staticmethod
    def backward(ctx, grad_picked: torch.Tensor, _grad_ent: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for c in _row_chunks(logits):
            g = grad_picked[c, None]
            gz = (_scaled(logits[c], ctx.scale) - lse[c, None]).exp_().mul_(-g)  # -p g
            gz.scatter_add_(-1, targets[c, None], g)  # + onehot(y) g
            grad[c] = gz.mul_(ctx.scale) if ctx.scale != 1.0 else gz
        return grad, None, None, None


def _row_chunks(logits: torch.Tensor) -> list[slice]:
    rows = max(1, _CHUNK_ELEMENTS // max(1, logits.shape[-1]))
    return [slice(i, i + rows) for i in range(0, logits.shape[0], rows)]


def _scaled(logits: torch.Tensor, scale: float) -> torch.Tensor:
    """``logits * scale`` in fp32 (only read by the callers: fp32 logits come back as they are at scale 1)."""
    z = logits.float()
    if scale == 1.0:
        return z
    return z * scale if z is logits else z.mul_(scale)


def response_logits(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, start: int,
    share_prompt: bool = False
) -> torch.Tensor:
    """Logits ``(B, L - start, V)`` at positions ``start - 1 .. L - 2``: those predicting columns
    ``start .. L - 1``.

    Plain: one forward of every row over all ``L`` columns. Shared prompt: the ``k`` distinct
    prefixes (columns ``< start``, ids and mask) run once with a KV cache, the cache is indexed
    out to the ``B`` rows, and the remaining columns run on top of it. A causal model's states at
    a position do not depend on later ones, so the logits are the plain ones up to float
    rounding, and the gradient reaches the prefix's computation through the cache. For a GRPO
    minibatch the prefix is the prompt, shared by the rows of a group: the forward then costs
    ``k * start + B * (L - start)`` token positions instead of ``B * L``. Falls back to plain
    when no prefix repeats, the model takes no cache, or gradient checkpointing would drop it.
    """
    length, n = input_ids.shape[1], input_ids.shape[0]
    positions = position_ids_from_mask(attention_mask)
    keep = (lambda k: {"logits_to_keep": k}) if "logits_to_keep" in forward_parameters(model) else (lambda k: {})
    cache_kw = cache_kwarg(model)
    if share_prompt and cache_kw is not None and 1 < start < length and not _cache_dropped(model):
        distinct, inverse = torch.unique(_prefixes(input_ids, attention_mask, start), dim=0, return_inverse=True)
        if len(distinct) < n:
            first = torch.full((len(distinct),), n, device=input_ids.device).scatter_reduce(
                0, inverse, torch.arange(n, device=input_ids.device), "amin")  # a row holding each prefix
            cache = DynamicCache()
            head = model(input_ids=input_ids[first, :start], attention_mask=attention_mask[first, :start],
                         position_ids=positions[first, :start], use_cache=True, **{cache_kw: cache}, **keep(1))
            cache.reorder_cache(inverse)  # (k, ...) -> (B, ...): an index_select, differentiable
            tail = model(input_ids=input_ids[:, start:], attention_mask=attention_mask,
                         position_ids=positions[:, start:],
                         use_cache=True, **{cache_kw: cache}, **keep(length - start))
            return torch.cat([head.logits[:, -1:][inverse], tail.logits[:, :-1]], dim=1)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False,
                **(keep(length - start + 1) if start > 1 else {}))
    return out.logits[:, -(length - start + 1):-1]


def _prefixes(input_ids: torch.Tensor, attention_mask: torch.Tensor, start: int) -> torch.Tensor:
    return torch.cat([input_ids[:, :start], attention_mask[:, :start].to(input_ids.dtype)], dim=1)


def prefix_repeats(input_ids: torch.Tensor, attention_mask: torch.Tensor, start: int) -> bool:
    """Whether two rows share their first ``start`` columns (ids and mask): where they do,
    :func:`response_logits` with ``share_prompt`` runs two forwards (prefixes, then the rest), else one."""
    return len(torch.unique(_prefixes(input_ids, attention_mask, start), dim=0)) < input_ids.shape[0]


def forward_parameters(model: torch.nn.Module) -> frozenset[str]:
    """The keyword names ``model``'s forward takes (a DeepSpeed engine's: its module's)."""
    return _forward_parameters(type(getattr(model, "module", model)))


def cache_kwarg(model: torch.nn.Module) -> str | None:
    """The keyword ``model``'s forward takes its KV cache by: ``cache`` (transformers 5 renamed
    it; the same DynamicCache is updated in place either way), ``past_key_values`` before, None
    when it takes neither."""
    return next((kw for kw in ("cache", "past_key_values") if kw in forward_parameters(model)), None)


@functools.cache  # per model class: this runs for every training minibatch and every decoder
def _forward_parameters(model_class: type) -> frozenset[str]:
    return frozenset(inspect.signature(model_class.forward).parameters)


def _cache_dropped(model: torch.nn.Module) -> bool:
    """Whether transformers' gradient checkpointing will drop the cache in this forward (its
    layers then run without the prompt's keys and values)."""
    return (model.training and torch.is_grad_enabled()
            and any(getattr(m, "gradient_checkpointing", False) for m in model.modules()))
