"""Data-parallel trainer ranks under DeepSpeed (``a3po/parallel/ranks.py``), on CPU with gloo.

Every run here is the real command, ``python -m a3po.training.command``, one plain process or two
ranks under torchrun with ``DS_ACCELERATOR=cpu``, on the micro model with a longer warm start
(150 steps) so rewards vary and the loss and its gradient are not identically 0, and
``lr = 1e-3`` with no warm-up so every update moves the weights.

Parity, 1 process vs 2 ranks on the same global batch and seed. Both ranks hold the whole
batch (same producer, same seed), each trains on half of every minibatch, the loss denominator
is the minibatch's all-reduced token count and DeepSpeed's gradient average is undone by the
world size, so the reduced gradient is the single-process gradient up to float summation
order. Where the runs can differ, and by how much:

* the gradient: a sum over 2 half-batches instead of one pass (different summation order),
  ~1 ulp of float32 relative to the gradient (~1e-7);
* the reported gradient norm: DeepSpeed accumulates it in float64, torch's clip in float32:
  measured 1.8e-7 absolute on norms of ~1-2;
* clipping: DeepSpeed multiplies by ``1 / ((norm + 1e-6) / clip)``, torch by
  ``clip / (norm + 1e-6)``: ~1 ulp.

Over 8 steps x 2 minibatches these stay at float32 noise and no sampled token flips, so the
discrete figures (rewards, lengths, staleness, held-out accuracy) must be equal. Measured (ZeRO-2,
this config): weights 4.1e-7 max abs apart at the end; worst metric 2.0e-6 relative
(``policy/iw_p99``, a max-like figure that exponentiates log-prob noise), loss 4.1e-8 abs,
``policy/approx_kl`` 9.7e-8 abs; ZeRO-3 with every parameter partitioned: weights 3.5e-7, loss
8.6e-8 abs, worst metric ``stability/trust_ratio_max`` 3.3e-5 abs on 14.07 (2.4e-6 relative).
The tolerance is ``1e-4 * |x| + 1e-6`` (50x the worst relative, 10x the worst absolute figure);
weights 1e-5 abs, 25x. Checked to fail for the right reason:
without the world-size factor ``policy/grad_norm`` halves (0.96 vs 0.48 at step 2); with each
rank normalising by its own token count the loss is 2.3e-4 off at step 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from a3po.config.preflight import deepspeed_available
from tests.support.cli_runs import assert_same_trajectory, deepspeed_json, killed_at_step, run_and_kill, run_to_json
from tests.support.cli_runs import final_weights as _final_weights
from tests.support.cli_runs import step_metrics as _metrics
from tests.support.cli_runs import train_command as _command

REPO_ROOT = Path(__file__).resolve().parents[2]
needs_deepspeed = pytest.mark.skipif(not deepspeed_available(), reason="DeepSpeed is not installed (pip install -e '.[distributed]')")
STEPS = 8
# Float summation order across ranks (module docstring).
RTOL, ATOL = 1e-4, 1e-6
WEIGHTS_ATOL = 1e-5


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        "DO_NOT_TRACK": "true",
    }


def _deepspeed_json(tmp: Path, zero_stage: int) -> Path:
    return deepspeed_json(REPO_ROOT, tmp, zero_stage)


def _config(tmp: Path, zero_stage: int | None, steps: int = STEPS) -> Path:
    ds = f"distributed: {{deepspeed_config: {_deepspeed_json(tmp, zero_stage)}}}\n" if zero_stage else ""
    path = tmp / f"config-zero{zero_stage}-{steps}.yaml"
    path.write_text(
        "warm_start: {steps: 150, batch_size: 32}\n"
        f"rl: {{steps: {steps}, batch_prompts: 8, group_size: 4, minibatches: 2, max_new_tokens: 12, lr: 1.0e-3,\n"
        "     lr_warmup_steps: 0, eval_every: 4, checkpoint_every: 2}\n" + ds
    )
    return path


def _train(config: Path, out: Path, nproc: int | None = None, variant: str = "loglinear") -> dict:
    """Run the command to the end; returns its final JSON line."""
    return run_to_json(_command(config, out, nproc, variant), REPO_ROOT, _env())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The single-process run and the uninterrupted 2-rank ZeRO-2 and ZeRO-3 runs, shared by the tests."""
    if not deepspeed_available():
        pytest.skip("DeepSpeed is not installed (pip install -e '.[distributed]')")
    tmp = tmp_path_factory.mktemp("dist")
    return {
        "single": _train(_config(tmp, None), tmp / "single"),
        "zero2": _train(_config(tmp, 2), tmp / "zero2", nproc=2),
        "zero3": _train(_config(tmp, 3), tmp / "zero3", nproc=2),
        "tmp": tmp,
    }


