"""Faults at resume, on the micro preset through the library entry point
(``a3po.training.run.train_variant``) and the real command (``python -m a3po.training.command``):

- a crafted pickle in place of a checkpoint file never runs (its marker file never appears);
- flipped bytes, a truncated file, a missing manifest are named and the run falls back to the
  previous intact checkpoint, ending equal to an uninterrupted run;
- a missing or invalid ``latest`` pointer changes nothing: resume scans the step folders;
- no intact checkpoint at all: the run stops naming them, rc != 0, nothing overwritten;
- ``metrics.jsonl`` holds each step once after a SIGKILL and a rerun; torn lines are repaired.

One uninterrupted reference run and one run interrupted after step 7 (checkpoints 2, 4, 6) are
made once; each test damages its own copy of the interrupted run and resumes it (4 steps).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from a3po.config import preset, with_overrides
from a3po.storage.checkpoint import CheckpointError, NoIntactCheckpoint, load_checkpoint, save_checkpoint
from a3po.storage.runlock import LOCK_NAME
from a3po.training.metrics import JsonlLogger, read_metrics_jsonl
from a3po.training.run import prepare_warmstart, train_variant
from cli import main as cli_main
from tests.support.resume import Crash, assert_same_final_state, crash_after, without_timing

REPO = Path(__file__).resolve().parents[2]
STEPS = 8
RL = {"steps": STEPS, "checkpoint_every": 2, "keep_checkpoints": 3, "eval_every": 4}

pytestmark = pytest.mark.usefixtures("core_one_thread")


def _cfg():
    return with_overrides(preset("micro"), rl=RL, torch_threads=1)


def _train(run_dir: Path, ws, progress=None):
    return train_variant(_cfg(), run_dir, ws[0], ws[1], logger=JsonlLogger(run_dir / "metrics.jsonl"), progress=progress)


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "final" / "model.safetensors")


def _tree_bytes(root: Path) -> dict[str, bytes]:
    """Every file of the run folder but the run lock's record (a3po.storage.runlock), which a refused
    run may create: what must stay untouched is the run's data."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and p.name != LOCK_NAME}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(warm start, reference run dir, interrupted run dir): the reference ran all 8 steps, the
    interrupted one stopped during step 7 with checkpoints at steps 2, 4 and 6."""
    root = tmp_path_factory.mktemp("faults")
    ws = prepare_warmstart(_cfg(), root / "cache", log=lambda _: None)
    ref = root / "reference"
    ref_result = _train(ref, ws)

    base = root / "interrupted"
    with pytest.raises(Crash):  # after step 7: the step-6 checkpoint is written, metrics.jsonl has step 7
        _train(base, ws, progress=crash_after(7))
    assert sorted(p.name for p in (base / "checkpoints").glob("step_*")) == ["step_000002", "step_000004", "step_000006"]
    return ws, ref, ref_result, base


@pytest.fixture
def run_copy(runs, tmp_path):
    ws, ref, ref_result, base = runs
    run = tmp_path / "run"
    shutil.copytree(base, run)
    return ws, ref, ref_result, run


def _assert_equals_reference(result, run: Path, ref: Path, ref_result) -> None:
    """Same final weights, same per-step record, and metrics.jsonl holds steps 1..8 once."""
    assert_same_final_state((result, _final_weights(run)), (ref_result, _final_weights(ref)))
    rows = read_metrics_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert without_timing(rows) == without_timing(read_metrics_jsonl(ref / "metrics.jsonl"))


def test_reference_run_learned_something(runs):
    # Equal final weights below prove exact resume only if RL moved the weights at all.
    ws, ref, _, _ = runs
    start = load_file(Path(ws[0]) / "model.safetensors")
    final = _final_weights(ref)
    assert any(not torch.equal(start[k], final[k]) for k in final if k in start)


def _flip_tensor_bytes(pt_file: Path, tensor: torch.Tensor) -> None:
    """XOR 16 bytes in the middle of ``tensor``'s raw data inside the torch zip file."""
    data = bytearray(pt_file.read_bytes())
    raw = tensor.contiguous().numpy().tobytes()
    at = bytes(data).find(raw)
    assert at >= 0, "tensor bytes not found in the file"
    mid = at + len(raw) // 2
    data[mid : mid + 16] = bytes(b ^ 0xFF for b in data[mid : mid + 16])
    pt_file.write_bytes(bytes(data))


