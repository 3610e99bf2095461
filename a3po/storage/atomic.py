"""Files that are either wholly written or not at all: write to a temporary name in the same
folder, fsync, ``os.replace`` (atomic on POSIX), fsync the folder. Folders likewise
(:func:`replace_dir`): written under a temporary name beside their final one, then renamed."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, write) -> None:
    """Write through ``write(f)`` to a temporary file beside ``path``, fsync, ``os.replace``: a
    crash leaves the old file (or none), never a partial one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(Path(path), lambda f: f.write(text.encode()))


def replace_dir(tmp: Path, out_dir: Path) -> Path:
    """Move the finished folder ``tmp`` (a sibling of ``out_dir``) to ``out_dir``: a rename when
    there is none yet, else the old one is renamed aside first and removed after. A reader sees
    the old folder or the new one, never a half-written one (between the two renames, none)."""
    tmp, out_dir = Path(tmp), Path(out_dir)
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out_dir)
    fsync_dir(out_dir.parent)
    return out_dir
