"""One factory for policy models: a tiny causal LM built from a transformers config (Qwen2
architecture) with the in-code tokenizer, a named pretrained model built from an installed
package (:mod:`a3po.models.sources`, e.g. ``smollm2-135m-instruct``), or any causal LM and
tokenizer loaded from a local path or hub name. The training and rollout code is the same for all."""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from a3po.devices import autocasts, model_device, model_dtype, set_autocast
from a3po.models.sources import MODEL_SOURCES
from a3po.models.tokenizer import build_tokenizer


@dataclass(frozen=True)
class TinyArch:
    """Sizes of a Qwen2-style model built from scratch."""

    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int = 256


# "tiny" learns the embedded task on 2 CPU cores in minutes; "small" (>5M params) is the
# bench model where a forward pass costs enough to measure what loglinear saves.
TINY_ARCHS: dict[str, TinyArch] = {
    "micro": TinyArch(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64),
    "tiny": TinyArch(hidden_size=96, num_layers=2, num_heads=4, intermediate_size=192),
    "small": TinyArch(hidden_size=320, num_layers=6, num_heads=8, intermediate_size=960),
}


def build_tiny_model(
    arch: str | TinyArch,
    words: list[str],
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A randomly initialised Qwen2 causal LM sized by ``arch`` with the in-code tokenizer over
    ``words``, on ``device`` in ``dtype``. Initialised on the CPU in fp32 and then moved, so a
    seed gives the same initial weights on every device."""
    spec = TINY_ARCHS[arch] if isinstance(arch, str) else arch
    tokenizer = build_tokenizer(words)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    return model.float().to(device=device, dtype=dtype).eval(), tokenizer


def load_model(
    name: str | Path, seed: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
    words: Sequence[str] | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``(model, tokenizer)`` for a model name as configs and command lines give it: a built-in
    size (:data:`TINY_ARCHS`, randomly initialised from ``seed``, its in-code tokenizer over
    ``words``, the vocabulary of the task it is built for), a named model source
    (:data:`a3po.models.sources.MODEL_SOURCES`, converted into its cache folder on first use) or a
    local path / hub name of any causal LM (``words`` unused: the tokenizer comes with it)."""
    if str(name) in TINY_ARCHS:
        return build_tiny_model(str(name), _tiny_words(name, words), seed=seed, device=device, dtype=dtype)
    if str(name) in MODEL_SOURCES:
        return load_pretrained(MODEL_SOURCES.get(str(name)).folder(), dtype=dtype, device=device)
    return load_pretrained(name, dtype=dtype, device=device)


def load_tokenizer(name: str | Path, words: Sequence[str] | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of :func:`load_model` without loading the model's weights."""
    if str(name) in TINY_ARCHS:
        return build_tokenizer(_tiny_words(name, words))
    if str(name) in MODEL_SOURCES:
        return _load_tokenizer(str(MODEL_SOURCES.get(str(name)).folder()))
    return _load_tokenizer(_source(name))


def _tiny_words(name: str | Path, words: Sequence[str] | None) -> Sequence[str]:
    """``words``, which a built-in size needs: its tokenizer is built from them, not loaded."""
    if words is None:
        raise ValueError(f"model {str(name)!r} is built from scratch: its tokenizer needs the task's vocabulary "
                         "(words=...)")
    return words


class ModelFolderError(ValueError):
    """A model folder or hub name that is not loaded: code of its own to run, no safe weights, no
    config, or a hub name that cannot be reached. The message is one line naming the folder or name."""


# Weights that load without unpickling, and those that need it (torch.load of a pickle: refused).
SAFE_WEIGHTS = ("*.safetensors",)
PICKLE_WEIGHTS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
HUB_TIMEOUT_S = 10.0


def _source(name_or_path: str | Path) -> str:
    """A local directory's path (checked by :func:`check_model_folder`), or a hub name (checked by
    :func:`check_hub_name`). Raises FileNotFoundError with the path when a local-looking path does
    not exist, rather than letting the hub client try (and time out) offline."""
    p = Path(name_or_path)
    if (str(name_or_path).startswith((".", "/", "~")) or p.exists()) and not p.expanduser().exists():
        raise FileNotFoundError(f"model path {p} does not exist")
    if p.expanduser().exists():
        check_model_folder(p.expanduser())
        return str(p.expanduser())
    check_hub_name(str(name_or_path))
    return str(name_or_path)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFolderError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelFolderError(f"{path}: expected a JSON object")
    return data


def check_model_folder(folder: Path) -> None:
    """ModelFolderError unless ``folder`` holds a model this library loads without running code:
    a ``config.json`` without ``auto_map`` (classes of the folder's own code, which transformers
    would import; so neither may ``tokenizer_config.json``) and safetensors weights (pickle
    weights alone are refused: unpickling can run code)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelFolderError(f"model path {folder} is not a folder")
    config = folder / "config.json"
    if not config.is_file():
        raise ModelFolderError(f"model folder {folder} has no config.json (save the model with save_pretrained)")
    for name in ("config.json", "tokenizer_config.json"):
        if (folder / name).is_file() and "auto_map" in _read_json(folder / name):
            raise ModelFolderError(f"{folder / name}: 'auto_map' names code of the folder's own, "
                                   "which is never run here; use a model whose classes transformers ships")
    if any(any(folder.glob(g)) for g in SAFE_WEIGHTS):
        return
    pickles = sorted(p.name for g in PICKLE_WEIGHTS for p in folder.glob(g))
    if pickles:
        raise ModelFolderError(f"model folder {folder} holds only pickle weights "
                               f"({', '.join(pickles[:3])}), which can run code "
                               "when loaded; convert them to safetensors (save_pretrained(safe_serialization=True))")
    raise ModelFolderError(f"model folder {folder} has no weights (*.safetensors)")


def check_hub_name(name: str) -> None:
    """ModelFolderError when the hub name ``name`` is neither in the local hub cache nor reachable
    (one request of at most :data:`HUB_TIMEOUT_S`): offline, transformers would fail after
    retries with a long traceback."""
    from huggingface_hub import constants, model_info, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return
    what = f"model {name!r} is not a local folder, a built-in architecture ({', '.join(TINY_ARCHS)}) or a named model"
    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        raise ModelFolderError(f"{what}, and it is not in the hub cache (HF_HUB_OFFLINE is set)")
    try:
        model_info(name, timeout=HUB_TIMEOUT_S)
    except Exception as e:  # no network, no such repository, a gated one: the hub client's first line says which
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ModelFolderError(f"{what}, and the hub does not serve it ({type(e).__name__}: {first[:200]})") from None


def load_pretrained(
    name_or_path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Any causal LM and its tokenizer from a local directory or hub name, on ``device`` in
    ``dtype`` (FileNotFoundError naming a local-looking path that does not exist, or a local
    folder without tokenizer files; the tokenizer is loaded first, so either fails before the
    weights are read)."""
    source = _source(name_or_path)
    tokenizer = _load_tokenizer(source)
    # trust_remote_code=False: never the folder's own code, whatever answers transformers' prompt on stdin.
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, trust_remote_code=False).to(device)
    return model.eval(), tokenizer


# Files that hold a tokenizer's vocabulary (fast, sentencepiece, BPE, WordPiece, tiktoken); a
# folder with none of them is a model saved without its tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model")


def _check_tokenizer_files(folder: Path) -> None:
    """FileNotFoundError naming ``folder``, the files a tokenizer needs and those it holds, when
    it has no vocabulary file: AutoTokenizer would otherwise build a tokenizer of one token from
    config.json alone, and the run would fail much later ("prompt 0 is empty")."""
    if any((folder / f).is_file() for f in TOKENIZER_FILES) or any(folder.glob("*.tiktoken")):
        return
    held = sorted(f.name for f in folder.iterdir())
    shown = ", ".join(held[:20]) + (f", ... ({len(held)} files)" if len(held) > 20 else "")
    raise FileNotFoundError(
        f"model folder {folder} has no tokenizer: none of {', '.join(TOKENIZER_FILES)} or *.tiktoken "
        f"(it holds: {shown or 'nothing'}); save the tokenizer there too (tokenizer.save_pretrained, "
        f"which also writes tokenizer_config.json) or copy its files from the base model"
    )


def _load_tokenizer(source: str) -> PreTrainedTokenizerBase:
    """AutoTokenizer, except for a tokenizer saved from a bare ``tokenizer.json`` (the in-code
    one): AutoTokenizer would pick the model type's tokenizer class (Qwen2Tokenizer) and
    replace its pre-tokenizer, silently changing the ids. A local folder without tokenizer files
    raises FileNotFoundError naming it, before any weights are read."""
    if Path(source).is_dir():
        _check_tokenizer_files(Path(source))
    cfg_file = Path(source) / "tokenizer_config.json"
    if cfg_file.exists():
        tok_class = json.loads(cfg_file.read_text()).get("tokenizer_class")
        if tok_class in ("TokenizersBackend", "PreTrainedTokenizerFast"):
            tokenizer = PreTrainedTokenizerFast.from_pretrained(source, trust_remote_code=False)
        else:
            tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=False)
    else:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=False)
    if len(tokenizer) < 2:  # whatever the files said, nothing can be tokenised with it
        raise ValueError(f"the tokenizer loaded from {source} has {len(tokenizer)} token(s); its files are incomplete")
    if tokenizer.pad_token_id is None:
        # Many chat models ship without a pad token; padding is always masked, so eos serves.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def empty_like(policy: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """A model of ``policy``'s class and config on its device, in ``dtype`` (default: the policy's),
    with freshly initialised weights for the caller to overwrite (``load_state_dict``): a rollout
    engine's copy, a re-scoring copy, a plain model to export. Built in place on the device, so a
    large model is never initialised on the CPU; left in the mode a new module has (training).
    A copy in the policy's own dtype (``dtype`` None) also computes as it does: under bf16 autocast
    when the policy is marked for it (:func:`a3po.devices.set_autocast`); one in an asked dtype computes in that."""
    with torch.device(model_device(policy)):
        model = type(policy)(policy.config)
    if dtype is None and autocasts(policy):
        set_autocast(model, True)
    return model.to(dtype=model_dtype(policy) if dtype is None else dtype)


def decoding_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` to decode from in ``dtype``: itself where its weights are in ``dtype`` and it
    computes in them (not marked for autocast); else a whole copy (``copy.deepcopy``: the same class
    and adapters; nothing shared, since the cast rewrites every tensor it holds) cast to ``dtype`` and
    unmarked, as the rollout engine's copy of a version is (:func:`empty_like` with a dtype)."""
    if model_dtype(model) == dtype and not autocasts(model):
        return model
    clone = copy.deepcopy(model)
    set_autocast(clone, False)
    return clone.to(dtype=dtype)


def snapshot(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` as it is now, to read while ``model`` trains on (a background held-out
    evaluation, :mod:`a3po.training.evaluations`): ``copy.deepcopy``, so the same class, forward and
    marks (bf16 autocast, peft's adapter layers, tied weights), hence the same outputs bit for bit,
    unlike a merge of LoRA's adapters into the base, which rounds differently. The trainable
    parameters and the buffers are copied, the frozen parameters shared (nothing writes them: with
    LoRA the copy costs the adapters alone); gradients are not copied."""
    frozen = {id(p): p for p in model.parameters() if not p.requires_grad}
    return copy.deepcopy(model, memo=frozen)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