def test_flipped_tensor_bytes_are_detected_named_and_fall_back(run_copy):
    ws, ref, ref_result, run = run_copy
    victim = run / "checkpoints" / "step_000006" / "policy.pt"
    name, tensor = max(load_checkpoint(victim.parent)["policy"].items(), key=lambda kv: kv[1].numel())
    _flip_tensor_bytes(victim, tensor)
    # The damage is silent to torch itself: the file still loads, with other weights.
    damaged = torch.load(victim, weights_only=True)[name]
    assert not torch.equal(damaged, tensor)

    result = _train(run, ws)
    assert result.resumed_from == 4
    (msg,) = result.checkpoints_skipped
    assert str(victim) in msg and "content hash mismatch" in msg and "falling back to step_000004" in msg
    _assert_equals_reference(result, run, ref, ref_result)
    # The damaged step-6 folder was replaced by the resumed run's own, intact one.
    assert load_checkpoint(run / "checkpoints" / "step_000006")["step"] == 6


def test_truncated_file_is_named_and_falls_back(run_copy, caplog):
    ws, ref, ref_result, run = run_copy
    victim = run / "checkpoints" / "step_000006" / "optimizer.pt"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with caplog.at_level("WARNING", logger="a3po.storage.checkpoint"):
        result = _train(run, ws)
    assert result.resumed_from == 4
    (msg,) = result.checkpoints_skipped
    assert str(victim) in msg and "the manifest says" in msg
    assert any(str(victim) in r.getMessage() for r in caplog.records)  # also a logged warning
    _assert_equals_reference(result, run, ref, ref_result)


def test_step_folder_without_manifest_is_not_a_checkpoint(run_copy):
    ws, _, _, run = run_copy
    (run / "checkpoints" / "step_000006" / "manifest.json").unlink()
    result = _train(run, ws)
    assert result.resumed_from == 4
    assert "step_000006: missing manifest.json" in result.checkpoints_skipped[0]


