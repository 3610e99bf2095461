"""One writer per run folder: an OS lock held for the life of the run.

``with hold_run_folder(folder, log):`` takes ``fcntl.flock`` on ``<folder>/.a3po.lock`` and
writes the holder's record (pid, host, start time, command) into that file. A second process
asking for the same folder gets :class:`RunFolderBusy` naming the holder, before it touches
anything. The kernel drops a flock with its process, so a SIGKILLed run frees the folder;
the next run finds the record of a holder that is gone, says so through ``log`` and takes over.

Why flock and not a pid file alone: a pid can be reused and a pid file survives a crash, so
"is the holder alive" would be a guess; the flock is exact on one host. The lock file is never
deleted (deleting it while another process opens it would let two processes lock two different
files); release empties the record instead, so a non-empty record with a free lock means the
holder died.

Re-entrant within a process (a flow holds its output folder and calls code that asks again).
Local file systems only: flock over NFS is not reliable.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import socket
import sys
import threading
from pathlib import Path
from typing import Callable, Iterator

from a3po.redact import mask_command

LOCK_NAME = ".a3po.lock"

_held: dict[Path, list] = {}  # folder -> [fd, depth]: the locks this process holds
_guard = threading.Lock()


class RunFolderBusy(RuntimeError):
    """Another live process holds the run folder."""


def _record() -> dict:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(mask_command([sys.executable, *sys.argv])),  # no store password in the lock file or errors
    }


def read_holder(folder: str | Path) -> dict | None:
    """The record in the folder's lock file (``None`` when empty, absent or unreadable)."""
    try:
        text = (Path(folder) / LOCK_NAME).read_text()
        record = json.loads(text) if text.strip() else None
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def describe(record: dict | None) -> str:
    if not record:
        return "an unknown process (no record in the lock file)"
    return (f"pid {record.get('pid')} on {record.get('host')}, started {record.get('started')}, "
            f"command: {record.get('command')}")


def in_use_by_another(folder: str | Path) -> bool:
    """Another live process on this host holds the folder's lock (a free lock, a folder
    without a lock file, or one this process holds: False)."""
    folder = Path(folder).resolve()
    if folder in _held or not (folder / LOCK_NAME).exists():
        return False
    try:
        fd = os.open(folder / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the probe's own lock
    return False


def acquire(folder: str | Path, log: Callable[[str], None] = print) -> Path:
    """Take the folder's lock (creating the folder) or raise :class:`RunFolderBusy`."""
    folder = Path(folder).resolve()
    with _guard:
        if folder in _held:
            _held[folder][1] += 1
            return folder
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunFolderBusy(
                f"run folder {folder} is in use by {describe(read_holder(folder))}. A run folder takes one writer "
                f"at a time: wait for that run to finish, stop it, or use another output folder (lock file {path})"
            ) from None
        previous = read_holder(folder)
        if previous:
            log(f"run folder {folder}: taking over from {describe(previous)}, which ended without "
                "releasing it (killed or crashed)")
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(_record()) + "\n").encode(), 0)
        os.fsync(fd)
        _held[folder] = [fd, 1]
    return folder


def release(folder: str | Path) -> None:
    folder = Path(folder).resolve()
    with _guard:
        entry = _held.get(folder)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _held[folder]
        fd = entry[0]
        try:
            os.ftruncate(fd, 0)  # an empty record: released cleanly
        finally:
            os.close(fd)  # drops the flock


@contextlib.contextmanager
def hold_run_folder(folder: str | Path, log: Callable[[str], None] = print) -> Iterator[Path]:
    """Hold ``folder``'s lock for the ``with`` block (see the module docstring)."""
    path = acquire(folder, log)
    try:
        yield path
    finally:
        release(path)