def _assert_same_trajectory(a: dict, b: dict) -> None:
    assert_same_trajectory(a, b, STEPS, RTOL, ATOL)


@needs_deepspeed
@pytest.mark.slow
def test_two_rank_zero2_matches_single_process(runs):
    single, zero2 = runs["single"], runs["zero2"]
    assert (single["world_size"], single["zero_stage"]) == (1, None)
    assert (zero2["world_size"], zero2["zero_stage"]) == (2, 2)
    _assert_same_trajectory(single, zero2)
    ws, w2 = _final_weights(single), _final_weights(zero2)
    assert ws.keys() == w2.keys()
    assert max(float((ws[k] - w2[k]).abs().max()) for k in ws) <= WEIGHTS_ATOL


@needs_deepspeed
@pytest.mark.slow
def test_two_rank_zero3_matches_single_process(runs):
    """ZeRO-3, every parameter partitioned: the rollout copy, the held-out evaluation and the
    export read gathered weights (without the gather they are empty tensors and the run fails)."""
    single, zero3 = runs["single"], runs["zero3"]
    assert (zero3["world_size"], zero3["zero_stage"]) == (2, 3)
    _assert_same_trajectory(single, zero3)
    ws, w3 = _final_weights(single), _final_weights(zero3)
    assert ws.keys() == w3.keys()
    assert max(float((ws[k] - w3[k]).abs().max()) for k in ws) <= WEIGHTS_ATOL


@needs_deepspeed
@pytest.mark.slow
def test_two_rank_zero1_matches_single_process_with_recomputed_proximal_logprobs(runs):
    """ZeRO-1, and the variant whose proximal log-probs take an extra forward of the whole batch."""
    tmp = runs["tmp"]
    single = _train(_config(tmp, None), tmp / "single-recompute", variant="recompute")
    zero1 = _train(_config(tmp, 1), tmp / "zero1-recompute", nproc=2, variant="recompute")
    assert (zero1["world_size"], zero1["zero_stage"], zero1["variant"]) == (2, 1, "recompute")
    _assert_same_trajectory(single, zero1)