class _Payload:
    """Unpickling this calls ``open(marker, "w")``: creates the marker file, i.e. runs code."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _crafted_torch_file(path: Path, marker: Path) -> None:
    torch.save({"w": _Payload(marker)}, path)


def test_crafted_pickle_file_is_really_malicious(tmp_path):
    # The control for the two tests below: loaded the old way, the crafted file runs its code.
    marker = tmp_path / "pwned-control"
    _crafted_torch_file(tmp_path / "evil.pt", marker)
    torch.load(tmp_path / "evil.pt", weights_only=False)
    assert marker.exists()


def test_crafted_pickle_in_place_of_a_checkpoint_file_never_runs(run_copy):
    ws, ref, ref_result, run = run_copy
    marker = run.parent / "pwned"
    victim = run / "checkpoints" / "step_000006" / "policy.pt"
    _crafted_torch_file(victim, marker)
    result = _train(run, ws)
    assert not marker.exists()
    assert result.resumed_from == 4
    assert str(victim) in result.checkpoints_skipped[0] and "replaced" in result.checkpoints_skipped[0]
    _assert_equals_reference(result, run, ref, ref_result)


def test_crafted_pickle_with_a_forged_manifest_is_refused_by_the_safe_loader(run_copy):
    # Someone who can also rewrite the manifest gets past the hash check; weights_only refuses the file.
    ws, ref, ref_result, run = run_copy
    marker = run.parent / "pwned"
    step6 = run / "checkpoints" / "step_000006"
    victim = step6 / "weights_history.pt"
    _crafted_torch_file(victim, marker)
    manifest = json.loads((step6 / "manifest.json").read_text())
    data = victim.read_bytes()
    manifest["files"]["weights_history.pt"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (step6 / "manifest.json").write_text(json.dumps(manifest))

    result = _train(run, ws)
    assert not marker.exists()
    assert result.resumed_from == 4
    assert str(victim) in result.checkpoints_skipped[0] and "without running code" in result.checkpoints_skipped[0]
    _assert_equals_reference(result, run, ref, ref_result)


@pytest.mark.parametrize("latest", [None, b"{not json", b'{"step": 2, "file": "step_000002.pt"}'])
def test_missing_or_invalid_latest_pointer_resumes_from_the_newest_step_folder(run_copy, latest):
    ws, ref, ref_result, run = run_copy
    pointer = run / "checkpoints" / "latest"
    pointer.unlink()
    if latest is not None:
        pointer.write_bytes(latest)
    result = _train(run, ws)
    assert result.resumed_from == 6 and result.checkpoints_skipped == []
    _assert_equals_reference(result, run, ref, ref_result)  # no restart from 0, no duplicated steps


def test_no_intact_checkpoint_stops_naming_them_and_overwrites_nothing(runs, tmp_path, capsys):
    ws, _, _, base = runs
    out = tmp_path / "cli"  # the CLI's layout: <out>/cache (the same warm start), <out>/loglinear-seed0
    shutil.copytree(Path(ws[0]).parent, out / "cache")
    run = out / "loglinear-seed0"
    shutil.copytree(base, run)
    damaged = [run / "checkpoints" / f"step_{step:06d}" / "state.json" for step in (2, 4, 6)]
    for f in damaged:
        f.write_bytes(f.read_bytes()[:-3])
    before = _tree_bytes(run)
    # The CLI's own entry point, in this process (a subprocess would only add its import time).
    rc = cli_main(["train", "--variant", "loglinear", "--preset", "micro", "--output-dir", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert rc != 0
    assert "a3po train:" in err and "no intact checkpoint" in err
    assert all(str(f) in err for f in damaged)
    assert _tree_bytes(run) == before  # checkpoints and metrics.jsonl untouched; no final/


def test_old_single_file_checkpoints_are_refused_not_unpickled(runs, tmp_path):
    ws = runs[0]
    run = tmp_path / "run"
    marker = tmp_path / "pwned"
    (run / "checkpoints").mkdir(parents=True)
    _crafted_torch_file(run / "checkpoints" / "step_000004.pt", marker)  # what an old version wrote, or a forgery
    with pytest.raises(NoIntactCheckpoint, match=r"step_000004\.pt: single-file checkpoint of an earlier a3po version"):
        _train(run, ws)
    assert not marker.exists() and not (run / "final").exists()


def test_a_checkpoint_of_another_config_is_not_resumed(run_copy):
    # The CLI's run folder is <out>/<variant>-seed<seed>: a rerun with another lr must not splice
    # its steps onto the old run's checkpoint; it stops naming the field, and writes nothing.
    ws, _, _, run = run_copy
    before = _tree_bytes(run)
    other = with_overrides(_cfg(), rl={"lr": 3e-4})
    with pytest.raises(CheckpointError, match=r"step_000006 was saved by a run with a different config \(rl\.lr differ\)"):
        train_variant(other, run, ws[0], ws[1], logger=JsonlLogger(run / "metrics.jsonl"))
    assert _tree_bytes(run) == before


# --- metrics.jsonl ------------------------------------------------------------------------


def test_sigkill_and_rerun_leave_each_step_once_in_metrics_jsonl(runs, tmp_path):
    ws = runs[0]
    out = tmp_path / "out"
    shutil.copytree(Path(ws[0]).parent, out / "cache")
    cfg_file = tmp_path / "rl.yaml"
    cfg_file.write_text("rl:\n  checkpoint_every: 2\n  eval_every: 1000\n  keep_checkpoints: 2\ntorch_threads: 1\n")
    steps = 40
    cmd = [sys.executable, "-m", "a3po.training.command", "--variant", "loglinear", "--preset", "micro", "--config", str(cfg_file),
           "--steps", str(steps), "--output-dir", str(out), "--no-progress"]
    run = out / "loglinear-seed0"
    metrics = run / "metrics.jsonl"

    def logged_past_a_checkpoint() -> bool:
        done = [int(p.name[5:]) for p in (run / "checkpoints").glob("step_*")] if (run / "checkpoints").is_dir() else []
        return bool(done) and metrics.exists() and len(read_metrics_jsonl(metrics)) > max(done)

    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not logged_past_a_checkpoint():
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    newest = max(int(p.name[5:]) for p in (run / "checkpoints").glob("step_*"))
    assert newest < steps, "killed after the end: nothing to resume"
    with open(metrics, "ab") as f:  # as if the kill had landed mid-line
        f.write(b'{"step": 999, "reward/me')
    before = read_metrics_jsonl(metrics)  # the reader drops the torn line
    assert len(before) > newest and before[-1]["step"] != 999

    rerun = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert json.loads(rerun.stdout.strip().splitlines()[-1])["resumed_from"] == newest
    lines = metrics.read_bytes().split(b"\n")
    assert lines[-1] == b""  # ends with a newline
    rows = [json.loads(line) for line in lines[:-1]]  # every line is whole JSON
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    # Steps up to the checkpoint are the checkpoint's record, identical to what the killed run logged.
    assert rows[:newest] == before[:newest]


def test_jsonl_logger_repairs_a_torn_line_and_rewinds(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 0, "eval/heldout_acc": 0.5}\n{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.0}\n{"step": 3, "a"')
    assert [r["step"] for r in read_metrics_jsonl(path)] == [0, 1, 2]
    JsonlLogger(path).log_metrics({"a": 3.5}, 3)  # appends after cutting the torn line
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [0, 1, 2, 3]
    # A resume from step 1: the warm-start line (step 0) stays, then the checkpoint's history.
    JsonlLogger(path).rewind(1, [{"a": 1.25}])
    assert [json.loads(x) for x in path.read_text().splitlines()] == [{"step": 0, "eval/heldout_acc": 0.5}, {"step": 1, "a": 1.25}]
    JsonlLogger(path).rewind(0, [])  # a fresh start: the killed attempt's lines go
    assert path.read_bytes() == b""
    path.write_bytes(b'{"step": 1}\n{"step": 2\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl line 2"):
        read_metrics_jsonl(path)  # a bad line that is not the last one is an error naming it


def test_jsonl_logger_leaves_no_half_line_when_the_disk_fills(tmp_path):
    # A real short write: RLIMIT_FSIZE caps the file (like a full disk); the line that crosses
    # the cap is partly written by the kernel, then cut back by the logger.
    path, cap = tmp_path / "metrics.jsonl", 1000
    code = textwrap.dedent(f"""
        import resource, signal
        from a3po.training.metrics import JsonlLogger
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, ({cap}, {cap}))
        lg = JsonlLogger({str(path)!r})
        for step in range(1, 1000):
            try:
                lg.log_metrics({{"reward/mean": step / 7}}, step)
            except OSError as e:
                print("failed at", step, e)
                break
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "failed at" in proc.stdout, proc.stderr
    data = path.read_bytes()
    assert 0 < len(data) < cap and data.endswith(b"\n")
    rows = [json.loads(x) for x in data.splitlines()]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))


