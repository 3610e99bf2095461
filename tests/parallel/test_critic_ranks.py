"""The PPO critic under DeepSpeed trainer ranks (``ppo.critic: policy_copy``, ``rl.advantage: gae``;
a3po/training/ppo_parts.py, ``a3po.parallel.updaters.make_critic_updater``).

Every run here is the real command, ``python -m a3po.training.command``, as in tests/parallel/test_deepspeed_ranks.py:
the micro model with a 150-step warm start (rewards vary), ``lr = critic_lr = 1e-3`` and no
warm-up, so every update moves the policy and the critic; ``ppo.critic_epochs: 2`` so the
critic's passes after the policy's minibatches run sharded too, and ``ppo.value_clip: 0.05`` so the
value clip binds within the step's first pass (whose figures are logged). The warm start is trained once
and shared (its cache key does not depend on the trainer's topology).

Why 2 ZeRO ranks equal one process, within tests/parallel/test_deepspeed_ranks.py's tolerances: the critic
gets its own engine and AdamW; every rank holds the whole batch and computes the values for GAE
on it with the same weights (the same values on every rank, so the same advantages and
returns); each rank trains on its shard of every minibatch with the value loss's token
denominator all-reduced and scaled by the world size, so the reduced gradient is the single
process's up to float summation order (that module's docstring derives the bounds: ~1 ulp per
step, the figures within ``1e-4 * |x| + 1e-6``, weights 1e-5 absolute). The value loss, its clip
fraction and gradient norm, the explained variance and the returns are among the compared
figures; the discrete ones (rewards, lengths, held-out accuracy) are equal.
Measured (ZeRO-2): ``ppo/value_loss`` 2.3e-10 abs apart, ``ppo/value_grad_norm`` 3.7e-8, worst
figure ``ppo/explained_variance`` 1.2e-7 abs; critic weights 3.5e-7 max abs apart at the end,
having moved 6.5e-3 over the last 2 steps; ZeRO-3 (every parameter partitioned) the same orders.
Checked to fail for the right reason: with each rank normalising the value loss by its own token
count ``ppo/value_grad_norm`` doubles (0.614 vs 0.305 at step 1) and the explained variance parts
at step 2 (-0.0238 vs -0.0244); without the world-size factor the gradient norm halves (0.153).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from a3po.config.preflight import deepspeed_available
from tests.support.cli_runs import assert_same_trajectory, deepspeed_json, killed_at_step, run_and_kill, run_to_json
from tests.support.cli_runs import final_weights as _final_weights
from tests.support.cli_runs import share_warmstart as _share_warmstart
from tests.support.cli_runs import step_metrics as _metrics
from tests.support.cli_runs import train_command as _command

REPO_ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
RTOL, ATOL, WEIGHTS_ATOL = 1e-4, 1e-6, 1e-5  # tests/parallel/test_deepspeed_ranks.py's, derived there

pytestmark = pytest.mark.skipif(not deepspeed_available(), reason="DeepSpeed is not installed (pip install -e '.[distributed]')")


def _env() -> dict[str, str]:
    return {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1", "DO_NOT_TRACK": "true"}


def _config(tmp: Path, zero_stage: int | None, workers: int = 0) -> Path:
    ds = f"deepspeed_config: {deepspeed_json(REPO_ROOT, tmp, zero_stage)}, " if zero_stage else ""
    path = tmp / f"config-zero{zero_stage}-w{workers}.yaml"
    path.write_text(
        "warm_start: {steps: 150, batch_size: 32}\n"
        f"rl: {{steps: {STEPS}, batch_prompts: 8, group_size: 4, minibatches: 2, max_new_tokens: 12, lr: 1.0e-3,\n"
        "     lr_warmup_steps: 0, eval_every: 2, checkpoint_every: 2, advantage: gae}\n"
        "ppo: {critic: policy_copy, critic_lr: 1.0e-3, critic_epochs: 2, value_clip: 0.05, kl_coef: 0.05, kl_estimator: k3}\n"
        f"distributed: {{{ds}rollout_workers: {workers}}}\n"
    )
    return path


def _train(tmp: Path, name: str, zero_stage: int | None, nproc: int | None = None, workers: int = 0) -> dict:
    out = tmp / name
    if name != "single":
        _share_warmstart(tmp / "single", out)
    return run_to_json(_command(_config(tmp, zero_stage, workers), out, nproc), REPO_ROOT, _env())


def _checkpoint(run: dict) -> dict:
    from a3po.storage.checkpoint import latest_checkpoint, load_checkpoint

    return load_checkpoint(latest_checkpoint(Path(run["run_dir"]) / "checkpoints"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The single-process run, then the uninterrupted 2-rank runs on demand (:func:`_run`)."""
    tmp = tmp_path_factory.mktemp("critic")
    return {"single": _train(tmp, "single", None), "tmp": tmp}


