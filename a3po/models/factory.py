"""One factory for policy models: a tiny causal LM built from a transformers config (Qwen2
architecture) with the in-code tokenizer, a named pretrained model built from an installed
package (:mod:`a3po.models.sources`, e.g. ``smollm2-135m-instruct``), or any causal LM and
tokenizer loaded from a local path or hub name. The training and rollout code is the same for all."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

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

from a3po.data.arithmetic import WORDS
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
    name: str | Path, seed: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``(model, tokenizer)`` for a model name as configs and command lines give it: a built-in
    size (:data:`TINY_ARCHS`, randomly initialised from ``seed`` over the embedded task's
    vocabulary), a named model source (:data:`a3po.models.sources.MODEL_SOURCES`, converted
    into its cache folder on first use) or a local path / hub name of any causal LM."""
    if str(name) in TINY_ARCHS:
        return build_tiny_model(str(name), WORDS, seed=seed, device=device, dtype=dtype)
    if str(name) in MODEL_SOURCES:
        return load_pretrained(MODEL_SOURCES.get(str(name)).folder(), dtype=dtype, device=device)
    return load_pretrained(name, dtype=dtype, device=device)


def load_tokenizer(name: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of :func:`load_model` without loading the model's weights."""
    if str(name) in TINY_ARCHS:
        return build_tokenizer(WORDS)
    if str(name) in MODEL_SOURCES:
        return _load_tokenizer(str(MODEL_SOURCES.get(str(name)).folder()))
    return _load_tokenizer(_source(name))


def _source(name_or_path: str | Path) -> str:
    """A local directory's path, or the hub name. Raises FileNotFoundError with the path when a
    local-looking path does not exist, rather than letting the hub client try (and time out)
    offline."""
    p = Path(name_or_path)
    if (str(name_or_path).startswith((".", "/", "~")) or p.exists()) and not p.expanduser().exists():
        raise FileNotFoundError(f"model path {p} does not exist")
    return str(p.expanduser()) if p.exists() else str(name_or_path)


def load_pretrained(
    name_or_path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Any causal LM and its tokenizer from a local directory or hub name, on ``device`` in
    ``dtype`` (FileNotFoundError naming a local-looking path that does not exist, or a local
    folder without tokenizer files; the tokenizer is loaded first, so either fails before the
    weights are read)."""
    source = _source(name_or_path)
    tokenizer = _load_tokenizer(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype).to(device)
    return model.eval(), tokenizer


# Files that hold a tokenizer's vocabulary (fast, sentencepiece, BPE, WordPiece, tiktoken); a
# folder with none of them is a model saved without its tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "sentencepiece.bpe.model")


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
            tokenizer = PreTrainedTokenizerFast.from_pretrained(source)
        else:
            tokenizer = AutoTokenizer.from_pretrained(source)
    else:
        tokenizer = AutoTokenizer.from_pretrained(source)
    if len(tokenizer) < 2:  # whatever the files said, nothing can be tokenised with it
        raise ValueError(f"the tokenizer loaded from {source} has {len(tokenizer)} token(s); its files are incomplete")
    if tokenizer.pad_token_id is None:
        # Many chat models ship without a pad token; padding is always masked, so eos serves.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
