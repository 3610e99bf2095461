"""Input checks shared by the pure tensor functions: fail loudly instead of training on NaN."""

from __future__ import annotations

import math

import torch


class NonFiniteError(ValueError):
    """A tensor that must be finite holds NaN or +-inf."""


def require_finite(name: str, x: torch.Tensor, mask: torch.Tensor | None = None) -> None:
    """Raise NonFiniteError naming ``name`` and the first bad index if ``x`` (where ``mask``) is not finite."""
    bad = ~torch.isfinite(x)
    if mask is not None:
        bad = bad & mask.bool()
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0].tolist())
        raise NonFiniteError(f"{name} has {int(bad.sum())} non-finite value(s); first at index {idx}: {x[idx].item()}")


def require_finite_update(loss: torch.Tensor, grad_norm: torch.Tensor | float, what: str) -> None:
    """NonFiniteError naming ``what`` when an update's loss or gradient norm is NaN or inf. Clipping
    scales the gradient by ``clip / norm``: an infinite norm zeroes the update (training silently
    stops) and a NaN one makes every weight NaN. Called before the optimizer step, so the weights
    stay those of the last good update."""
    for name, value in (("loss", float(loss.detach())), ("gradient norm", float(grad_norm))):
        if not math.isfinite(value):
            raise NonFiniteError(f"{what}: the {name} is {value}")


def require_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"shape mismatch: {shapes}")
