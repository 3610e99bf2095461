"""Checkpoints are atomic: a crash while writing leaves the previous checkpoint and the
``latest`` pointer intact and no temporary file behind; pruning keeps ``keep`` files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import a3po.checkpoint as ckpt
from a3po.checkpoint import atomic_write_bytes, latest_checkpoint, load_checkpoint, save_checkpoint

pytestmark = pytest.mark.usefixtures("core_one_thread")


def _state(step):
    return {"step": step, "policy": {"w": torch.full((64, 64), float(step))}}


def _files(d):
    return sorted(os.listdir(d))


def test_save_load_and_latest(tmp_path):
    p = save_checkpoint(tmp_path, 3, _state(3))
    assert p.name == "step_000003.pt"
    assert latest_checkpoint(tmp_path) == p
    assert json.loads((tmp_path / "latest").read_text()) == {"step": 3, "file": "step_000003.pt"}
    assert torch.equal(load_checkpoint(p)["policy"]["w"], _state(3)["policy"]["w"])
    assert latest_checkpoint(tmp_path / "nothing-here") is None


def test_crash_mid_write_keeps_previous_checkpoint_and_pointer(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 2, _state(2))
    before = {n: (tmp_path / n).read_bytes() for n in _files(tmp_path)}

    def torch_save_that_dies_halfway(obj, f):
        f.write(b"PK\x03\x04 partial zip bytes")  # some bytes reach the (temporary) file...
        raise OSError("disk full")  # ...then the write fails

    monkeypatch.setattr(ckpt.torch, "save", torch_save_that_dies_halfway)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 4, _state(4))
    monkeypatch.undo()

    assert _files(tmp_path) == ["latest", "step_000002.pt"]  # no step_000004.pt, no .tmp left
    assert {n: (tmp_path / n).read_bytes() for n in _files(tmp_path)} == before
    assert latest_checkpoint(tmp_path).name == "step_000002.pt"
    assert load_checkpoint(latest_checkpoint(tmp_path))["step"] == 2


def test_crash_while_writing_the_pointer_keeps_the_old_pointer(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 2, _state(2))
    real = ckpt.atomic_write_text

    def failing_pointer(path, text):
        raise KeyboardInterrupt  # e.g. Ctrl-C between the checkpoint and its pointer

    monkeypatch.setattr(ckpt, "atomic_write_text", failing_pointer)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 4, _state(4))
    monkeypatch.setattr(ckpt, "atomic_write_text", real)
    # The new file is complete but not pointed at: resume uses the previous one.
    assert latest_checkpoint(tmp_path).name == "step_000002.pt"
    assert not [n for n in _files(tmp_path) if n.endswith(".tmp")]


def test_atomic_write_cleans_up_on_any_exception(tmp_path):
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")

    def write(f):
        f.write(b"new-but-incomplete")
        raise KeyboardInterrupt  # BaseException, not only Exception

    with pytest.raises(KeyboardInterrupt):
        atomic_write_bytes(target, write)
    assert target.read_bytes() == b"old"
    assert _files(tmp_path) == ["f.bin"]


def test_hard_kill_mid_write_leaves_previous_checkpoint_loadable(tmp_path):
    # A real crash (no exception handler runs): the process dies inside torch.save. The old
    # checkpoint and pointer are untouched; the orphaned temp file is hidden (".step_...tmp")
    # and ignored by latest_checkpoint and by pruning's "step_*.pt" glob.
    save_checkpoint(tmp_path, 2, _state(2))
    code = textwrap.dedent(f"""
        import os, torch
        import a3po.checkpoint as c
        def dying_save(obj, f):
            f.write(b"partial")
            f.flush()
            os._exit(9)
        c.torch.save = dying_save
        c.save_checkpoint({str(tmp_path)!r}, 4, {{"step": 4}})
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env={**os.environ, "PYTHONPATH": root}, timeout=120)
    assert proc.returncode == 9
    names = _files(tmp_path)
    assert "step_000004.pt" not in names
    assert [n for n in names if n.endswith(".tmp")] and all(n.startswith(".") for n in names if n.endswith(".tmp"))
    assert latest_checkpoint(tmp_path).name == "step_000002.pt"
    assert load_checkpoint(latest_checkpoint(tmp_path))["step"] == 2
    save_checkpoint(tmp_path, 6, _state(6), keep=1)  # the next save still works and prunes step_2
    assert [n for n in _files(tmp_path) if n.startswith("step_")] == ["step_000006.pt"]


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_pruning_keeps_the_newest_keep_files(tmp_path, keep):
    for step in (1, 2, 5, 10, 11):
        save_checkpoint(tmp_path, step, _state(step), keep=keep)
    kept = [n for n in _files(tmp_path) if n.startswith("step_")]
    assert kept == [f"step_{s:06d}.pt" for s in (1, 2, 5, 10, 11)[-keep:]]
    assert latest_checkpoint(tmp_path).name == "step_000011.pt"


def test_pointer_to_a_missing_file_is_an_error(tmp_path):
    save_checkpoint(tmp_path, 1, _state(1))
    (tmp_path / "step_000001.pt").unlink()
    with pytest.raises(FileNotFoundError, match="step_000001.pt"):
        latest_checkpoint(tmp_path)