def test_save_refuses_values_that_would_not_load_safely(tmp_path):
    # Neither JSON nor tensors: refused at save, naming where, so no checkpoint is written that
    # a resume would have to refuse (or, with the old loader, unpickle).
    with pytest.raises(TypeError, match="state.json"):
        save_checkpoint(tmp_path, 1, {"step": 1, "thing": object()})
    with pytest.raises(TypeError, match=r"policy.pt\['f'\] is a _Payload"):
        save_checkpoint(tmp_path, 2, {"step": 2, "policy": {"w": torch.zeros(1), "f": _Payload(tmp_path / "x")}})
    assert not list(tmp_path.glob("step_*")) and not (tmp_path / "x").exists()


def test_a_full_disk_at_a_checkpoint_is_named_frees_its_partial_step_and_is_not_retried(tmp_path, monkeypatch):
    """torch.save on a full disk fails as a RuntimeError of its zip writer ("unexpected pos"),
    raised while handling the OSError: the checkpoint names the file, what is free and what to do,
    removes its half-written step, keeps the last checkpoint whole, and the task does not retry
    (a retry would train again up to the same checkpoint). Other errors pass through as they were."""
    import errno
    from types import SimpleNamespace

    from a3po.storage.checkpoint import DiskFullError
    from tasks.training import _worth_retrying

    def state(step: int) -> dict:
        return {"step": step, "policy": {"w": torch.full((1024,), float(step))}}

    save_checkpoint(tmp_path, 1, state(1))

    def full_disk(obj, f):
        f.write(b"\0" * 4096)
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4096 vs 4000") from None

    monkeypatch.setattr(torch, "save", full_disk)
    words = r"no room to write checkpoint file \S*policy\.pt .*: no space left on the device \(.* free in .*rl\.keep_checkpoints"
    with pytest.raises(DiskFullError, match=words) as err:
        save_checkpoint(tmp_path, 2, state(2))
    assert err.value.errno == errno.ENOSPC and isinstance(err.value.__cause__, RuntimeError)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000001"]  # no half-written step left
    assert load_checkpoint(tmp_path / "step_000001")["policy"]["w"][0] == 1.0
    assert not _worth_retrying(None, None, SimpleNamespace(data=err.value))
    assert _worth_retrying(None, None, SimpleNamespace(data=RuntimeError("a transient failure")))

    def other(obj, f):
        raise RuntimeError("something else")

    monkeypatch.setattr(torch, "save", other)
    with pytest.raises(RuntimeError, match="something else") as err:
        save_checkpoint(tmp_path, 3, state(3))
    assert not isinstance(err.value, DiskFullError)