@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_two_rank_run_killed_after_a_checkpoint_resumes_exactly(runs, zero_stage):
    """SIGKILL of rank 1 once a checkpoint exists; the rerun ends equal to the uninterrupted run."""
    import torch

    from a3po.storage.checkpoint import latest_checkpoint, load_checkpoint

    tmp, out = runs["tmp"], runs["tmp"] / f"killed-zero{zero_stage}"
    config = _config(tmp, zero_stage)
    latest = out / "loglinear-seed0" / "checkpoints" / "latest"
    proc, _, _ = run_and_kill(_command(config, out, 2), REPO_ROOT, _env(), latest)
    killed_at = killed_at_step(proc, latest, STEPS)
    # The checkpoint holds no DeepSpeed pickle: it loads through the safe loader (hashes checked,
    # tensors with weights_only=True), and carries both ranks' optimizer partitions.
    state = load_checkpoint(latest_checkpoint(latest.parent))
    assert (state["optimizer"]["world_size"], len(state["optimizer"]["ranks"])) == (2, 2)
    if zero_stage == 3:  # each rank's fp32 master is its half of the parameters the single-process AdamW steps
        single = load_checkpoint(latest_checkpoint(Path(runs["single"]["run_dir"]) / "checkpoints"))
        n_params = sum(st["exp_avg"].numel() for st in single["optimizer"]["state"].values())
        n_master = [sum(t.numel() for t in r["master"]) for r in state["optimizer"]["ranks"]]
        assert all(n_params // 2 <= n < n_params for n in n_master), (n_params, n_master)
        assert all(len(r["adamw"]["state"]) == len(r["master"]) for r in state["optimizer"]["ranks"])

    resumed = _train(config, out, nproc=2)
    assert resumed["resumed_from"] is not None and resumed["resumed_from"] <= killed_at < STEPS
    uninterrupted = runs[f"zero{zero_stage}"]
    assert _metrics(resumed) == _metrics(uninterrupted)
    wr, wu = _final_weights(resumed), _final_weights(uninterrupted)
    assert all(torch.equal(wr[k], wu[k]) for k in wu)


# --- fast: config-time errors -------------------------------------------------------------------


def test_deepspeed_config_without_deepspeed_fails_at_config_time_with_the_install_hint(tmp_path):
    """DeepSpeed hidden (``sys.modules['deepspeed'] = None`` makes every import of it fail, as
    when it is not installed): the command fails before any warm start with the install hint."""
    config = _config(tmp_path, 2)
    code = "import sys; sys.modules['deepspeed'] = None; from a3po.training.command import main; sys.exit(main(sys.argv[1:]))"
    argv = ["--preset", "micro", "--config", str(config), "--output-dir", str(tmp_path / "out"), "--no-progress"]
    proc = subprocess.run([sys.executable, "-c", code, *argv], cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "distributed.deepspeed_config is set but DeepSpeed is not installed: pip install -e '.[distributed]'" in proc.stderr
    assert not (tmp_path / "out").exists()  # failed when the config was built, before any work


def test_without_a_deepspeed_config_the_config_builds_without_deepspeed(monkeypatch):
    from a3po.config import config_from_dict

    monkeypatch.setitem(sys.modules, "deepspeed", None)
    cfg = config_from_dict({"distributed": {"deepspeed_config": None}})
    assert cfg.distributed.deepspeed_config is None


@needs_deepspeed
@pytest.mark.parametrize(
    "content, message",
    [
        ({"zero_optimization": {"stage": 0}}, "zero_optimization.stage must be one of (1, 2, 3), got 0"),
        ({"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}}, "'optimizer' is set by the trainer"),
        ({"zero_optimization": {"stage": 2}, "train_batch_size": 32}, "'train_batch_size' is derived from rl.batch_prompts"),
        ({"zero_optimization": {"stage": 2}, "gradient_clipping": 0.5}, "gradient_clipping 0.5 disagrees with rl.grad_clip 1.0"),
    ],
)
def test_bad_deepspeed_json_fails_at_config_time_naming_the_file(tmp_path, content, message):
    from a3po.config import config_from_dict, preflight

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError) as err:
        preflight(config_from_dict({"distributed": {"deepspeed_config": str(path)}}))
    assert str(path) in str(err.value) and message in str(err.value)


@needs_deepspeed
def test_shipped_deepspeed_configs_are_accepted():
    from a3po.config import config_from_dict, preflight
    from a3po.config.preflight import read_deepspeed_json, zero_stage

    for stage in (1, 2, 3):
        path = REPO_ROOT / f"infra/deepspeed_zero{stage}.json"
        preflight(config_from_dict({"distributed": {"deepspeed_config": str(path)}}))
        assert zero_stage(read_deepspeed_json(path, 1.0)) == stage


def test_ranks_from_env_reads_the_launcher_variables():
    from a3po.parallel.ranks import ranks_from_env

    assert ranks_from_env({}).world_size == 1 and ranks_from_env({}).is_main
    r = ranks_from_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    assert (r.rank, r.world_size, r.local_rank, r.is_main) == (1, 2, 1, False)
    with pytest.raises(ValueError, match=r"RANK=2 is not in \[0, WORLD_SIZE=2\)"):
        ranks_from_env({"RANK": "2", "WORLD_SIZE": "2"})


def test_several_ranks_without_a_deepspeed_config_are_refused(monkeypatch):
    from a3po.parallel.ranks import init_ranks

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="launched as 2 ranks .* distributed.deepspeed_config is null"):
        init_ranks(None)


def test_what_ranks_share_travels_as_json_and_a_pickle_never_runs(tmp_path):
    import pickle

    from a3po.parallel.ranks import broadcast_json

    sent: list = []
    assert broadcast_json({"dir": "runs/x", "acc": [0.25]}, True, lambda t: sent.append(t.clone())) == {"dir": "runs/x", "acc": [0.25]}
    wire = iter(sent)
    assert broadcast_json(None, False, lambda t: t.copy_(next(wire))) == {"dir": "runs/x", "acc": [0.25]}
    with pytest.raises(TypeError):  # not a JSON value: refused where it is sent
        broadcast_json(Path("runs/x"), True, lambda t: None)

    class Payload:
        def __reduce__(self):
            return (open, (str(tmp_path / "pwned"), "w"))

    evil = pickle.dumps(Payload())
    frames = iter([torch.tensor([len(evil)]), torch.frombuffer(bytearray(evil), dtype=torch.uint8)])
    with pytest.raises(ValueError):  # a pickle on the wire is not JSON: refused, never unpickled
        broadcast_json(None, False, lambda t: t.copy_(next(frames)))
    assert not (tmp_path / "pwned").exists()
