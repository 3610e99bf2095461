"""Checkpoints that cannot run code on load, are checked against content hashes, and resume
from the newest intact one.

A step checkpoint is a folder ``step_000050/``::

    policy.pt, optimizer.pt, ...   tensors and plain containers (torch.save; loaded weights_only)
    state.json                     everything else: step, history, eval curve, config, ...
    manifest.json                  format, step, and the sha256 + size of every file; written last

It is built in a hidden pending folder ``.step_000050.pending`` and renamed into place once the
manifest is written, so a ``step_*`` folder is either complete or damaged afterwards, never
half-written. A folder without a readable manifest that matches its files is not a checkpoint.
Nothing is unpickled with code execution: tensor files go through ``torch.load(weights_only=True)``
after their hash matched, and single-file ``step_*.pt`` checkpoints of earlier versions are
refused by name, never opened.

Resume scans the step folders newest first (:func:`load_latest_checkpoint`, or
:func:`latest_checkpoint` for the path alone); it does not trust a pointer. A damaged one is
named with the reason and skipped (``logging`` warning + ``on_skip``); when checkpoints exist
but none is intact it raises :class:`NoIntactCheckpoint` instead of letting the run start over
from step 0 on top of them. ``latest`` is still written, as a hint
for people and scripts; nothing reads it.

Multi-process runs use the pieces: :func:`begin_step` (once), :func:`write_tensor_file` /
:func:`write_json_file` from any rank into :func:`pending_dir` (each returns the file's hash),
then one process calls :func:`commit_step` with every rank's ``{file name: sha256}``.
:func:`save_checkpoint` is those three calls for a single process.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from a3po.storage.atomic import (  # noqa: F401  (re-exported)
    DiskFullError,
    atomic_write_bytes,
    atomic_write_text,
    fsync_dir,
    no_room,
    replace_dir,
    room_limit,
)
from a3po.storage.content import sha256_file

FORMAT = "a3po-checkpoint/2"
MANIFEST = "manifest.json"
STATE_JSON = "state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_OLD_STEP_FILE = re.compile(r"^step_(\d+)\.pt$")  # single-file pickles of a3po < format 2
_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")  # no path separators, no "..", not hidden

log = logging.getLogger(__name__)


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message names the folder or file and why."""


class NoIntactCheckpoint(CheckpointError):
    """Checkpoints exist but none is intact: resuming is impossible and starting over would
    overwrite them, so the run stops."""


# --- writing: the pieces --------------------------------------------------------------------


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def pending_dir(ckpt_dir: str | Path, step: int) -> Path:
    """Where the files of ``step`` are written before :func:`commit_step` (the same path on every rank)."""
    return Path(ckpt_dir) / f".{step_dir_name(step)}.pending"


def begin_step(ckpt_dir: str | Path, step: int) -> Path:
    """An empty pending folder for ``step`` (a leftover of a killed attempt is removed). Call it
    once, before any rank writes into it."""
    pending = pending_dir(ckpt_dir, step)
    shutil.rmtree(pending, ignore_errors=True)
    pending.mkdir(parents=True)
    return pending


def _check_name(name: str) -> None:
    if not _FILE_NAME.match(name) or ".." in name or name == MANIFEST:
        raise ValueError(f"checkpoint file name {name!r}: plain names only (letters, digits, _ . -), not {MANIFEST}")


def _write_file(pending: Path, name: str, write) -> str:
    _check_name(name)
    path = Path(pending) / name
    try:
        with open(path, "xb") as f:  # "x": two writers of one name is a bug, not a silent overwrite
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as e:
        code = no_room(e)
        if code is None:
            raise
        written = path.stat().st_size if path.exists() else 0
        path.unlink(missing_ok=True)  # the partial file only holds space
        raise DiskFullError(
            code,
            f"no room to write checkpoint file {path} ({written / 2**20:,.0f} MiB written): "
            f"{room_limit(code, path.parent)}. The checkpoints already in {path.parent.parent} are whole and a "
            f"re-run resumes from the newest. Make room first: fewer kept checkpoints (rl.keep_checkpoints), "
            f"delete the checkpoints of finished runs (a flow re-run reuses their result.json), or raise the "
            f"limit") from e
    return sha256_file(path)


