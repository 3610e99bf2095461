"""How the torch engine draws each next token from its distribution (``rollout.sampler``).

Both draws are exact samples of the categorical ``p`` over the vocabulary; they differ in cost and in
which random numbers they use, so a run's tokens depend on the sampler as they depend on the seed:

* ``multinomial``: ``torch.multinomial(p, 1)``, which on a CPU spends one exponential random number per
  vocabulary entry (~30 ms a decode step for 16 rows of SmolLM2's 49,152 entries on one core: about as
  long as the step's forward in bf16).
* ``inverse_cdf``: one uniform number per row, inverted through the running sum of ``p`` (under 1 ms for
  the same draw; ``python -m bench.roofline`` times both side by side).

Each sampler is registered by name in :data:`SAMPLERS`, its names declared in
:data:`a3po.catalog.SAMPLER_NAMES` (what config checks ``rollout.sampler`` against).
"""

from __future__ import annotations

from typing import Callable

import torch

from a3po.registry import Registry

# (probs (n, V) >= 0, each row summing to ~1; generator or None) -> token ids (n,)
Sampler = Callable[[torch.Tensor, "torch.Generator | None"], torch.Tensor]

SAMPLERS: Registry[Sampler] = Registry("sampler")


def inverse_cdf_draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One draw per row of the categorical ``probs`` ``(n, V)`` from its uniform ``u`` ``(n, 1)`` in ``[0, 1)``:

        token = min { i : C_i > u * C_V },     C_i = p_0 + ... + p_i,

    so entry ``i`` is drawn with probability ``p_i / C_V`` (an entry of probability 0 never: its ``C_i``
    equals the one before). ``u * C_V`` is kept below ``C_V``, so rounding never runs past the last
    entry of nonzero probability."""
    cdf = probs.float().cumsum(-1)
    total = cdf[:, -1:]
    x = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True).squeeze(-1)


@SAMPLERS.register("multinomial")
def multinomial_sampler(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``torch.multinomial(probs, 1)``: one exponential random number per vocabulary entry."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@SAMPLERS.register("inverse_cdf")
def inverse_cdf_sampler(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """:func:`inverse_cdf_draw` with one uniform number per row from ``generator``."""
    u = torch.rand((probs.shape[0], 1), generator=generator, device=probs.device)
    return inverse_cdf_draw(probs, u)