def _run(runs: dict, zero_stage: int, workers: int = 0) -> dict:
    key = f"zero{zero_stage}-w{workers}"
    if key not in runs:
        runs[key] = _train(runs["tmp"], key, zero_stage, nproc=2 + workers, workers=workers)
    return runs[key]


def _assert_equals_single(single: dict, run: dict) -> None:
    assert_same_trajectory(single, run, STEPS, RTOL, ATOL)
    m = _metrics(run)
    assert all(m[s]["ppo/value_loss"] > 1e-4 and m[s]["ppo/value_grad_norm"] > 1e-4 for s in m), m  # the critic learnt something
    assert any(m[s]["ppo/value_clip_frac"] > 0 for s in m), m  # and its clip bound somewhere
    ws, wr = _final_weights(single), _final_weights(run)
    assert ws.keys() == wr.keys() and max(float((ws[k] - wr[k]).abs().max()) for k in ws) <= WEIGHTS_ATOL
    cs, cr = _checkpoint(single), _checkpoint(run)
    assert cs["step"] == cr["step"] == STEPS
    critic_s, critic_r = cs["critic"], cr["critic"]
    assert critic_s.keys() == critic_r.keys() and any(k.startswith("score.") for k in critic_s)
    moved = max(float((critic_s[k] - _checkpoint_at(single, 2)["critic"][k]).abs().max()) for k in critic_s)
    assert moved > 100 * WEIGHTS_ATOL, moved  # the critic's weights moved far more than the tolerance between the runs
    assert max(float((critic_s[k] - critic_r[k]).abs().max()) for k in critic_s) <= WEIGHTS_ATOL
    # Every rank's critic optimizer partition is in the checkpoint.
    opt = cr["critic_optimizer"]
    assert (opt["world_size"], len(opt["ranks"])) == (2, 2)


def _checkpoint_at(run: dict, step: int) -> dict:
    from a3po.storage.checkpoint import load_checkpoint

    return load_checkpoint(Path(run["run_dir"]) / "checkpoints" / f"step_{step:06d}")


@pytest.mark.slow
def test_two_zero2_ranks_with_the_critic_match_the_single_process(runs):
    run = _run(runs, 2)
    assert (run["world_size"], run["zero_stage"]) == (2, 2)
    _assert_equals_single(runs["single"], run)


@pytest.mark.slow
def test_two_zero3_ranks_with_the_critic_match_the_single_process(runs):
    """Every parameter partitioned (policy and critic): the values forward is a collective on every
    rank, the checkpoint gathers the critic's weights (without the gather they are empty tensors)."""
    run = _run(runs, 3)
    assert (run["world_size"], run["zero_stage"]) == (2, 3)
    _assert_equals_single(runs["single"], run)


@pytest.mark.slow
def test_two_zero2_ranks_and_a_rollout_worker_with_the_critic_match_the_single_process(runs):
    """The production topology: the critic lives in the trainer ranks (values are computed there),
    the worker generates; the worker's batches are the single process's (tests/placement/test_rollout_workers.py)."""
    run = _run(runs, 2, workers=1)
    assert (run["world_size"], run["zero_stage"], run["rollout_workers"]) == (2, 2, 1)
    _assert_equals_single(runs["single"], run)


@pytest.mark.slow
def test_killed_zero2_rank_with_the_critic_resumes_exactly(runs):
    """SIGKILL of rank 1 once a checkpoint exists; the rerun restores both ranks' critic
    partitions and ends equal to the uninterrupted run, bit for bit (critic included)."""
    tmp = runs["tmp"]
    out = tmp / "zero2-killed"
    _share_warmstart(tmp / "single", out)
    config = _config(tmp, 2)
    latest = out / "loglinear-seed0" / "checkpoints" / "latest"
    proc, _, _ = run_and_kill(_command(config, out, 2), REPO_ROOT, _env(), latest)
    killed_at = killed_at_step(proc, latest, STEPS)
    resumed = run_to_json(_command(config, out, 2), REPO_ROOT, _env())
    assert resumed["resumed_from"] is not None and resumed["resumed_from"] <= killed_at < STEPS
    uninterrupted = _run(runs, 2)
    assert _metrics(resumed) == _metrics(uninterrupted)
    wr, wu = _final_weights(resumed), _final_weights(uninterrupted)
    assert all(torch.equal(wr[k], wu[k]) for k in wu)
    cr, cu = _checkpoint(resumed), _checkpoint(uninterrupted)
    assert all(torch.equal(cr["critic"][k], cu["critic"][k]) for k in cu["critic"])
    for a, b in zip(cr["critic_optimizer"]["ranks"], cu["critic_optimizer"]["ranks"], strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a["master"], b["master"], strict=True))