_PLAIN = (str, int, float, bool, type(None))


def _check_tensor_tree(obj: Any, where: str) -> None:
    """Tensors and plain values in dicts / lists / tuples: what ``weights_only`` loads back.
    Checked at save, so a run never writes a checkpoint it could not resume from."""
    if isinstance(obj, (torch.Tensor, *_PLAIN)):
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"{where}: key {k!r} is a {type(k).__name__}; only str and int keys are saved")
            _check_tensor_tree(v, f"{where}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_tensor_tree(v, f"{where}[{i}]")
    else:
        raise TypeError(f"{where} is a {type(obj).__name__}; a tensor file holds only tensors and plain values")


def write_tensor_file(pending: Path, name: str, obj: Any) -> str:
    """``torch.save(obj)`` as ``pending/name``; returns its sha256. ``obj`` must be tensors in
    plain containers (what ``torch.load(weights_only=True)`` accepts)."""
    _check_tensor_tree(obj, name)
    return _write_file(pending, name, lambda f: torch.save(obj, f))


def write_json_file(pending: Path, name: str, obj: Any) -> str:
    """``obj`` as JSON in ``pending/name``; returns its sha256 (floats round-trip exactly)."""
    try:
        text = json.dumps(obj)  # key order kept: a rewound metrics file reads as it was logged
    except TypeError as e:
        raise TypeError(f"checkpoint file {name}: not JSON-serialisable: {e}") from None
    return _write_file(pending, name, lambda f: f.write(text.encode()))


def commit_step(ckpt_dir: str | Path, step: int, files: dict[str, str], keep: int | None = None) -> Path:
    """Make ``step`` a checkpoint: check that the pending folder holds exactly ``files`` (every
    rank's), write the manifest with their hashes last, rename the folder to ``step_XXXXXX``,
    update the ``latest`` hint and prune to the newest ``keep`` (None: keep all).

    Step folders newer than ``step`` are removed by pruning: a run only writes step k after
    resuming from below k, so any newer folder was skipped as damaged."""
    ckpt_dir = Path(ckpt_dir)
    pending = pending_dir(ckpt_dir, step)
    present = {p.name for p in pending.iterdir()} if pending.is_dir() else set()
    if present != set(files):
        raise CheckpointError(
            f"cannot commit {pending}: files not written {sorted(set(files) - present)}, "
            f"files written but not reported {sorted(present - set(files))}"
        )
    manifest = {
        "format": FORMAT,
        "step": step,
        "files": {n: {"sha256": h, "bytes": (pending / n).stat().st_size} for n, h in sorted(files.items())},
    }
    with open(pending / MANIFEST, "xb") as f:
        f.write(json.dumps(manifest, indent=1).encode())
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(pending)
    # A damaged folder of this step (skipped at resume) is replaced; the rename fsyncs ckpt_dir.
    final = replace_dir(pending, ckpt_dir / step_dir_name(step))
    atomic_write_text(ckpt_dir / "latest",
                      json.dumps({"step": step, "dir": final.name, "note": "a hint; resume scans the step folders"}))
    if keep is not None:
        _prune(ckpt_dir, step, keep)
    return final


def _step_folders(ckpt_dir: Path) -> dict[int, Path]:
    return {int(m.group(1)): p for p in ckpt_dir.iterdir() if (m := _STEP_DIR.match(p.name))}


def _prune(ckpt_dir: Path, committed: int, keep: int) -> None:
    steps = sorted(_step_folders(ckpt_dir).items())
    kept = [s for s, _ in steps if s <= committed][-keep:]
    for s, path in steps:
        if s not in kept:
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    for p in ckpt_dir.glob(".step_*.pending"):  # leftovers of killed attempts at older steps
        m = re.match(r"^\.step_(\d+)\.pending$", p.name)
        if m and int(m.group(1)) <= committed:
            shutil.rmtree(p, ignore_errors=True)


# --- writing: one call ----------------------------------------------------------------------


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return False


def save_checkpoint(ckpt_dir: str | Path, step: int, state: dict[str, Any], keep: int = 2) -> Path:
    """Save ``state`` as the folder ``step_{step:06d}``: each top-level value holding tensors as
    ``<key>.pt``, the rest in ``state.json`` (tuples come back as lists); prune to ``keep``."""
    pending = begin_step(ckpt_dir, step)
    files: dict[str, str] = {}
    plain: dict[str, Any] = {}
    try:
        for key, value in state.items():
            if _holds_tensor(value):
                files[f"{key}.pt"] = write_tensor_file(pending, f"{key}.pt", value)
            else:
                plain[key] = value
        files[STATE_JSON] = write_json_file(pending, STATE_JSON, plain)
    except DiskFullError:
        shutil.rmtree(pending, ignore_errors=True)  # the one writer: its half-written step frees its space
        raise
    return commit_step(ckpt_dir, step, files, keep=keep)


# --- reading --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    step: int
    files: dict[str, dict[str, Any]]  # name -> {"sha256", "bytes"}


def read_manifest(path: str | Path) -> Manifest:
    """The manifest of the step folder ``path``, checked for shape; raises :class:`CheckpointError`."""
    path = Path(path)
    mpath = path / MANIFEST
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a folder")
    if not mpath.exists():
        raise CheckpointError(f"{path}: missing {MANIFEST} (an unfinished or foreign checkpoint)")
    try:
        m = json.loads(mpath.read_bytes())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{mpath}: unreadable manifest: {e}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        got = m.get("format") if isinstance(m, dict) else type(m).__name__
        raise CheckpointError(f"{mpath}: format {got!r}, expected {FORMAT!r}")
    match = _STEP_DIR.match(path.name)
    if not isinstance(m.get("step"), int) or (match and int(match.group(1)) != m["step"]):
        raise CheckpointError(f"{mpath}: step {m.get('step')!r} does not match the folder name {path.name}")
    files = m.get("files")
    if not isinstance(files, dict) or not files:
        raise CheckpointError(f"{mpath}: no 'files' table")
    for name, entry in files.items():
        ok = isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and isinstance(entry.get("bytes"), int)
        if not ok or not _FILE_NAME.match(name) or ".." in name:
            raise CheckpointError(f"{mpath}: bad entry for file {name!r}")
    return Manifest(step=m["step"], files=files)


def read_verified(path: str | Path, name: str, manifest: Manifest) -> bytes:
    """The bytes of ``path/name`` after checking its size and sha256 against the manifest."""
    fpath = Path(path) / name
    entry = manifest.files.get(name)
    if entry is None:
        raise CheckpointError(f"{fpath}: not listed in {MANIFEST}")
    try:
        data = fpath.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{fpath}: missing file (listed in {MANIFEST})") from None
    except OSError as e:
        raise CheckpointError(f"{fpath}: unreadable: {e}") from None
    if len(data) != entry["bytes"]:
        raise CheckpointError(f"{fpath}: {len(data)} bytes, the manifest says {entry['bytes']} (truncated or replaced)")
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CheckpointError(f"{fpath}: content hash mismatch (sha256 differs from the manifest: damaged or replaced)")
    return data


def load_tensor_bytes(data: bytes, where: str | Path) -> Any:
    """``torch.load(weights_only=True)``: tensors and plain containers only; a pickle that asks
    for anything else (code) is refused, not run."""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises UnpicklingError, RuntimeError (bad zip), ...
        raise CheckpointError(f"{where}: not a tensor file that loads without running "
                              f"code: {type(e).__name__}: {e}") from None


def verify_checkpoint(path: str | Path) -> Manifest:
    """Check every file of the step folder ``path`` against its manifest (no file is parsed)."""
    manifest = read_manifest(path)
    for name in manifest.files:
        read_verified(path, name, manifest)
    return manifest


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """The state saved by :func:`save_checkpoint` in the step folder ``path``, every file
    checked against the manifest first; raises :class:`CheckpointError` naming the file."""
    path = Path(path)
    if _OLD_STEP_FILE.match(path.name):
        raise CheckpointError(_old_format_reason(path))
    manifest = read_manifest(path)
    state: dict[str, Any] = {}
    for name in manifest.files:
        data = read_verified(path, name, manifest)
        if name == STATE_JSON:
            try:
                state.update(json.loads(data))
            except ValueError as e:
                raise CheckpointError(f"{path / name}: invalid JSON: {e}") from None
        elif name.endswith(".pt"):
            state[name[: -len(".pt")]] = load_tensor_bytes(data, path / name)
    return state


def _old_format_reason(path: Path) -> str:
    return (f"{path}: single-file checkpoint of an earlier a3po version; the format changed to step "
            f"folders with a manifest, and the old file is not unpickled because that can run code "
            f"(move it away to start afresh)")


def checkpoint_candidates(ckpt_dir: str | Path) -> list[tuple[int, Path]]:
    """Every ``step_*`` folder and old-format ``step_*.pt`` file, newest step first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = []
    for p in ckpt_dir.iterdir():
        m = _STEP_DIR.match(p.name) or _OLD_STEP_FILE.match(p.name)
        if m:
            found.append((int(m.group(1)), p))
    return sorted(found, key=lambda sp: (sp[0], sp[1].is_dir()), reverse=True)


def _newest_usable(ckpt_dir: str | Path, use: Callable[[Path], Any],
                   on_skip: Callable[[str], None] | None) -> tuple[Path, Any] | None:
    """``(path, use(path))`` for the newest candidate ``use`` accepts (it raises
    :class:`CheckpointError` on the others, which are reported), None when there is none."""
    skipped: list[str] = []
    for _, path in checkpoint_candidates(ckpt_dir):
        try:
            if _OLD_STEP_FILE.match(path.name):
                raise CheckpointError(_old_format_reason(path))
            value = use(path)
        except CheckpointError as e:
            skipped.append(str(e))
            continue
        for reason in skipped:
            msg = f"checkpoint skipped: {reason}; falling back to {path.name}"
            log.warning(msg)
            if on_skip is not None:
                on_skip(msg)
        return path, value
    if skipped:
        raise NoIntactCheckpoint(
            f"{ckpt_dir}: no intact checkpoint, so the run can neither resume nor start over without "
            f"overwriting them (move the folder away to start afresh):\n  " + "\n  ".join(skipped)
        )
    return None


def latest_checkpoint(ckpt_dir: str | Path, on_skip: Callable[[str], None] | None = None) -> Path | None:
    """The newest intact step folder in ``ckpt_dir`` (every file matches the manifest), or None
    when there is no checkpoint at all. Each newer one that is not intact is reported (which
    file, and why) through a ``logging`` warning and ``on_skip``; when there are checkpoints but
    none is intact, raises :class:`NoIntactCheckpoint` listing them."""
    found = _newest_usable(ckpt_dir, verify_checkpoint, on_skip)
    return found[0] if found else None


def load_latest_checkpoint(ckpt_dir: str | Path,
                           on_skip: Callable[[str], None] | None = None) -> tuple[Path, dict[str, Any]] | None:
    """``(path, state)`` of the newest checkpoint that verifies *and* loads (a file whose hash
    matches a tampered manifest but holds more than tensors is refused here and skipped), with
    the reporting of :func:`latest_checkpoint`. Reads each file once."""
    return _newest_usable(ckpt_dir, load_checkpoint, on_skip)