NO_ROOM_WRITES = {
    # a checkpoint: torch.save wraps the EFBIG in its zip writer's RuntimeError
    "checkpoint": "from a3po.storage.checkpoint import save_checkpoint\n"
                  "save_checkpoint(out / 'ckpt', 2, {'step': 2, 'policy': {'w': torch.zeros(1 << 20)}})",
    # the final model folder (safetensors' writer), and a record's text
    "model folder": "from a3po.storage.atomic import save_pretrained_atomic\n"
                    "from a3po.models.factory import build_tiny_model\nfrom a3po.data.arithmetic import WORDS\n"
                    "m, t = build_tiny_model('tiny', WORDS, seed=0)\nsave_pretrained_atomic(m, t, out / 'final')",
    "text file": "from a3po.storage.atomic import atomic_write_text\natomic_write_text(out / 'result.json', 'x' * (1 << 20))",
}


@pytest.mark.parametrize("what", sorted(NO_ROOM_WRITES))
def test_a_file_size_limit_is_no_room_named_with_its_limit_and_leaves_nothing_partial(tmp_path, what):
    """``ulimit -f`` (as batch schedulers set it; FAT32's 4 GiB likewise) fails a write with EFBIG,
    not ENOSPC: each writer of the run says so in one line naming the file and the limit, as a
    DiskFullError (which the flow's task does not retry), and frees what it had written."""
    import resource
    import subprocess
    import sys
    import textwrap

    script = "\n".join([
        "import sys, torch", "from pathlib import Path", "from a3po.storage.atomic import DiskFullError",
        "out = Path(sys.argv[1])", "try:", textwrap.indent(NO_ROOM_WRITES[what], "    "),
        "except DiskFullError as e:", "    print(f'DiskFullError errno={e.errno}: {e}')",
    ])
    limit = 300_000  # bytes: more than the script's imports write, less than what it saves

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], preexec_fn=cap, capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("DiskFullError errno=27: [Errno 27] no room to write "), line
    assert "this process's file-size limit, ulimit -f: 300,000 bytes" in line and "\n" not in line
    left = [p for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size > 0]
    assert left == [], left  # the partial file, temporary folder or pending step is gone


def test_fields_added_since_a_checkpoint_count_as_their_defaults():
    # A checkpoint of an earlier version lacks the sections and fields added since: they are
    # their defaults, so the run resumes; a field that really changed is still named.
    from a3po.config import config_differences, config_to_dict

    current = config_to_dict(_cfg())
    saved = json.loads(json.dumps(current))
    del saved["oppo"], saved["data"]["long_tail_frac"]
    assert config_differences(saved, current) == []
    saved["rl"]["lr"] = 1.0
    assert config_differences(saved, current) == ["rl.lr"]


def test_a_finished_run_whose_checkpoints_are_gone_is_refused_and_keeps_its_files(tmp_path):
    """Its checkpoints deleted to save disk, a finished run would train again from step 0 and
    overwrite its metrics: train_variant refuses, naming result.json, and leaves every file as it
    was; with result.json moved away it trains again."""
    import torch

    from a3po.config import preset, with_overrides
    from a3po.training.metrics import JsonlLogger
    from a3po.training.run import FinishedRunError, prepare_warmstart, train_variant

    torch.set_num_threads(1)
    cfg = with_overrides(preset("micro"), rl={"steps": 2, "checkpoint_every": 1, "eval_every": 2})
    ws, acc = prepare_warmstart(preset("micro"), tmp_path / "cache", log=lambda s: None)
    run = tmp_path / "run"
    train_variant(cfg, run, ws, acc, logger=JsonlLogger(run / "metrics.jsonl"))
    shutil.rmtree(run / "checkpoints")
    kept = {p.name: p.read_bytes() for p in (run / "result.json", run / "metrics.jsonl", run / "history.jsonl") if p.exists()}
    assert "result.json" in kept and "metrics.jsonl" in kept
    with pytest.raises(FinishedRunError, match=r"result\.json records a finished run.*no checkpoint to resume from"):
        train_variant(cfg, run, ws, acc, logger=JsonlLogger(run / "metrics.jsonl"))
    assert {name: (run / name).read_bytes() for name in kept} == kept
    (run / "result.json").rename(tmp_path / "result.json")
    train_variant(cfg, run, ws, acc, logger=JsonlLogger(run / "metrics.jsonl"))
    assert (run / "result.json").is_file()
