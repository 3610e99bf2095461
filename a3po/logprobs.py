"""Log-probs of the distribution tokens are actually sampled from, shared by the rollout
engine (behaviour log-probs, one decode step at a time) and the trainer (one full forward)."""

from __future__ import annotations

import functools
import inspect

import torch

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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-prob of ``input_ids[:, t]`` given the prefix, aligned to ``input_ids``.

    Returns ``(B, L)``, 0 in the columns before ``start`` (column 0 has no prefix; the trainer
    passes the prompt width, so the head and the softmax run on the response's positions only,
    where the model accepts ``logits_to_keep``). With ``return_entropy`` also the entropy of the
    next-token distribution at each position, same alignment.
    """
    length = input_ids.shape[1]
    start = max(1, min(start, length))
    keep = {"logits_to_keep": length - start + 1} if start > 1 and _takes_logits_to_keep(type(model)) else {}
    with autocast_for(model):
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask),
                    use_cache=False, **keep)
    logits = out.logits[:, -(length - start + 1):-1]  # positions start-1 .. L-2 predict columns start .. L-1
    logp_all = sampling_log_softmax(logits, temperature, top_p)  # (B, L - start, V)
    picked = logp_all.gather(-1, input_ids[:, start:, None]).squeeze(-1)
    logp = torch.cat([picked.new_zeros((picked.shape[0], start)), picked], dim=1)
    if not return_entropy:
        return logp
    with torch.no_grad():
        p = logp_all.exp()
        ent = -(p * torch.where(p > 0, logp_all, torch.zeros_like(logp_all))).sum(-1)
        ent = torch.cat([ent.new_zeros((ent.shape[0], start)), ent], dim=1)
    return logp, ent


@functools.cache  # per model class: this runs for every training minibatch
def _takes_logits_to_keep(model_class: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters
