"""A stop of ``a3po train`` while a held-out evaluation runs beside the trainer
(``rl.eval_mode: background``) ends as the same stop ends an inline run: its exit status and one
line on stderr, never a native abort ("terminate called without an active exception", exit 134)
from an evaluation thread left in torch code at interpreter exit.

The evaluation is made long (400 held-out rows x 8 samples on ``micro``) so that it is in flight
when the stop comes: a full disk (a real EFBIG: the file-size limit below a checkpoint's file) at
the step-2 checkpoint, whose own evaluation has just started; Ctrl-C (SIGINT) once step 3's line
is out, with step 2's evaluation running.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import time
from pathlib import Path

import yaml

from tests.support.cli_runs import train_command

REPO = Path(__file__).resolve().parents[2]
BACKGROUND = {"data": {"n_heldout": 400},
              "rl": {"steps": 6, "eval_every": 2, "checkpoint_every": 2, "eval_samples": 8, "eval_mode": "background"}}


def _env() -> dict[str, str]:
    return {**os.environ, "DO_NOT_TRACK": "true", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "background.yaml"
    path.write_text(yaml.safe_dump(BACKGROUND))
    return path


def _assert_one_line_stop(rc: int, stderr: str, want_rc: int, starts: str) -> None:
    assert "terminate called" not in stderr and rc == want_rc, (rc, stderr[-3000:])
    assert "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1].startswith(starts), stderr[-3000:]


def test_a_full_disk_with_an_evaluation_in_flight_exits_1_in_one_line(tmp_path):
    limit = 200 * 1024  # bytes: more than a micro run's metrics and model files, less than a checkpoint's history

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    out = tmp_path / "out"
    done = subprocess.run(train_command(_config(tmp_path), out), preexec_fn=cap, capture_output=True, text=True,
                          timeout=600, cwd=REPO, env=_env())
    _assert_one_line_stop(done.returncode, done.stderr, 1, "a3po train: no room to write checkpoint file ")
    assert "ulimit -f: 204,800 bytes" in done.stderr


def test_ctrl_c_with_an_evaluation_in_flight_exits_130_in_one_line(tmp_path):
    out = tmp_path / "out"
    # Ctrl-C's own disposition: a test session started in the background of a shell ignores SIGINT,
    # and a Python started ignoring it never installs its handler.
    proc = subprocess.Popen(train_command(_config(tmp_path), out), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO, env=_env(), preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    metrics = out / "loglinear-seed0" / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        if metrics.exists() and metrics.read_text().count('"step"') >= 3:  # steps 0..2 out: step 2's evaluation runs
            proc.send_signal(signal.SIGINT)
            break
        time.sleep(0.05)
    _, stderr = proc.communicate(timeout=600)
    _assert_one_line_stop(proc.returncode, stderr, 130, "a3po train: interrupted; the same command resumes")
    steps = [line for line in metrics.read_text().splitlines() if line.strip()]
    assert len(steps) < 7, "the run ended before the interrupt: the test stopped nothing"
