"""Content hashes: what identifies a file or a model folder a run reads, whatever its path,
size or modification time. Caches and checkpoints record these, so a file replaced or edited
in place under the same path is another input (the warm start, the dataset cache, a resume's
check of its data, the model cache's check of its files).

Nothing is remembered between calls: a stat-keyed memo would trust timestamps, which are
coarse (a rewrite within the same clock tick keeps them). Hashing costs ~0.8 s for 540 MB on
one core with SHA extensions; callers hash once per use, not once per step.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable

_CHUNK = 1 << 22


def sha256_file(path: str | Path) -> str:
    """The sha256 of a file's bytes, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def folder_files(folder: str | Path) -> list[Path]:
    """The files that make a model folder: its top-level regular files (weights, config,
    tokenizer), hidden ones aside (editor and OS droppings; transformers reads none)."""
    return sorted(p for p in Path(folder).iterdir() if p.is_file() and not p.name.startswith("."))


def folder_hashes(folder: str | Path, exclude: tuple[str, ...] = ()) -> dict[str, str]:
    """``{name: sha256}`` of a folder's :func:`folder_files` (but ``exclude``): what a cache
    records when it writes a folder, to check it with :func:`folder_mismatch` when it reuses it."""
    return {p.name: sha256_file(p) for p in folder_files(folder) if p.name not in exclude}


def folder_mismatch(folder: str | Path, recorded: dict[str, str]) -> str | None:
    """The first file of ``folder`` that is not as ``recorded`` (``{name: sha256}``), named with
    how (missing, or other bytes); None when every recorded file is intact."""
    for name, sha in sorted(recorded.items()):
        path = Path(folder) / name
        if not path.is_file():
            return f"{path} is missing"
        if sha256_file(path) != sha:
            return f"{path}: content hash mismatch (sha256 differs from the one recorded when it was written)"
    return None


def record_problem(folder: str | Path, record: str) -> str | None:
    """Why the cached ``folder`` cannot be reused: its JSON ``record`` file (written last, with
    ``"files": {name: sha256}``) missing, unreadable or without hashes (an earlier version's), or a
    file not as recorded (:func:`folder_mismatch`); None when every recorded file is intact."""
    path = Path(folder) / record
    try:
        files = json.loads(path.read_text()).get("files")
    except FileNotFoundError:
        return f"{path} is missing"
    except (OSError, ValueError, AttributeError) as e:
        return f"{path}: unreadable ({type(e).__name__}: {e})"
    if not isinstance(files, dict) or not files:
        return f"{path} records no content hashes (an earlier version wrote it)"
    return folder_mismatch(folder, files)


def content_hash(path: str | Path) -> str:
    """sha256 of a file's bytes, or of a folder's :func:`folder_files` (each file's name and
    sha256), so a folder is identified by what it holds, not by where it is."""
    path = Path(path)
    if not path.is_dir():
        return sha256_file(path)
    return hashlib.sha256(json.dumps(folder_hashes(path), sort_keys=True).encode()).hexdigest()


def source_hash(roots: Iterable[str | Path]) -> str:
    """sha256 of the Python source under ``roots`` (package folders, or single files): each
    ``.py`` file's path relative to its root and its bytes, in a fixed order. What a cache of a
    computation's results keys on besides its inputs, so a change to the code that computes them
    is another entry, never a stale hit."""
    h = hashlib.sha256()
    for root in map(Path, roots):
        files = sorted(root.rglob("*.py")) if root.is_dir() else [root]
        for f in files:
            h.update(f"{root.name}/{f.relative_to(root) if root.is_dir() else ''}\0".encode())
            h.update(sha256_file(f).encode())
    return h.hexdigest()
