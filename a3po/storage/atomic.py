"""Files that are either wholly written or not at all: write to a temporary name in the same
folder, fsync, ``os.replace`` (atomic on POSIX), fsync the folder. Folders likewise
(:func:`replace_dir`): written under a temporary name beside their final one, then renamed.

Temporary names carry the writer's pid (``.<name>.tmp-<pid>-<random>``): a writer killed before
it could clean up (SIGKILL, power loss) leaves one behind, and the next write of the same name
removes those whose process is gone (:func:`sweep_stale`). A SIGTERM during a folder's build
removes the folder before the signal acts (:func:`removed_on_sigterm`).

A write that fails for want of room (:func:`no_room`: a full disk, the quota, a file larger than
the process's file-size limit or the file system's, however the writer wraps the error) frees its
partial output and raises :class:`DiskFullError` in one line naming the file and the limit: a
retry cannot help until room is made, so callers do not retry it."""

from __future__ import annotations

import errno
import os
import re
import resource
import shutil
import signal
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

_TMP = ".tmp-"


class DiskFullError(OSError):
    """A file could not be written for want of room: no space left (ENOSPC), the disk quota
    (EDQUOT), or a file over the largest size allowed (EFBIG: ``ulimit -f``, as batch schedulers
    set it, or the file system's own, FAT32's 4 GiB). The message names the file, what was written
    and the limit; retrying cannot help until room is made. Whatever was committed before is whole."""


_OS_ERROR_TEXT = re.compile(r"\(os error (\d+)\)|\[Errno (\d+)\]")


def no_room(e: BaseException | None) -> int | None:
    """The errno (ENOSPC, EDQUOT or EFBIG) of ``e`` or of an error it was raised from, or None:
    writers wrap it (torch.save reports it as a RuntimeError of its zip writer, raised while
    handling the OSError; safetensors as a SafetensorError whose text alone names the OS error)."""
    codes = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in codes:
            return e.errno
        # A writer in another language keeps only the text: safetensors' "I/O error: ... (os error 27)"
        said = _OS_ERROR_TEXT.search(str(e)) if not isinstance(e, OSError) else None
        if said and int(said.group(1) or said.group(2)) in codes:
            return int(said.group(1) or said.group(2))
        e = e.__cause__ or e.__context__
    return None


def _free_mib(path: Path) -> str:
    try:
        return f"{shutil.disk_usage(path).free / 2**20:,.0f} MiB"
    except OSError:
        return "?"


def room_limit(code: int, folder: Path) -> str:
    """The limit that error ``code`` (of :func:`no_room`) hit, in words, with its figure."""
    if code == errno.EFBIG:
        soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
        limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft:,} bytes"
        return (f"a file larger than allowed (this process's file-size limit, ulimit -f: {limit}; else the file "
                "system's largest file)")
    if code == errno.EDQUOT:
        return "the disk quota reached"
    return f"no space left on the device ({_free_mib(folder)} free in {folder})"


def no_room_error(e: BaseException, path: Path, written: int) -> DiskFullError:
    """The one-line :class:`DiskFullError` of a write of ``path`` that failed with ``e``."""
    code = no_room(e) or errno.ENOSPC
    return DiskFullError(code, f"no room to write {path} ({written / 2**20:,.1f} MiB written): "
                               f"{room_limit(code, Path(path).parent)}; nothing partial is left behind")


def _tmp_prefix(name: str) -> str:
    return f".{name}{_TMP}{os.getpid()}-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def sweep_stale(parent: Path, name: str) -> list[Path]:
    """Remove the temporary files and folders of ``name`` in ``parent`` left by writers that are
    no longer running (their pid is in the name); returns what was removed. A pid reused by
    another process keeps its leftover until that process ends too (never a live writer's)."""
    pattern = re.compile(re.escape(f".{name}{_TMP}") + r"(\d+)-")
    removed = []
    try:
        entries = list(Path(parent).iterdir())
    except OSError:
        return removed
    for p in entries:
        m = pattern.match(p.name)
        if m is None or int(m.group(1)) == os.getpid() or _pid_alive(int(m.group(1))):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    return removed


def temp_dir_beside(out_dir: Path) -> Path:
    """A new empty folder beside ``out_dir`` to build it in (then :func:`replace_dir`), named with
    this process's pid, after sweeping the leftovers of dead builds of ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(out_dir.parent, out_dir.name)
    return Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=_tmp_prefix(out_dir.name)))


@contextmanager
def removed_on_sigterm(path: Path) -> Iterator[None]:
    """Inside the block a SIGTERM first removes ``path`` (a folder being built), then acts as it
    would have (the previous handler, or the default: the process ends). Only the main thread
    can set a handler; elsewhere the block runs as it is (the pid sweep still covers it)."""
    previous = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    if previous is None or previous == signal.SIG_IGN:  # not the main thread, a handler set outside Python, or ignored
        yield
        return

    def on_term(signum, frame) -> None:
        shutil.rmtree(path, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)
        if callable(previous):
            previous(signum, frame)
        else:
            os.kill(os.getpid(), signal.SIGTERM)  # the disposition it had (default: terminate)

    signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is on_term:
            signal.signal(signal.SIGTERM, previous)


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
    sweep_stale(path.parent, path.name)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_tmp_prefix(path.name), suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException as e:
        written = os.path.getsize(tmp) if os.path.exists(tmp) else 0
        if os.path.exists(tmp):
            os.unlink(tmp)
        if no_room(e) is not None:
            raise no_room_error(e, path, written) from e
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


def save_pretrained_atomic(model, tokenizer, out_dir: str | Path) -> Path:
    """Write a Hugging Face model folder (anything with ``save_pretrained``: a model, a
    tokenizer) beside ``out_dir`` and rename it into place (:func:`replace_dir`)."""
    out_dir = Path(out_dir)
    tmp = temp_dir_beside(out_dir)  # pid-named: a killed writer's leftover is swept by the next write
    try:
        with removed_on_sigterm(tmp):
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        return replace_dir(tmp, out_dir)
    except BaseException as e:
        written = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file()) if tmp.exists() else 0
        shutil.rmtree(tmp, ignore_errors=True)
        if no_room(e) is not None:
            raise no_room_error(e, out_dir, written) from e
        raise
