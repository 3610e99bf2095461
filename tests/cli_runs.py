"""Helpers for tests that run ``a3po train`` in subprocesses (torchrun launches included) and
compare what the runs wrote: the command's final JSON line, per-step metrics, final weights."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

# Wall-clock metrics: the only ones two runs of the same computation may disagree on.
TIMING = ("perf/", "time/", "prox/time_s")


def run_to_json(command: list[str], cwd: Path, env: dict[str, str], timeout: float = 900) -> dict:
    """Run ``command`` to the end (it must succeed); its final JSON line."""
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


def step_metrics(run: dict) -> dict[int, dict[str, float]]:
    """Per step, the last record of the run's metrics.jsonl, timing aside."""
    out: dict[int, dict[str, float]] = {}
    for line in (Path(run["run_dir"]) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = {k: v for k, v in rec.items() if not k.startswith(TIMING)}
    return out


def final_weights(run: dict) -> dict:
    from safetensors.torch import load_file

    return load_file(Path(run["run_dir"]) / "final" / "model.safetensors")


def kill_rank_after_first_checkpoint(proc, latest: Path, rank: int = 1, timeout: float = 600) -> None:
    """Wait until the launched run ``proc`` (a torchrun, started in its own session) writes its
    first checkpoint (``latest``), then SIGKILL the process of global rank ``rank``."""
    import signal
    import time

    import psutil

    deadline = time.monotonic() + timeout
    while not latest.exists():
        assert proc.poll() is None, f"the run ended before its first checkpoint:\n{proc.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, f"no checkpoint after {timeout:.0f} s"
        time.sleep(0.02)
    found = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.environ().get("RANK") == str(rank)]
    assert len(found) == 1, found
    found[0].send_signal(signal.SIGKILL)
