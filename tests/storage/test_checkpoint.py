"""Checkpoints are atomic step folders: a crash while writing leaves the previous checkpoint
intact and no half-written step folder behind; pruning keeps ``keep`` folders; the manifest is
written last and checked at load; the multi-rank pieces commit files written separately."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import a3po.storage.checkpoint as ckpt
from a3po.storage.checkpoint import (
    CheckpointError,
    atomic_write_bytes,
    begin_step,
    commit_step,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    write_json_file,
    write_tensor_file,
)

pytestmark = pytest.mark.usefixtures("core_one_thread")


def _state(step):
    return {"step": step, "policy": {"w": torch.full((64, 64), float(step))}, "history": [{"a": 0.1 * step}], "curve": [(0, 0.5)]}


def _files(d):
    return sorted(os.listdir(d))


def _steps(d):
    return [n for n in _files(d) if n.startswith("step_")]


def test_save_load_and_latest(tmp_path):
    p = save_checkpoint(tmp_path, 3, _state(3))
    assert p.name == "step_000003" and p.is_dir()
    assert sorted(os.listdir(p)) == ["manifest.json", "policy.pt", "state.json"]
    assert latest_checkpoint(tmp_path) == p
    assert json.loads((tmp_path / "latest").read_text())["step"] == 3  # a hint for people
    back = load_checkpoint(p)
    assert torch.equal(back["policy"]["w"], _state(3)["policy"]["w"])
    # Plain values go through JSON: floats exactly, tuples as lists.
    assert back["step"] == 3 and back["history"] == [{"a": 0.1 * 3}] and back["curve"] == [[0, 0.5]]
    assert latest_checkpoint(tmp_path / "nothing-here") is None


def test_manifest_lists_every_file_with_its_hash(tmp_path):
    import hashlib

    p = save_checkpoint(tmp_path, 1, _state(1))
    m = json.loads((p / "manifest.json").read_text())
    assert m["format"] == ckpt.FORMAT and m["step"] == 1
    assert set(m["files"]) == {"policy.pt", "state.json"}
    for name, entry in m["files"].items():
        data = (p / name).read_bytes()
        assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def test_crash_mid_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 2, _state(2))
    before = {n: sorted(os.listdir(tmp_path / n)) for n in _steps(tmp_path)}

    def torch_save_that_dies_halfway(obj, f):
        f.write(b"PK\x03\x04 partial zip bytes")  # some bytes reach the (pending) file...
        raise OSError("disk full")  # ...then the write fails

    monkeypatch.setattr(ckpt.torch, "save", torch_save_that_dies_halfway)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 4, _state(4))
    monkeypatch.undo()

    assert _steps(tmp_path) == ["step_000002"]  # no step_000004 (only a hidden pending folder)
    assert {n: sorted(os.listdir(tmp_path / n)) for n in _steps(tmp_path)} == before
    assert latest_checkpoint(tmp_path).name == "step_000002"
    assert load_checkpoint(latest_checkpoint(tmp_path))["step"] == 2
    save_checkpoint(tmp_path, 4, _state(4))  # the next attempt replaces the leftover pending folder
    assert latest_checkpoint(tmp_path).name == "step_000004"
    assert not [n for n in _files(tmp_path) if n.endswith(".pending")]


def test_crash_before_the_manifest_leaves_no_step_folder(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 2, _state(2))
    real = ckpt.fsync_dir

    def dies_before_rename(path):
        raise KeyboardInterrupt  # e.g. Ctrl-C after the manifest, before the rename

    monkeypatch.setattr(ckpt, "fsync_dir", dies_before_rename)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 4, _state(4))
    monkeypatch.setattr(ckpt, "fsync_dir", real)
    assert _steps(tmp_path) == ["step_000002"]
    assert latest_checkpoint(tmp_path).name == "step_000002"


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



class _Saves:
    """Stands in for a model or tokenizer: ``save_pretrained`` writes one file, or fails half-way."""

    def __init__(self, name: str, fail: bool = False) -> None:
        self.name, self.fail = name, fail

    def save_pretrained(self, folder) -> None:
        (Path(folder) / self.name).write_text("new")
        if self.fail:
            raise KeyboardInterrupt


def test_save_pretrained_atomic_replaces_the_folder_whole_or_leaves_it_as_it_was(tmp_path):
    from a3po.storage.atomic import save_pretrained_atomic

    out = tmp_path / "final"
    out.mkdir()
    (out / "old.bin").write_text("old")
    with pytest.raises(KeyboardInterrupt):  # the tokenizer fails after the model was written
        save_pretrained_atomic(_Saves("model.bin"), _Saves("tokenizer.json", fail=True), out)
    assert _files(tmp_path) == ["final"] and _files(out) == ["old.bin"]  # no temporary folder left
    assert save_pretrained_atomic(_Saves("model.bin"), _Saves("tokenizer.json"), out) == out
    assert _files(tmp_path) == ["final"] and _files(out) == ["model.bin", "tokenizer.json"]

def test_hard_kill_mid_write_leaves_previous_checkpoint_loadable(tmp_path):
    # A real crash (no exception handler runs): the process dies inside torch.save. The old
    # checkpoint is untouched; the orphaned pending folder is hidden (".step_...pending"),
    # ignored by latest_checkpoint and removed by the next save's pruning.
    save_checkpoint(tmp_path, 2, _state(2))
    code = textwrap.dedent(f"""
        import os, torch
        import a3po.storage.checkpoint as c
        def dying_save(obj, f):
            f.write(b"partial")
            f.flush()
            os._exit(9)
        c.torch.save = dying_save
        c.save_checkpoint({str(tmp_path)!r}, 4, {{"step": 4, "policy": {{"w": torch.zeros(2)}}}})
    """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env={**os.environ, "PYTHONPATH": root}, timeout=120)
    assert proc.returncode == 9
    names = _files(tmp_path)
    assert "step_000004" not in names and ".step_000004.pending" in names
    assert latest_checkpoint(tmp_path).name == "step_000002"
    assert load_checkpoint(latest_checkpoint(tmp_path))["step"] == 2
    save_checkpoint(tmp_path, 6, _state(6), keep=1)  # the next save still works and prunes step_2
    assert _steps(tmp_path) == ["step_000006"]
    assert ".step_000004.pending" not in _files(tmp_path)


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_pruning_keeps_the_newest_keep_folders(tmp_path, keep):
    for step in (1, 2, 5, 10, 11):
        save_checkpoint(tmp_path, step, _state(step), keep=keep)
    assert _steps(tmp_path) == [f"step_{s:06d}" for s in (1, 2, 5, 10, 11)[-keep:]]
    assert latest_checkpoint(tmp_path).name == "step_000011"


def test_multi_rank_pieces_commit_files_written_separately(tmp_path):
    # Two "ranks" write their shards into one pending folder; one commit names them all.
    pending = begin_step(tmp_path, 8)
    hashes = {
        "policy.rank0.pt": write_tensor_file(pending, "policy.rank0.pt", {"w": torch.ones(3)}),
        "policy.rank1.pt": write_tensor_file(pending, "policy.rank1.pt", {"w": torch.zeros(3)}),
        "state.json": write_json_file(pending, "state.json", {"step": 8}),
    }
    with pytest.raises(CheckpointError, match=r"files written but not reported \['policy.rank1.pt'\]"):
        commit_step(tmp_path, 8, {k: v for k, v in hashes.items() if k != "policy.rank1.pt"})
    assert latest_checkpoint(tmp_path) is None  # a refused commit leaves no checkpoint
    path = commit_step(tmp_path, 8, hashes, keep=2)
    state = load_checkpoint(path)
    assert torch.equal(state["policy.rank1"]["w"], torch.zeros(3)) and state["step"] == 8
    with pytest.raises(ValueError, match="plain names"):
        write_json_file(begin_step(tmp_path, 9), "../escape.json", {})
