"""Rollout workers in processes of their own (``distributed.rollout_workers``, a3po/placement/rollout_workers.py).

Every run here is the real command, ``python -m a3po.cli train``: one plain process (today's
rollout thread), or ``torchrun --nproc_per_node 2`` with ``rollout_workers: 1`` (rank 0 trains,
rank 1 generates and scores), on the micro preset with a longer warm start (150 steps) so rewards
vary and the loss is not identically 0, and ``lr = 1e-3`` with no warm-up so every update moves
the weights.

Why the 2-process run must equal the single-process one *exactly* (not within a tolerance) under
the deterministic schedule: the worker runs the same producer code on the same weights (the
state dict travels as raw bytes), with the same seed per batch and one intra-op thread, so it
samples the same tokens with the same log-probs; the batch travels back as raw tensors and JSON
text; the trainer's step is the single-process step. Nothing is summed in another order.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from a3po.placement.rollout_workers import pack_state, state_layout, unpack_state
from tests.support.cli_runs import final_weights as _final_weights
from tests.support.cli_runs import kill_rank_after_first_checkpoint, run_to_json
from tests.support.cli_runs import step_metrics as _metrics

REPO_ROOT = Path(__file__).resolve().parents[1]
STEPS = 8


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1", "DO_NOT_TRACK": "true"}


def _config(tmp: Path, workers: int, schedule: str = "deterministic", max_staleness: int = 2) -> Path:
    path = tmp / f"config-w{workers}-{schedule}-s{max_staleness}.yaml"
    path.write_text(
        "warm_start: {steps: 150, batch_size: 32}\n"
        f"rl: {{steps: {STEPS}, batch_prompts: 8, group_size: 4, minibatches: 2, max_new_tokens: 12, lr: 1.0e-3,\n"
        f"     lr_warmup_steps: 0, eval_every: 4, checkpoint_every: 2, schedule: {schedule}, max_staleness: {max_staleness}}}\n"
        f"distributed: {{rollout_workers: {workers}}}\n"
    )
    return path


def _command(config: Path, out: Path, nproc: int | None) -> list[str]:
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] if nproc else []
    return [sys.executable, *launcher, "-m", "a3po.cli", "train", "--preset", "micro", "--config", str(config),
            "--output-dir", str(out), "--no-progress", "--variant", "loglinear"]


def _share_warmstart(src: Path, out: Path) -> None:
    """Point ``out``'s warm-start cache at ``src``'s: the same weights (same key), trained once."""
    (out / "cache").mkdir(parents=True, exist_ok=True)
    for d in (src / "cache").iterdir():
        (out / "cache" / d.name).symlink_to(d.resolve(), target_is_directory=True)


def _train(config: Path, out: Path, nproc: int | None = None) -> dict:
    return run_to_json(_command(config, out, nproc), REPO_ROOT, _env())


def _assert_same_run(a: dict, b: dict) -> None:
    ma, mb = _metrics(a), _metrics(b)
    assert sorted(ma) == list(range(1, STEPS + 1)), sorted(ma)
    losses = [ma[s]["loss/policy"] for s in ma]
    assert sum(abs(x) > 1e-3 for x in losses) >= 3, f"degenerate trajectory, nothing to compare: {losses}"
    assert ma == mb  # exactly: module docstring
    wa, wb = _final_weights(a), _final_weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The single-process deterministic run and the uninterrupted 1 trainer + 1 worker run."""
    tmp = tmp_path_factory.mktemp("disagg")
    single = _train(_config(tmp, 0), tmp / "single")
    _share_warmstart(tmp / "single", tmp / "two")
    two = _train(_config(tmp, 1), tmp / "two", nproc=2)
    return {"single": single, "two": two, "tmp": tmp}


@pytest.mark.slow
def test_trainer_plus_rollout_worker_equals_the_single_process_run(runs):
    single, two = runs["single"], runs["two"]
    assert (single["world_size"], single["rollout_workers"]) == (1, 0)
    assert (two["world_size"], two["rollout_workers"]) == (1, 1)
    _assert_same_run(single, two)
    # The deterministic schedule's staleness, as the single-process tests pin it (s = 2).
    assert [_metrics(two)[s]["staleness/max"] for s in range(1, STEPS + 1)] == [0.0, 1.0] + [2.0] * (STEPS - 2)


