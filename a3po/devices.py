"""Device and dtype placement, chosen in one place.

The config names a device (``auto``, ``cpu``, ``cuda``) and a dtype (``float32``, ``bfloat16``,
``auto``); :func:`resolve_device` turns the device into a torch object once and
:func:`resolve_precision` the dtype into a :class:`Precision` (weights, compute, the rollout
engine's copy), the model is built there, and everything else follows the model: tensors are
created on ``model_device(model)``, forwards run under :func:`autocast_for`. On CPU in float32
every helper is the identity, so CPU runs are bit for bit what they were before devices existed.

``dtype: auto`` is mixed precision where the hardware computes bf16 natively (a CUDA device with
bf16, a CPU reporting AMX-BF16 or AVX512-BF16: :func:`native_bf16`): fp32 weights and AdamW state,
forwards and backwards under bf16 autocast, a bf16 rollout engine copy; fp32 everywhere else. Where
bf16 is only emulated (older CPUs) it is several times slower than fp32, so ``auto`` never picks it.

Random numbers: token sampling draws from a generator on the model's device
(:func:`sampling_generator`; a CPU generator would force a device-to-host copy of the
``(N, V)`` probabilities at every decode step). A run is therefore reproducible on a given
device type, not across devices. Small draws (the minibatch permutation) stay on a CPU
generator and are moved, so they are the same on every device.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import torch


class Device(str, Enum):
    AUTO = "auto"  # cuda when available, else cpu
    CPU = "cpu"
    CUDA = "cuda"


class DType(str, Enum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    AUTO = "auto"  # fp32 weights; bf16 compute where the hardware has it (resolve_precision)

    @property
    def torch(self) -> torch.dtype:
        """The weights' dtype (``auto`` keeps fp32 master weights whatever it computes in)."""
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "auto": torch.float32}[self.value]


# /proc/cpuinfo flags of CPUs that compute bf16 matmuls natively (oneDNN uses them under autocast).
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_native_bf16(cpuinfo: str | None = None) -> str | None:
    """The first of :data:`NATIVE_BF16_FLAGS` this CPU reports (``cpuinfo``: the text of
    /proc/cpuinfo, read when None), or None when it reports none: bf16 is then emulated. Where
    /proc/cpuinfo cannot be read, torch's own probe of AVX512-BF16 decides."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
            return "avx512_bf16" if probe is not None and probe() else None
    flags = {f for line in cpuinfo.splitlines() if line.startswith("flags") for f in line.partition(":")[2].split()}
    return next((f for f in NATIVE_BF16_FLAGS if f in flags), None)


def native_bf16(device: torch.device) -> str | None:
    """What makes bf16 native on ``device`` (a CPU flag, or ``'cuda bf16'``), None where it is
    emulated. Machine-dependent: detected once where a run starts and handed to :func:`resolve_precision`."""
    if device.type == "cuda":
        return "cuda bf16" if torch.cuda.is_bf16_supported() else None
    return cpu_native_bf16()


@dataclass(frozen=True)
class Precision:
    """What a run computes in, resolved from the config's dtype and the machine (:func:`resolve_precision`)."""

    weights: DType
    """The parameters' dtype, and so the AdamW state's (float32 or bfloat16)."""
    autocast: bool
    """Forwards (and so backwards) under bf16 autocast on fp32 weights: matmuls in bf16, the ops
    autocast keeps in fp32 (softmax, norms) and the log-probs (``.float()`` logits) in fp32."""
    engine: DType
    """The torch rollout engine's copy of each version when ``rollout.dtype`` is null."""
    reason: str
    """One line: what was chosen and why (logged at start)."""
    slow: bool = False
    """bf16 asked for where it is emulated: the run is several times slower than fp32 (warned)."""

    @property
    def name(self) -> str:
        """``float32``, ``bfloat16`` (bf16 weights) or ``bf16-autocast`` (bf16 compute on fp32 weights)."""
        return "bf16-autocast" if self.autocast else self.weights.value


def resolve_precision(dtype: DType | str, device_type: str, native: str | None) -> Precision:
    """The precision of ``dtype`` on a ``device_type`` device where bf16 is native by ``native``
    (:func:`native_bf16`; None: emulated). Pure: the detection is the caller's."""
    dtype = DType(dtype)
    if native is not None:
        where = f"this {'CPU' if device_type == 'cpu' else 'device'} reports {native}"
    elif device_type == "cpu":
        where = f"this CPU reports neither {' nor '.join(NATIVE_BF16_FLAGS)}"
    else:
        where = f"this {device_type} device lacks bf16"
    if dtype is DType.FLOAT32:
        return Precision(DType.FLOAT32, False, DType.FLOAT32, "dtype float32: fp32 weights and compute")
    if dtype is DType.BFLOAT16:
        if native is None and device_type == "cpu":
            return Precision(DType.BFLOAT16, False, DType.BFLOAT16, slow=True, reason=(
                f"dtype bfloat16: bf16 weights, but {where}: bf16 is emulated there, several times slower than "
                "float32 (use dtype auto or float32)"))
        return Precision(DType.BFLOAT16, False, DType.BFLOAT16, f"dtype bfloat16: bf16 weights and compute ({where})")
    if native is None:
        return Precision(DType.FLOAT32, False, DType.FLOAT32, f"dtype auto: fp32 weights and compute ({where})")
    return Precision(DType.FLOAT32, True, DType.BFLOAT16, "dtype auto: bf16 compute (autocast) on fp32 weights and "
                     f"AdamW state, a bf16 rollout engine ({where})")


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


def machine_precision(dtype: DType | str, device: torch.device) -> Precision:
    """:func:`resolve_precision` of ``dtype`` on ``device`` of this machine (detects native bf16)."""
    return resolve_precision(dtype, device.type, native_bf16(device))


# The attribute marking a model whose forwards run under bf16 autocast (set_autocast).
_AUTOCAST_ATTR = "_a3po_bf16_autocast"


def set_autocast(model: torch.nn.Module, on: bool) -> torch.nn.Module:
    """Mark ``model`` to run its forwards under bf16 autocast, or not (:attr:`Precision.autocast`;
    :func:`autocast_for` reads the mark; :func:`a3po.models.factory.empty_like` copies it to a
    copy in the model's own dtype). Returns ``model``."""
    setattr(model, _AUTOCAST_ATTR, bool(on))
    return model


def autocasts(model: torch.nn.Module) -> bool:
    """Whether ``model`` is marked by :func:`set_autocast` (wrappers such as peft's forward the lookup)."""
    return bool(getattr(model, _AUTOCAST_ATTR, False))


def autocast_for(model: torch.nn.Module):
    """bf16 autocast for a model marked by :func:`set_autocast` (fp32 weights, ``dtype: auto``
    where bf16 is native) and for a bf16 model on CUDA: matmuls in bf16, the ops autocast keeps in
    fp32 (softmax, norms) in fp32; nothing otherwise. Log-probs are taken in fp32 whatever the
    weights (``a3po.models.logprobs`` casts logits with ``.float()`` first)."""
    p = next(model.parameters())
    if autocasts(model) or (p.device.type == "cuda" and p.dtype == torch.bfloat16):
        return torch.autocast(p.device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def sampling_generator(device: torch.device, seed: int) -> torch.Generator:
    """Generator for token sampling on ``device`` (on CPU exactly ``torch.Generator().manual_seed(seed)``)."""
    return torch.Generator(device=device).manual_seed(seed)


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so a wall-clock timer measures the work and not its launch.
    A CPU-GPU sync point: only around timed sections."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
