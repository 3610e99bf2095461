"""Faults around a run: two writers on one run folder, a tracking server that goes away
mid-training, a flow that fails. Real processes, a real MLflow server, real Prefect runs.

1. The run-folder lock (``a3po.runlock``): a second writer is refused naming the holder; a
   holder killed with SIGKILL frees the folder and the next run takes it over, saying so.
2. ``kill_stale_runs`` marks KILLED only the RUNNING runs whose folder nobody holds.
3. ``a3po train`` twice on one folder (slow): refused, then taken over after the first exits
   or is SIGKILLed, and resumed.
4. Two compare flows on one output dir (slow): the second is refused; the first's MLflow runs
   are never tagged superseded and it finishes.
5. Tracking outage (slow): an ``mlflow server`` stopped after step 2 and restarted later;
   training goes on, every metric of every step reaches MLflow, the outage is recorded. Still
   down at the end: the task fails with a clear message, and a re-run back-fills.
6. A failed flow exits promptly (slow): Prefect's log / event workers are drained before the
   temporary server stops, on failure too.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="a3po-test-prefect-"))  # before Prefect is imported

import pytest

from a3po.runlock import LOCK_NAME, RunFolderBusy, acquire, hold_run_folder, in_use_by_another, read_holder, release

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
ENV = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}

HOLDER = "import sys, time; from a3po.runlock import acquire; acquire(sys.argv[1]); print('held', flush=True); time.sleep(600)"


def _hold_in_subprocess(folder: Path) -> subprocess.Popen:
    """Another process holding ``folder`` (it prints 'held' once it does)."""
    proc = subprocess.Popen([PY, "-c", HOLDER, str(folder)], cwd=REPO, env=ENV, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def _sigkill(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL) if _own_group(proc) else proc.kill()
    proc.wait()


def _own_group(proc: subprocess.Popen) -> bool:
    try:
        return os.getpgid(proc.pid) == proc.pid
    except ProcessLookupError:
        return False


# --- 1. the lock itself ----------------------------------------------------------------------


def test_second_writer_is_refused_naming_the_holder_and_a_killed_holder_is_taken_over(tmp_path):
    folder = tmp_path / "run"
    holder = _hold_in_subprocess(folder)
    try:
        assert in_use_by_another(folder)
        with pytest.raises(RunFolderBusy) as err:
            acquire(folder)
        assert f"pid {holder.pid}" in str(err.value) and f"command: {PY} -c {folder}" in str(err.value)  # the holder and its command
        assert not any(p.name != LOCK_NAME for p in folder.iterdir())  # refused before touching anything
    finally:
        _sigkill(holder)  # the kernel drops its flock; its record stays behind

    assert read_holder(folder)["pid"] == holder.pid and not in_use_by_another(folder)
    notes: list[str] = []
    with hold_run_folder(folder, log=notes.append):
        assert len(notes) == 1 and f"pid {holder.pid}" in notes[0] and "ended without releasing" in notes[0]
        assert read_holder(folder)["pid"] == os.getpid()
        with hold_run_folder(folder, log=notes.append):  # re-entrant within a process
            pass
        assert read_holder(folder)["pid"] == os.getpid() and not in_use_by_another(folder)  # still ours
        # ... and another process is refused while we hold it.
        probe = subprocess.run([PY, "-c", HOLDER, str(folder)], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=60)
        assert probe.returncode != 0 and f"pid {os.getpid()}" in probe.stderr
    assert read_holder(folder) is None  # released cleanly: the next taker has nothing to report
    with hold_run_folder(folder, log=notes.append):
        pass
    assert len(notes) == 1


# --- 2. superseding leftovers only ----------------------------------------------------------


def test_stale_runs_are_marked_killed_only_when_their_folder_is_free(tmp_path):
    from tasks.tracking import client_for, create_run, ensure_experiment, kill_stale_runs

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = client_for(uri)
    exp = ensure_experiment(client, "stale", uri)
    live_dir, dead_dir = tmp_path / "live", tmp_path / "dead"
    tags = lambda d: {"a3po.role": "parent", "a3po.output_dir": str(d), "a3po.host": socket.gethostname()}  # noqa: E731
    live = create_run(client, exp, "live", tags(live_dir))
    dead = create_run(client, exp, "dead", tags(dead_dir))  # a SIGKILLed flow's leftover: its folder is free
    remote = create_run(client, exp, "remote", {**tags(dead_dir), "a3po.host": "another-host"})  # cannot be checked here
    holder = _hold_in_subprocess(live_dir)
    try:
        for d in (live_dir, dead_dir):
            assert kill_stale_runs(client, exp, {"a3po.output_dir": str(d)}, "a3po.output_dir", note="new-flow") == ([] if d == live_dir else [dead])
        assert client.get_run(live).info.status == "RUNNING" and "a3po.superseded_by" not in client.get_run(live).data.tags
        assert client.get_run(dead).info.status == "KILLED" and client.get_run(dead).data.tags["a3po.superseded_by"] == "new-flow"
        assert client.get_run(remote).info.status == "RUNNING"
    finally:
        _sigkill(holder)
    # The live flow was killed: now its run is a leftover too.
    assert kill_stale_runs(client, exp, {"a3po.output_dir": str(live_dir)}, "a3po.output_dir", note="rerun") == [live]
    # A rerun that holds the folder itself supersedes the leftovers of that folder.
    other = create_run(client, exp, "other", tags(live_dir))
    with hold_run_folder(live_dir):
        assert kill_stale_runs(client, exp, {"a3po.output_dir": str(live_dir)}, "a3po.output_dir", keep=[], note="me") == [other]


# --- 3. a3po train twice on one folder -------------------------------------------------------


def _train_cmd(out: Path, steps: int, seed: int) -> list[str]:
    return [PY, "-m", "a3po.cli", "train", "--preset", "micro", "--output-dir", str(out), "--steps", str(steps),
            "--seed", str(seed), "--no-progress"]


def _wait_for(path_glob, root: Path, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not list(root.glob(path_glob)):
        assert proc.poll() is None, f"process ended before {path_glob} appeared: {proc.communicate()}"
        assert time.monotonic() < deadline, f"no {path_glob} within {timeout_s} s"
        time.sleep(0.05)


def _last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_two_a3po_trains_on_one_folder(tmp_path):
    out = tmp_path / "out"
    # Seed 0: the first run completes untouched while a second one is refused.
    first = subprocess.Popen(_train_cmd(out, 400, 0), cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for("loglinear-seed0/checkpoints/latest", out, first)
    second = subprocess.run(_train_cmd(out, 400, 0), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert first.poll() is None, "the first run ended before the second was checked: the test proves nothing"
    assert second.returncode != 0 and f"pid {first.pid}" in second.stderr and "a3po.cli train" in second.stderr, second.stderr
    stdout, stderr = first.communicate(timeout=600)
    assert first.returncode == 0, stderr
    assert _last_json(stdout)["steps"] == 400 and _last_json(stdout)["resumed_from"] is None
    # After it exits, a new run takes the folder and resumes at its last step (nothing retrained).
    again = subprocess.run(_train_cmd(out, 400, 0), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and _last_json(again.stdout)["resumed_from"] == 400
    assert "taking over" not in again.stderr  # the first released it cleanly

    # Seed 1: SIGKILLed mid-run; the next run takes over the stale lock and resumes.
    killed = subprocess.Popen(_train_cmd(out, 400, 1), cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    _wait_for("loglinear-seed1/checkpoints/latest", out, killed)
    _sigkill(killed)
    ckpt_step = json.loads((out / "loglinear-seed1" / "checkpoints" / "latest").read_text())["step"]
    assert ckpt_step < 400
    resumed = subprocess.run(_train_cmd(out, 400, 1), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert f"taking over from pid {killed.pid}" in resumed.stderr
    assert _last_json(resumed.stdout)["resumed_from"] >= ckpt_step and _last_json(resumed.stdout)["steps"] == 400
