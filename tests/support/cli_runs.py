"""Helpers for tests that run ``a3po train`` in subprocesses (torchrun launches included, from
the command line or through a flow) and compare what the runs wrote: the command's final JSON
line, per-step metrics, final weights, the lines a flow run logged, the processes left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

# Wall-clock metrics: the only ones two runs of the same computation may disagree on.
TIMING = ("perf/", "time/", "prox/time_s")


def train_command(config: Path, out: Path, nproc: int | None = None, variant: str = "loglinear") -> list[str]:
    """``a3po train`` on the micro preset with ``config`` laid over it; under torchrun with
    ``nproc`` processes when given."""
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] if nproc else []
    return [sys.executable, *launcher, "-m", "a3po.training.command", "--preset", "micro", "--config", str(config),
            "--output-dir", str(out), "--no-progress", "--variant", variant]


def share_warmstart(src: Path, out: Path) -> None:
    """Point ``out``'s warm-start cache at ``src``'s: the same weights (same key), trained once."""
    (out / "cache").mkdir(parents=True, exist_ok=True)
    for d in (src / "cache").iterdir():
        (out / "cache" / d.name).symlink_to(d.resolve(), target_is_directory=True)


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


def without_timing(history_path: str | Path) -> list[dict]:
    """The rows of a run's history JSONL (a flow's ``history_path``), timing aside."""
    rows = [json.loads(line) for line in Path(history_path).read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def final_weights(run: dict) -> dict:
    from safetensors.torch import load_file

    return load_file(Path(run["run_dir"]) / "final" / "model.safetensors")


def run_and_kill(command: list[str], cwd: Path, env: dict[str, str], latest: Path, rank: int = 1,
                 timeout: float = 300) -> tuple[subprocess.Popen, str, list]:
    """Launch ``command`` in its own session, SIGKILL global rank ``rank`` once the first
    checkpoint (``latest``) exists, wait for the launch to stop (whatever is left of it is killed
    on the way out); ``(process, its output, the launch's processes as they were after the kill)``."""
    import psutil

    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        kill_rank_after_first_checkpoint(proc, latest, rank=rank)
        try:
            launch = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:  # the launcher already stopped everything
            launch = []
        output, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc, output, launch


def killed_at_step(proc: subprocess.Popen, latest: Path, steps: int) -> int:
    """The step of the checkpoint a killed launch left; it must have failed before its last step."""
    assert proc.returncode != 0, "the killed run reported success"
    killed_at = json.loads(latest.read_text())["step"]
    assert killed_at < steps, f"the run finished (step {killed_at}) before the rank was killed"
    return killed_at


def kill_rank_after_first_checkpoint(proc, latest: Path, rank: int = 1, timeout: float = 600) -> None:
    """Wait until the launched run ``proc`` (a torchrun, started in its own session) writes its
    first checkpoint (``latest``), then SIGKILL the process of global rank ``rank``."""
    import time

    import psutil

    deadline = time.monotonic() + timeout
    while not latest.exists():
        assert proc.poll() is None, f"the run ended before its first checkpoint:\n{proc.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, f"no checkpoint after {timeout:.0f} s"
        time.sleep(0.02)
    ranked = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.environ().get("RANK") == str(rank)]
    # The rank's own process: those it started inherit its environment (e.g. vLLM's engine core).
    found = [p for p in ranked if p.ppid() not in {q.pid for q in ranked}]
    assert len(found) == 1, ranked
    found[0].send_signal(signal.SIGKILL)


def descendants() -> set[int]:
    """Process ids of every process this one started, directly or not (to show none is left)."""
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def flow_logs(flow_run_id) -> list[str]:
    """Every log message of a flow run, read back from the Prefect API after the log workers drained."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=30)
    messages: list[str] = []
    with get_client(sync_client=True) as client:
        while True:  # the API serves at most 200 logs a call
            page = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200, offset=len(messages))
            messages += [log.message for log in page]
            if len(page) < 200:
                return messages


def assert_equal_runs(a: dict, b: dict, steps: int, ignore: tuple[str, ...] = ()) -> None:
    """Two runs equal bit for bit: every per-step metric (timing aside, and those starting with
    one of ``ignore``: e.g. the OPPO scorers' busy seconds, wall time too) and the final weights.
    Fails on a degenerate run (a loss of 0 at nearly every step compares nothing)."""
    import torch

    ma, mb = ({s: {k: v for k, v in m.items() if not k.startswith(ignore)} for s, m in step_metrics(r).items()} for r in (a, b))
    assert sorted(ma) == list(range(1, steps + 1)), sorted(ma)
    losses = [ma[s]["loss/policy"] for s in ma]
    assert sum(abs(x) > 1e-3 for x in losses) >= 3, f"degenerate trajectory, nothing to compare: {losses}"
    assert ma == mb
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def assert_same_trajectory(a: dict, b: dict, steps: int, rtol: float, atol: float) -> None:
    """Two runs' per-step metrics agree: the discrete figures (rewards, evaluations, lengths,
    staleness: the same tokens were sampled) exactly, the others within ``rtol * |x| + atol``
    (float summation order across data-parallel ranks). Fails on a degenerate run (a loss of 0
    at nearly every step compares nothing)."""
    ma, mb = step_metrics(a), step_metrics(b)
    assert sorted(ma) == list(range(1, steps + 1)), sorted(ma)
    assert sorted(mb) == sorted(ma)
    losses = [ma[s]["loss/policy"] for s in range(1, steps + 1)]
    assert sum(abs(x) > 1e-3 for x in losses) >= 3, f"degenerate trajectory, nothing to compare: {losses}"
    for step in ma:
        assert ma[step].keys() == mb[step].keys(), step
        for key, va in ma[step].items():
            vb = mb[step][key]
            if key.startswith(("reward/", "eval/", "response/", "staleness/")) or key in ("step", "version"):
                assert va == vb, (step, key, va, vb)
            else:
                assert abs(va - vb) <= rtol * abs(va) + atol, (step, key, va, vb)


def deepspeed_json(repo_root: Path, tmp: Path, zero_stage: int) -> Path:
    """The shipped DeepSpeed JSON; for ZeRO-3 with every parameter partitioned: the micro model's
    are all below the shipped ``stage3_param_persistence_threshold`` (1e5 elements), which would
    keep them whole on every rank and leave nothing to gather."""
    shipped = repo_root / f"infra/deepspeed_zero{zero_stage}.json"
    if zero_stage != 3:
        return shipped
    ds = json.loads(shipped.read_text())
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    path = tmp / "deepspeed_zero3_partition_all.json"
    path.write_text(json.dumps(ds))
    return path
