"""Device and dtype placement, chosen in one place.

The config names a device (``auto``, ``cpu``, ``cuda``) and a weight dtype (``float32``,
``bfloat16``); :func:`resolve_device` turns them into torch objects once, the model is built
there, and everything else follows the model: tensors are created on
``model_device(model)``, forwards run under :func:`autocast_for`. On CPU in float32 every helper
is the identity, so CPU runs are bit for bit what they were before devices existed.

Random numbers: token sampling draws from a generator on the model's device
(:func:`sampling_generator`; a CPU generator would force a device-to-host copy of the
``(N, V)`` probabilities at every decode step). A run is therefore reproducible on a given
device type, not across devices. Small draws (the minibatch permutation) stay on a CPU
generator and are moved, so they are the same on every device.
"""

from __future__ import annotations

import contextlib
from enum import Enum

import torch


class Device(str, Enum):
    AUTO = "auto"  # cuda when available, else cpu
    CPU = "cpu"
    CUDA = "cuda"


class DType(str, Enum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"

    @property
    def torch(self) -> torch.dtype:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.value]


def resolve_device(device: Device | str) -> torch.device:
    """``auto`` -> cuda when available, else cpu. ``cuda`` is the current CUDA device (a
    distributed launcher selects it per rank with ``torch.cuda.set_device``)."""
    device = Device(device)
    if device is Device.AUTO:
        device = Device.CUDA if torch.cuda.is_available() else Device.CPU
    if device is Device.CUDA and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was requested but torch.cuda.is_available() is False "
                           f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}); use device: cpu or auto")
    return torch.device(device.value)


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def autocast_for(model: torch.nn.Module):
    """bf16 autocast for a bf16 model on CUDA (matmuls in bf16; the ops autocast keeps in fp32,
    e.g. softmax and norms, in fp32); nothing otherwise. Log-probs are taken in fp32 whatever
    the weights (``a3po.models.logprobs`` casts logits with ``.float()`` first)."""
    p = next(model.parameters())
    if p.device.type == "cuda" and p.dtype == torch.bfloat16:
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def sampling_generator(device: torch.device, seed: int) -> torch.Generator:
    """Generator for token sampling on ``device`` (on CPU exactly ``torch.Generator().manual_seed(seed)``)."""
    return torch.Generator(device=device).manual_seed(seed)


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so a wall-clock timer measures the work and not its launch.
    A CPU-GPU sync point: only around timed sections."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
