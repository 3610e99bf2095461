"""What a model name stands for, by content: the key under which its warm start, its datasets
(tokenised with its tokenizer) and a run's checkpoints record it, so a folder replaced under
the same path is another model."""

from __future__ import annotations

from pathlib import Path

from a3po.models.factory import TINY_ARCHS
from a3po.models.sources import MODEL_SOURCES
from a3po.storage.content import content_hash


def model_content_hash(name: str | Path) -> str | None:
    """The sha256 that identifies ``name``'s weights and tokenizer: a local folder's files
    (:func:`a3po.storage.content.content_hash`), a named source's GGUF file (its converted folder
    is made from it alone; raises :class:`~a3po.models.sources.ModelSourceMissing` when its package
    is absent). None where the name is the identity: a built-in size (built from code and a
    seed) or a hub name (a hub revision is not checked)."""
    if str(name) in TINY_ARCHS:
        return None
    if str(name) in MODEL_SOURCES:
        source = MODEL_SOURCES.get(str(name))
        return source.cache_key(source.gguf_path())
    path = Path(name).expanduser()
    return content_hash(path) if path.is_dir() else None
