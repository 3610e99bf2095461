"""Faults around a run: two writers on one run folder, a tracking server that goes away
mid-training, a flow that fails. Real processes, a real MLflow server, real Prefect runs.

1. The run-folder lock (``a3po.storage.runlock``): a second writer is refused naming the holder; a
   holder killed with SIGKILL frees the folder and the next run takes it over, saying so.
2. ``kill_stale_runs`` marks KILLED only the RUNNING runs whose folder nobody holds.
3. ``a3po train`` twice on one folder: refused, then taken over after the first exits
   or is SIGKILLed, and resumed.
4. Two compare flows on one output dir: the second is refused; the first's MLflow runs
   are never tagged superseded and it finishes.
5. Tracking outage: an ``mlflow server`` stopped after step 2 and restarted later;
   training goes on, every metric of every step reaches MLflow, the outage is recorded. Still
   down at the end: the task fails with a clear message, and a re-run back-fills.
6. A failed flow exits promptly: Prefect's log / event workers are drained before the
   temporary server stops, on failure too.
7. A tracking store that is down from the start fails the command (and the flow, as a
   deployment runs it) in seconds, naming the store with its password masked, before the
   Prefect server starts or anything is written.
8. SIGTERM to the flow's process group mid-training: the command exits within seconds and
   leaves no MLflow run RUNNING.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from a3po.storage.runlock import LOCK_NAME, RunFolderBusy, acquire, hold_run_folder, in_use_by_another, read_holder

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
ENV = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}

HOLDER = "import sys, time; from a3po.storage.runlock import acquire; acquire(sys.argv[1]); print('held', flush=True); time.sleep(600)"


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


def test_the_lock_record_and_the_busy_error_never_show_a_store_password(tmp_path):
    """A holder started with ``--tracking-uri`` carrying a password (userinfo and query string):
    the lock file, and the error another writer gets, show the command with the secrets masked."""
    folder = tmp_path / "run"
    uri = "postgresql://a3po:s3cret@db.example/mlflow?sslmode=require&password=s3cret"
    holder = subprocess.Popen([PY, "-c", HOLDER, str(folder), f"--tracking-uri={uri}", "--store", uri],
                              cwd=REPO, env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunFolderBusy) as err:
            acquire(folder)
        record = (folder / LOCK_NAME).read_text()
        for shown in (record, str(err.value)):
            assert "s3cret" not in shown
            # the rest of the command stays readable: user, host, the other query parameter
            assert shown.count("postgresql://a3po:***@db.example/mlflow?sslmode=require&password=***") == 2
    finally:
        _sigkill(holder)


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
    return [PY, "-m", "a3po.training.command", "--preset", "micro", "--output-dir", str(out), "--steps", str(steps),
            "--seed", str(seed), "--no-progress"]


def _wait_for(path_glob, root: Path, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not list(root.glob(path_glob)):
        assert proc.poll() is None, f"process ended before {path_glob} appeared: {proc.communicate()}"
        assert time.monotonic() < deadline, f"no {path_glob} within {timeout_s} s"
        time.sleep(0.05)


def _last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_a3po_train_is_refused_while_another_process_holds_its_run_folder(tmp_path):
    """The fast form of the next test: `a3po train` on a run folder another live process holds
    exits non-zero naming the holder, before writing anything into the folder."""
    out = tmp_path / "out"
    run_dir = out / "loglinear-seed0"
    holder = _hold_in_subprocess(run_dir)
    try:
        refused = subprocess.run(_train_cmd(out, 5, 0), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
        assert refused.returncode != 0 and f"pid {holder.pid}" in refused.stderr and f"command: {PY} -c {run_dir}" in refused.stderr, refused.stderr
        assert [p.name for p in run_dir.iterdir()] == [LOCK_NAME]  # no checkpoint, metrics or model written
        assert holder.poll() is None  # still the holder
    finally:
        _sigkill(holder)


@pytest.mark.slow  # ~80 s: a real run holds the folder to the end; the refusal itself is checked fast above
def test_two_a3po_trains_on_one_folder(tmp_path):
    out = tmp_path / "out"
    # Seed 0: the first run completes untouched while a second one is refused.
    first = subprocess.Popen(_train_cmd(out, 400, 0), cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for("loglinear-seed0/checkpoints/latest", out, first)
    second = subprocess.run(_train_cmd(out, 400, 0), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert first.poll() is None, "the first run ended before the second was checked: the test proves nothing"
    holder = "a3po/training/command.py --preset micro"
    assert second.returncode != 0 and f"pid {first.pid}" in second.stderr and holder in second.stderr, second.stderr
    stdout, stderr = first.communicate(timeout=600)
    assert first.returncode == 0, stderr
    assert _last_json(stdout)["steps"] == 400 and _last_json(stdout)["resumed_from"] is None
    # After it exits, a new run takes the folder and resumes at its last step (nothing retrained).
    again = subprocess.run(_train_cmd(out, 400, 0), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and _last_json(again.stdout)["resumed_from"] == 400
    assert "taking over" not in again.stderr  # the first released it cleanly

    # Seed 1: SIGKILLed mid-run; the next run takes over the stale lock and resumes.
    killed = subprocess.Popen(_train_cmd(out, 400, 1), cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    _wait_for("loglinear-seed1/checkpoints/latest", out, killed)
    _sigkill(killed)
    ckpt_step = json.loads((out / "loglinear-seed1" / "checkpoints" / "latest").read_text())["step"]
    assert ckpt_step < 400
    resumed = subprocess.run(_train_cmd(out, 400, 1), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert f"taking over from pid {killed.pid}" in resumed.stderr
    assert _last_json(resumed.stdout)["resumed_from"] >= ckpt_step and _last_json(resumed.stdout)["steps"] == 400


# --- 4. two compare flows on one output dir ---------------------------------------------------


@pytest.mark.slow
def test_two_compare_flows_on_one_output_dir(prefect_server, tmp_path):
    from mlflow.tracking import MlflowClient

    from flows.compare_variants import CompareSpec, compare_variants

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = tmp_path / "out"
    args = ["--preset", "micro", "--variants", "loglinear", "--seeds", "0", "--steps", "800", "--checkpoint-every", "50",
            "--set", "rl.eval_every=400", "--benchmarks", "", "--tracking-uri", uri, "--experiment", "two", "--output-dir", str(out)]
    env = {**ENV, "PREFECT_API_URL": prefect_server}
    first = subprocess.Popen([PY, "-m", "flows.compare_variants", *args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    _wait_for("loglinear-seed0-*/checkpoints/latest", out, first)  # training, with its parent and child runs open
    # A second flow: refused by the command line before it starts anything, and by the flow
    # itself (what a deployment runs), before it opens an MLflow run.
    with pytest.raises(RunFolderBusy, match=f"pid {first.pid}"):
        compare_variants(CompareSpec(preset="micro", variants=["loglinear"], steps=800, checkpoint_every=50, overrides={"rl": {"eval_every": 400}},
                         benchmarks=[], tracking_uri=uri, experiment="two", output_dir=str(out)))
    second = subprocess.run([PY, "-m", "flows.compare_variants", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("two").experiment_id])
    assert first.poll() is None, "the first flow ended before the second was checked: the test proves nothing"
    assert second.returncode != 0 and f"pid {first.pid}" in second.stderr, second.stderr
    assert "flows/compare_variants.py --preset micro" in second.stderr, second.stderr
    assert len(runs) == 2 and {r.info.status for r in runs} == {"RUNNING"}  # the first flow's parent + child, nothing else
    assert not any("a3po.superseded_by" in r.data.tags for r in runs)
    stdout, stderr = first.communicate(timeout=600)
    assert first.returncode == 0, stderr[-3000:]
    runs = client.search_runs([client.get_experiment_by_name("two").experiment_id])
    assert {r.info.status for r in runs} == {"FINISHED"} and not any("a3po.superseded_by" in r.data.tags for r in runs)


# --- 5. tracking outage -----------------------------------------------------------------------


class MlflowServer:
    """``mlflow server`` on a free loopback port, SQLite backend; stop() / start() at will."""

    def __init__(self, root: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.root, self.uri, self.proc = root, f"http://127.0.0.1:{self.port}", None

    def start(self, timeout_s: float = 240) -> None:
        cmd = [PY, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
               "--artifacts-destination", str(self.root / "artifacts"), "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"]
        self.proc = subprocess.Popen(cmd, cwd=self.root, env=ENV, stdout=open(self.root / "server.log", "a"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2):
                    return
            except OSError:
                assert self.proc.poll() is None, (self.root / "server.log").read_text()[-2000:]
                assert time.monotonic() < deadline, "mlflow server did not start"
                time.sleep(0.3)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def mlflow_server(tmp_path):
    server = MlflowServer(tmp_path)
    server.start()
    yield server
    server.stop()


def _steps_in(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


WATCHER_S = 300  # the longest a watcher thread waits for training to reach a step


def _wait_for_steps(path: Path, steps: int, seen: dict, timeout_s: float = WATCHER_S) -> bool:
    """Wait until ``path`` holds ``steps`` steps; False (with ``seen["timeout"]`` saying why)
    after ``timeout_s``, so a training that never gets there fails the test instead of hanging it."""
    deadline = time.monotonic() + timeout_s
    while _steps_in(path) < steps:
        if time.monotonic() > deadline:
            seen["timeout"] = f"{path} held {_steps_in(path)} of {steps} steps after {timeout_s} s"
            return False
        time.sleep(0.01)
    return True


def _tracked_training(server: MlflowServer, tmp_path: Path, steps: int):
    """A micro config, its warm start, a parent run on the server and the run dir."""
    from a3po.config import preset, with_overrides
    from tasks.tracking import TrackingRef, client_for, create_run, ensure_experiment
    from tasks.training import run_dir_for, warm_start

    cfg = with_overrides(preset("micro"), rl={"steps": steps, "eval_every": 50, "checkpoint_every": 10})
    client = client_for(server.uri)
    exp = ensure_experiment(client, "outage", server.uri)
    ref = TrackingRef(server.uri, exp, create_run(client, exp, "parent", {"a3po.role": "parent"}))
    ws = warm_start.fn(cfg, str(tmp_path / "cache"))
    return cfg, ref, ws, Path(run_dir_for(tmp_path / "out", cfg))


def _assert_every_metric_in_mlflow(client, run_id: str, history_path: Path) -> None:
    rows = [json.loads(line) for line in history_path.read_text().splitlines()]
    for key in rows[0]:
        if key == "step":
            continue
        got = {m.step: m.value for m in client.get_metric_history(run_id, key)}
        want = {r["step"]: r[key] for r in rows if key in r}
        assert got == pytest.approx(want), key


@pytest.mark.e2e
def test_training_continues_through_a_tracking_outage(mlflow_server, tmp_path):
    import threading

    from tasks.training import train_arm

    cfg, ref, ws, run_dir = _tracked_training(mlflow_server, tmp_path, steps=1000)  # ~2.5x the outage on 2 idle cores: the run must outlive it
    seen: dict[str, int] = {}

    def outage() -> None:  # stop the server after step 2, restart it some steps later
        metrics = run_dir / "metrics.jsonl"
        if not _wait_for_steps(metrics, 2, seen):
            return
        mlflow_server.stop()
        seen["down_at"] = _steps_in(metrics)
        time.sleep(8)  # > the shipper's 5 s flush period: it must meet the outage
        seen["up_from"] = _steps_in(metrics)
        mlflow_server.start()

    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    task_log = logging.getLogger("a3po.tasks")  # the task's logger outside a Prefect run (``.fn()``)
    task_log.addHandler(handler)
    watcher = threading.Thread(target=outage, daemon=True)
    watcher.start()
    try:
        rec = train_arm.fn(cfg, str(run_dir), ws, ref, system_metrics_interval_s=1.0)
    finally:
        watcher.join(timeout=WATCHER_S)
        task_log.removeHandler(handler)
    assert not watcher.is_alive(), f"the outage thread was still running {WATCHER_S} s after training ended"
    assert "timeout" not in seen, seen["timeout"]
    assert seen["up_from"] > seen["down_at"]  # training went on while the server was down
    assert seen["up_from"] < rec.steps, "training ended before the server came back: the test proves nothing"
    # Once per outage (a slow answer past the client timeout on a loaded machine counts as one too).
    reported = sum("unreachable since" in m and "training continues" in m and str(run_dir / "metrics.jsonl") in m for m in warnings)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_server.uri)
    run = client.get_run(rec.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert float(run.data.tags["a3po.tracking_outage_s"]) > 1.0 and int(run.data.tags["a3po.tracking_outages"]) == reported >= 1
    _assert_every_metric_in_mlflow(client, rec.mlflow_run_id, Path(rec.history_path))
    assert [m.step for m in client.get_metric_history(rec.mlflow_run_id, "reward/mean")] == list(range(1, cfg.rl.steps + 1))


@pytest.mark.e2e
def test_tracking_still_down_at_the_end_fails_clearly_and_a_rerun_backfills(mlflow_server, tmp_path):
    from mlflow.tracking import MlflowClient

    from tasks.tracking import TrackingUnavailable
    from tasks.training import train_arm

    cfg, ref, ws, run_dir = _tracked_training(mlflow_server, tmp_path, steps=60)
    import threading

    seen: dict[str, str] = {}

    def outage() -> None:
        if _wait_for_steps(run_dir / "metrics.jsonl", 2, seen):
            mlflow_server.stop()

    watcher = threading.Thread(target=outage, daemon=True)
    watcher.start()
    try:
        with pytest.raises(TrackingUnavailable) as err:
            train_arm.fn(cfg, str(run_dir), ws, ref, tracking_drain_s=3.0)
    finally:
        watcher.join(timeout=WATCHER_S)
    assert not watcher.is_alive() and "timeout" not in seen, seen.get("timeout", "the outage thread never ended")
    msg = str(err.value)
    assert str(run_dir / "metrics.jsonl") in msg and "back-fills" in msg and "unreachable since" in msg
    assert _steps_in(run_dir / "metrics.jsonl") == 60  # training itself finished
    assert not in_use_by_another(run_dir) and read_holder(run_dir) is None  # and let go of its folder

    mlflow_server.start()  # back: the same command again (a Prefect retry of the flow run) completes the record
    rec = train_arm.fn(cfg, str(run_dir), ws, ref)
    assert rec.resumed_from == 60
    client = MlflowClient(mlflow_server.uri)
    assert client.get_run(rec.mlflow_run_id).info.status == "FINISHED"
    _assert_every_metric_in_mlflow(client, rec.mlflow_run_id, Path(rec.history_path))


# --- 6. a failed flow exits promptly ----------------------------------------------------------


@pytest.mark.e2e
def test_failed_flow_exits_within_seconds(tmp_path):
    """A task that fails (a dataset folder that does not exist) on Prefect's temporary server:
    before the fix the process lingered ~80 s after the flow failed (workers retrying a stopped
    server); now ~5-11 s on 2 busy cores. The bound is loose on purpose."""
    env = {k: v for k, v in ENV.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}")
    cmd = [PY, "-m", "flows.compare_variants", "--preset", "micro", "--variants", "loglinear", "--dataset", str(tmp_path / "absent"),
           "--benchmarks", "", "--output-dir", str(tmp_path / "out")]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    failed_at, lines = None, []
    for line in proc.stdout:
        lines.append(line)
        if failed_at is None and "Finished in state Failed" in line:
            failed_at = time.monotonic()
    proc.wait(timeout=600)
    assert failed_at is not None, "the flow never printed 'Finished in state Failed':\n" + "".join(lines[-40:])
    exit_s = time.monotonic() - failed_at
    print(f"failed flow exited {exit_s:.1f} s after its failure")
    assert proc.returncode != 0 and exit_s < 45


# --- 7. a tracking store down from the start ---------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


def test_a_tracking_store_down_from_the_start_fails_in_seconds_naming_it(tmp_path, monkeypatch, capsys):
    from flows import cli as flow_cli
    from flows.compare_variants import CompareSpec, compare_variants, main
    from tasks.tracking import TrackingUnreachable

    port = _closed_port()
    uri = f"http://a3po:s3cret@127.0.0.1:{port}/?token=s3cret"
    out = tmp_path / "out"

    def no_server(*args, **kwargs):
        raise AssertionError("the Prefect server was started for a tracking store that is down")

    monkeypatch.setattr(flow_cli, "prefect_api", no_server)
    t0 = time.monotonic()
    assert main(["--preset", "micro", "--variants", "loglinear", "--benchmarks", "", "--tracking-uri", uri, "--output-dir", str(out)]) == 1
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert f"http://a3po:***@127.0.0.1:{port}/?token=*** is unreachable" in err and "s3cret" not in err, err
    assert took < 15, f"{took:.1f} s to give up on a closed port"  # the configs are built first: a few seconds on 2 busy cores
    assert not out.exists()
    # A deployment runs the flow itself: it fails the same way, before any folder or run exists.
    with pytest.raises(TrackingUnreachable, match=r"a3po:\*\*\*@127\.0\.0\.1") as e:
        compare_variants.fn(CompareSpec(preset="micro", variants=["loglinear"], benchmarks=[], tracking_uri=uri, output_dir=str(out)))
    assert "s3cret" not in str(e.value) and not out.exists()


# --- 8. SIGTERM to the flow's process group ------------------------------------------------------


@pytest.mark.e2e
def test_sigterm_to_the_process_group_mid_training_exits_within_seconds(tmp_path):
    """What a terminal's Ctrl-C, ``timeout`` or a CI job's cancel does: the signal reaches every
    process of the group. The temporary Prefect server runs in its own session, so it outlives the
    signal long enough for the flow to record its end: before, the flow retried the dead server
    for ~4 minutes. The bound is loose on purpose (a few seconds on an idle machine)."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {k: v for k, v in ENV.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), MLFLOW_TRACKING_URI=uri)
    out = tmp_path / "out"
    cmd = [PY, "-m", "flows.compare_variants", "--preset", "micro", "--variants", "loglinear", "--steps", "5000", "--checkpoint-every", "20",
           "--benchmarks", "", "--experiment", "sigterm", "--output-dir", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(tmp_path / "log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_for("loglinear-seed0-*/checkpoints/latest", out, proc)  # training, with its parent and child runs open
        os.killpg(proc.pid, signal.SIGTERM)
        t0 = time.monotonic()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 60 s after SIGTERM:\n{(tmp_path / 'log').read_text()[-3000:]}")
        exit_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    print(f"exited {exit_s:.1f} s after SIGTERM")
    assert proc.returncode != 0 and exit_s < 30, (exit_s, (tmp_path / "log").read_text()[-3000:])
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("sigterm").experiment_id])
    assert len(runs) == 2 and {r.info.status for r in runs} == {"FAILED"}, [(r.data.tags.get("a3po.role"), r.info.status) for r in runs]