@pytest.mark.slow
def test_killed_rollout_worker_fails_the_run_and_the_rerun_resumes_exactly(runs):
    """SIGKILL of the worker (rank 1) once a checkpoint exists: the run fails naming rank 1; the
    same command resumes (the worker restarts at the checkpoint's batch with its versions) and
    ends equal to the uninterrupted run."""

    tmp, out = runs["tmp"], runs["tmp"] / "killed"
    _share_warmstart(tmp / "single", out)
    config = _config(tmp, 1)
    proc = subprocess.Popen(_command(config, out, 2), cwd=REPO_ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    latest = out / "loglinear-seed0" / "checkpoints" / "latest"
    try:
        kill_rank_after_first_checkpoint(proc, latest)
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0, "the killed run reported success"
    killed_at = json.loads(latest.read_text())["step"]
    assert killed_at < STEPS, f"the run finished (step {killed_at}) before the worker was killed"
    # torchrun's summary names the dead rank and its signal (the launcher stops rank 0).
    assert "rank      : 1" in output and "Signal 9 (SIGKILL)" in output, output[-3000:]

    resumed = _train(config, out, nproc=2)
    assert resumed["resumed_from"] is not None and resumed["resumed_from"] <= killed_at < STEPS
    _assert_same_run(runs["two"], resumed)


@pytest.mark.slow
def test_staleness_bound_holds_across_processes_in_the_free_running_schedule(runs):
    """Threaded schedule, s = 1: the worker loads the newest weights it has and runs ahead as far
    as admission lets it; no trained token may be more than 1 version old."""
    tmp = runs["tmp"]
    out = tmp / "threaded"
    _share_warmstart(tmp / "single", out)
    run = _train(_config(tmp, 1, schedule="threaded", max_staleness=1), out, nproc=2)
    st = [m["staleness/max"] for m in _metrics(run).values()]
    assert len(st) == STEPS and all(x <= 1.0 for x in st), st
    assert max(st) == 1.0, f"the worker never ran ahead, the bound was not exercised: {st}"


# --- fast -------------------------------------------------------------------------------------


def test_weights_travel_as_exact_bytes_whatever_the_dtype():
    g = torch.Generator().manual_seed(0)
    state = {
        "w": torch.randn(3, 5, generator=g),
        "b16": torch.randn(7, generator=g).to(torch.bfloat16),  # odd byte count: later tensors unaligned in the buffer
        "d": torch.randn(2, 2, generator=g, dtype=torch.float64),
        "i": torch.tensor([1, -2, 3], dtype=torch.int64),
        "scalar": torch.tensor(0.1),
        "mask": torch.tensor([True, False, True]),
    }
    layout = state_layout(state)
    assert layout[1] == ["b16", "bfloat16", [7]]
    buf = pack_state(state)
    assert buf.dtype == torch.uint8 and buf.numel() == 15 * 4 + 7 * 2 + 4 * 8 + 3 * 8 + 4 + 3
    back = unpack_state(buf, layout, torch.device("cpu"))
    assert list(back) == list(state)
    for k in state:
        assert back[k].dtype == state[k].dtype and back[k].shape == state[k].shape
        assert torch.equal(back[k], state[k]), k


def test_rollout_worker_config_errors_name_the_field(tmp_path):
    from a3po.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match="distributed.rollout_workers must be >= 0, got -1"):
        config_from_dict({"distributed": {"rollout_workers": -1}})
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    with pytest.raises((ConfigError, ValueError), match="rollout_workers .*deepspeed_config"):
        config_from_dict({"distributed": {"rollout_workers": 1, "deepspeed_config": str(ds)}})


def test_ranks_split_the_launch_into_trainer_ranks_then_workers():
    from a3po.parallel.ranks import ranks_from_env

    trainer = ranks_from_env({"RANK": "0", "WORLD_SIZE": "3"}, rollout_workers=2)
    worker = ranks_from_env({"RANK": "2", "WORLD_SIZE": "3"}, rollout_workers=2)
    assert (trainer.world_size, trainer.launch_size, trainer.is_main, trainer.is_rollout_worker) == (1, 3, True, False)
    assert (worker.is_main, worker.is_rollout_worker) == (False, True)
    with pytest.raises(ValueError, match=r"rollout_workers is 1 but the launch has 1 process\(es\).*--nproc_per_node 2"):
        ranks_from_env({}, rollout_workers=1)


def test_one_process_with_a_rollout_worker_configured_fails_before_any_work(tmp_path):
    config = _config(tmp_path, 1)
    proc = subprocess.run(_command(config, tmp_path / "out", None), cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "a3po train: error: distributed.rollout_workers is 1 but the launch has 1 process(es)" in proc.stderr
    assert not (tmp_path / "out" / "cache").exists()


def test_the_number_of_rollout_workers_is_not_a_config_change_at_resume():
    """Where rollouts were generated does not change what a run computes (deterministic schedule),
    so a checkpoint written with rollout workers passes the resume check of a one-process run
    (the resume itself needs a torchrun launch: beyond the fast tier)."""
    from a3po.config import config_differences, config_to_dict, preset, with_overrides

    base = preset("micro")
    assert config_differences(config_to_dict(with_overrides(base, distributed={"rollout_workers": 1})), config_to_dict(base)) == []
    # ... while a change that does alter the run is still reported
    changed = with_overrides(base, distributed={"rollout_workers": 1}, rl={"max_staleness": base.rl.max_staleness + 1})
    assert config_differences(config_to_dict(changed), config_to_dict(base)) == ["rl.max_staleness"]
