"""Atomic checkpoints: write to a temporary file in the same directory, fsync, then
``os.replace`` (atomic on POSIX), so a crash mid-write leaves the previous checkpoint intact.
``latest`` is a small pointer file replaced the same way, written after the checkpoint."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch


def atomic_write_bytes(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(Path(path), lambda f: f.write(text.encode()))


def save_checkpoint(ckpt_dir: str | Path, step: int, state: dict[str, Any], keep: int = 2) -> Path:
    """Save ``state`` as ``step_{step:06d}.pt``, point ``latest`` at it, prune to ``keep``."""
    ckpt_dir = Path(ckpt_dir)
    path = ckpt_dir / f"step_{step:06d}.pt"
    atomic_write_bytes(path, lambda f: torch.save(state, f))
    atomic_write_text(ckpt_dir / "latest", json.dumps({"step": step, "file": path.name}))
    for old in sorted(ckpt_dir.glob("step_*.pt"))[:-keep]:
        old.unlink(missing_ok=True)
    return path


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The checkpoint ``latest`` points at, or None when there is none yet."""
    pointer = Path(ckpt_dir) / "latest"
    if not pointer.exists():
        return None
    info = json.loads(pointer.read_text())
    path = Path(ckpt_dir) / info["file"]
    if not path.exists():
        raise FileNotFoundError(f"{pointer} points at {path}, which is missing")
    return path


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)
