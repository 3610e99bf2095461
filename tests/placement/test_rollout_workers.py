"""Rollout workers in processes of their own (``distributed.rollout_workers``,
a3po/placement/{remote_rollouts,worker_loop,worker_wire}.py).

Every run here is the real command, ``python -m a3po.training.command``: one plain process (today's
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
import subprocess
from pathlib import Path

import psutil
import pytest
import torch

from a3po.config.preflight import deepspeed_available
from a3po.placement.remote_rollouts import PushFigures, VersionBounds
from a3po.placement.worker_wire import (
    pack_state,
    state_layout,
    tied_names,
    unpack_state,
    version_wire,
)
from tests.support.cli_runs import assert_equal_runs, assert_same_trajectory, deepspeed_json, run_and_kill, run_to_json
from tests.support.cli_runs import final_weights as _final_weights
from tests.support.cli_runs import share_warmstart as _share_warmstart
from tests.support.cli_runs import step_metrics as _metrics
from tests.support.cli_runs import train_command as _command

REPO_ROOT = Path(__file__).resolve().parents[2]
STEPS = 8


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1", "DO_NOT_TRACK": "true", "DS_ACCELERATOR": "cpu"}


def _config(tmp: Path, workers: int, schedule: str = "deterministic", max_staleness: int = 2, deepspeed_json: Path | None = None) -> Path:
    name = f"-{deepspeed_json.stem}" if deepspeed_json else ""
    path = tmp / f"config-w{workers}-{schedule}-s{max_staleness}{name}.yaml"
    ds = f", deepspeed_config: {deepspeed_json}" if deepspeed_json else ""
    path.write_text(
        "warm_start: {steps: 150, batch_size: 32}\n"
        f"rl: {{steps: {STEPS}, batch_prompts: 8, group_size: 4, minibatches: 2, max_new_tokens: 12, lr: 1.0e-3,\n"
        f"     lr_warmup_steps: 0, eval_every: 4, checkpoint_every: 2, schedule: {schedule}, max_staleness: {max_staleness}}}\n"
        f"distributed: {{rollout_workers: {workers}{ds}}}\n"
    )
    return path


def _train(config: Path, out: Path, nproc: int | None = None) -> dict:
    return run_to_json(_command(config, out, nproc), REPO_ROOT, _env())


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
    assert_equal_runs(single, two, STEPS)  # exactly: module docstring
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
    latest = out / "loglinear-seed0" / "checkpoints" / "latest"
    proc, output, _ = run_and_kill(_command(config, out, 2), REPO_ROOT, _env(), latest, rank=1)
    assert proc.returncode != 0, "the killed run reported success"
    killed_at = json.loads(latest.read_text())["step"]
    assert killed_at < STEPS, f"the run finished (step {killed_at}) before the worker was killed"
    # torchrun's summary names the dead rank and its signal (the launcher stops rank 0).
    assert "rank      : 1" in output and "Signal 9 (SIGKILL)" in output, output[-3000:]

    resumed = _train(config, out, nproc=2)
    assert resumed["resumed_from"] is not None and resumed["resumed_from"] <= killed_at < STEPS
    assert_equal_runs(runs["two"], resumed, STEPS)  # exactly: module docstring


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


@pytest.mark.slow
def test_an_adaptive_bound_raised_by_the_trainer_reaches_the_worker(runs):
    """Threaded schedule, ``rl.staleness_control: adaptive`` under a ceiling of 3, thresholds set so
    that every step signals a raise (any wait at all, any weight): the trainer's bound goes 1 -> 2
    -> 3 one step at a time. The worker (faster than the trainer here: the test above sees it run
    a full version ahead at bound 1) admits under the bound that comes with each version, so its
    batches reach staleness 2 once the raised bound has arrived; a worker that kept its starting
    bound would never pass 1."""
    tmp = runs["tmp"]
    out = tmp / "adaptive"
    _share_warmstart(tmp / "single", out)
    config = _config(tmp, 1, schedule="threaded", max_staleness=3)
    config.write_text(config.read_text().replace(
        "max_staleness: 3}", "max_staleness: 3,\n     staleness_control: adaptive, staleness_idle_frac: 1.0e-9, "
        "staleness_max_iw: 1.0e9, staleness_raise_iw: 1.0e9, staleness_patience: 1}"))
    run = _train(config, out, nproc=2)
    metrics = _metrics(run)
    bounds = [metrics[s]["staleness/bound"] for s in sorted(metrics)]
    staleness = [metrics[s]["staleness/max"] for s in sorted(metrics)]
    assert bounds[:3] == [2.0, 3.0, 3.0] and set(bounds[2:]) == {3.0}, bounds  # raised after steps 1 and 2
    assert all(x <= 3.0 for x in staleness), staleness
    assert max(staleness) >= 2.0, f"the worker kept its starting bound 1: staleness {staleness}, bound {bounds}"


def _push_units(run: dict) -> list[float]:
    """The policy MiB each batch brought with it (``perf/weights_push_mb``), zeros aside."""
    rows = [json.loads(line) for line in (Path(run["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    return [r["perf/weights_push_mb"] for r in rows if r.get("perf/weights_push_mb")]


@pytest.mark.slow
def test_a_bf16_engine_takes_its_versions_in_bf16_and_samples_as_in_one_process(runs):
    """``rollout.dtype: bfloat16`` beside the fp32 trainer: the trainer sends each version rounded
    to bf16 (half the bytes of the fp32 run above), and the worker's engine holds the very weights
    it would have loaded from fp32 bytes, so the run still equals the single process bit for bit."""
    tmp = runs["tmp"]
    runs_bf16 = {}
    for name, workers in (("single-bf16", 0), ("two-bf16", 1)):
        config = tmp / f"{name}.yaml"
        config.write_text(_config(tmp, workers).read_text() + "rollout: {dtype: bfloat16}\n")
        _share_warmstart(tmp / "single", tmp / name)
        runs_bf16[name] = _train(config, tmp / name, nproc=2 if workers else None)
    assert_equal_runs(runs_bf16["single-bf16"], runs_bf16["two-bf16"], STEPS)
    fp32, bf16 = _push_units(runs["two"]), _push_units(runs_bf16["two-bf16"])
    assert fp32 and bf16, "no version went to the worker"
    one32, one16 = min(fp32), min(bf16)  # one version's bytes (a batch may bring several)
    assert one16 == pytest.approx(one32 / 2, rel=1e-12), (one32, one16)
    assert all(x / one16 == pytest.approx(round(x / one16)) for x in bf16), bf16


# --- DeepSpeed trainer ranks and a rollout worker in one launch -----------------------------------
#
# torchrun --nproc_per_node 3, rollout_workers 1: ranks 0 and 1 train data-parallel under ZeRO-2
# or ZeRO-3 in a world of their own (a3po.parallel.ranks.init_ranks), rank 2 generates. The
# worker's batches are the single process's, bit for bit (above); rank 0 hands each to rank 1 and
# each trains on its half of every minibatch, as the 2-rank runs of tests/parallel/test_deepspeed_ranks.py do.
# So the run equals the single process within that module's tolerances (float summation order
# over 2 ranks; its docstring derives them), the discrete figures (rewards, lengths, staleness,
# held-out accuracy) exactly. Measured (this config): ZeRO-2 weights 1.8e-7 max abs apart, worst
# metric stability/trust_ratio_max 7.6e-6 abs on 2.45 (3.1e-6 relative), loss 6.1e-8 abs; ZeRO-3
# (every parameter partitioned) weights 3.4e-7, worst policy/approx_kl 2.2e-6 relative, loss 2.2e-8 abs.
RTOL, ATOL, WEIGHTS_ATOL = 1e-4, 1e-6, 1e-5


def _deepspeed_json(tmp: Path, zero_stage: int) -> Path:
    return deepspeed_json(REPO_ROOT, tmp, zero_stage)


def _zero_run(runs: dict, zero_stage: int) -> dict:
    """The uninterrupted 2 ZeRO trainer ranks + 1 rollout worker run (the single run's warm start), once per module."""
    if not deepspeed_available():
        pytest.skip("DeepSpeed is not installed (pip install -e '.[distributed]')")
    if zero_stage not in runs:
        tmp = runs["tmp"]
        _share_warmstart(tmp / "single", tmp / f"zero{zero_stage}")
        runs[zero_stage] = _train(_config(tmp, 1, deepspeed_json=_deepspeed_json(tmp, zero_stage)), tmp / f"zero{zero_stage}", nproc=3)
    return runs[zero_stage]


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_two_zero_trainer_ranks_and_a_rollout_worker_equal_the_single_process_run(runs, zero_stage):
    single, run = runs["single"], _zero_run(runs, zero_stage)
    assert (run["world_size"], run["zero_stage"], run["rollout_workers"]) == (2, zero_stage, 1)
    assert_same_trajectory(single, run, STEPS, RTOL, ATOL)
    ws, wr = _final_weights(single), _final_weights(run)
    assert ws.keys() == wr.keys()
    assert max(float((ws[k] - wr[k]).abs().max()) for k in ws) <= WEIGHTS_ATOL
    # The per-token versions came through the worker: the deterministic schedule's staleness (s = 2).
    assert [_metrics(run)[s]["staleness/max"] for s in range(1, STEPS + 1)] == [0.0, 1.0] + [2.0] * (STEPS - 2)


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_killed_rollout_worker_beside_zero_ranks_stops_the_launch_and_the_rerun_resumes_exactly(runs, zero_stage):
    """SIGKILL of the worker (rank 2) once a checkpoint exists: torchrun names rank 2 and its
    signal, no process of the launch is left, and the same command resumes every rank (both
    optimizer partitions are in the checkpoint) to the uninterrupted run's end, exactly."""
    from a3po.storage.checkpoint import latest_checkpoint, load_checkpoint

    tmp, out = runs["tmp"], runs["tmp"] / f"zero{zero_stage}-killed"
    _share_warmstart(tmp / "single", out)
    config = _config(tmp, 1, deepspeed_json=_deepspeed_json(tmp, zero_stage))
    latest = out / "loglinear-seed0" / "checkpoints" / "latest"
    proc, output, launch = run_and_kill(_command(config, out, 3), REPO_ROOT, _env(), latest, rank=2)
    assert proc.returncode != 0, "the killed run reported success"
    assert "rank      : 2" in output and "Signal 9 (SIGKILL)" in output, output[-3000:]
    left = [p for p in launch if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert len(launch) >= 2 and not left, (launch, left)  # the trainer ranks at least (the worker may be reaped already)
    killed_at = json.loads(latest.read_text())["step"]
    assert killed_at < STEPS, f"the run finished (step {killed_at}) before the worker was killed"
    state = load_checkpoint(latest_checkpoint(latest.parent))
    assert (state["optimizer"]["world_size"], len(state["optimizer"]["ranks"])) == (2, 2)

    resumed = _train(config, out, nproc=3)
    assert resumed["resumed_from"] is not None and resumed["resumed_from"] <= killed_at < STEPS
    assert_equal_runs(_zero_run(runs, zero_stage), resumed, STEPS)  # exactly: module docstring


@pytest.mark.slow
def test_killed_trainer_rank_beside_a_rollout_worker_stops_the_launch_and_the_rerun_resumes_exactly(runs):
    """SIGKILL of trainer rank 1 (2 ZeRO-2 ranks + 1 worker) once a checkpoint exists: torchrun
    names rank 1 and its signal, no process of the launch is left (rank 0 and the worker, blocked
    in collectives with the dead rank or with each other, are stopped), and the same command
    resumes to the uninterrupted run's end, exactly."""
    tmp, out = runs["tmp"], runs["tmp"] / "zero2-killed-trainer"
    _share_warmstart(tmp / "single", out)
    config = _config(tmp, 1, deepspeed_json=_deepspeed_json(tmp, 2))
    latest = out / "loglinear-seed0" / "checkpoints" / "latest"
    proc, output, launch = run_and_kill(_command(config, out, 3), REPO_ROOT, _env(), latest, rank=1)
    assert proc.returncode != 0, "the killed run reported success"
    assert "rank      : 1" in output and "Signal 9 (SIGKILL)" in output, output[-3000:]
    left = [p for p in launch if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert len(launch) >= 2 and not left, (launch, left)  # rank 0 and the worker at least (rank 1 may be reaped already)
    killed_at = json.loads(latest.read_text())["step"]
    assert killed_at < STEPS, f"the run finished (step {killed_at}) before rank 1 was killed"

    resumed = _train(config, out, nproc=3)
    assert resumed["resumed_from"] is not None and resumed["resumed_from"] <= killed_at < STEPS
    assert_equal_runs(_zero_run(runs, 2), resumed, STEPS)  # exactly: module docstring


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


def test_a_version_in_bf16_is_each_float_rounded_as_the_engine_rounds_it_and_half_the_bytes():
    g = torch.Generator().manual_seed(0)
    state = {
        "w": torch.randn(3, 5, generator=g),
        "b16": torch.randn(7, generator=g).to(torch.bfloat16),  # odd count: the int64 after it lands unaligned
        "i": torch.tensor([1, -2, 3], dtype=torch.int64),
        "d": torch.randn(2, 2, generator=g, dtype=torch.float64),
        "mask": torch.tensor([True, False, True]),
    }
    layout = state_layout(state, torch.bfloat16)
    assert [d for _, d, _ in layout] == ["bfloat16", "bfloat16", "int64", "bfloat16", "bool"]
    buf = pack_state(state, torch.bfloat16)
    assert buf.numel() == 15 * 2 + 7 * 2 + 3 * 8 + 4 * 2 + 3
    assert pack_state(state).numel() == 15 * 4 + 7 * 2 + 3 * 8 + 4 * 8 + 3
    back = unpack_state(buf, layout, torch.device("cpu"))
    for k, v in state.items():
        # what a bf16 parameter holds after load_state_dict from the full-precision tensor
        want = torch.empty_like(v, dtype=torch.bfloat16).copy_(v) if v.is_floating_point() else v
        assert back[k].dtype == want.dtype and torch.equal(back[k], want), k


def test_tied_weights_travel_once_and_arrive_as_one_tensor_under_both_names():
    from tests.support.tiny_models import qwen2

    state = qwen2().state_dict()  # tie_word_embeddings: the head is the embeddings
    tied = tied_names(state)
    assert tied == {"lm_head.weight": "model.embed_tokens.weight"}
    assert tied_names({k: v.clone() for k, v in state.items()}) == {}  # equal values are not a tie
    layout = state_layout(state)
    head = state["lm_head.weight"]
    buf = pack_state(state, tied=tied)
    assert buf.numel() == pack_state(state).numel() - head.numel() * head.element_size()
    back = unpack_state(buf, layout, torch.device("cpu"), tied)
    assert list(back) == list(state) and all(torch.equal(back[k], state[k]) for k in state)
    assert back["lm_head.weight"] is back["model.embed_tokens.weight"]


@pytest.mark.parametrize("tied_model", [False, True])
def test_an_engine_loaded_from_a_bf16_version_equals_one_loaded_from_the_trainers_weights(tied_model):
    """The worker's engine (a bf16 copy) ends with the same weights whether the version came in the
    trainer's fp32 bytes or rounded to bf16 before sending, its tied weights once: so it samples
    the same tokens."""
    from a3po.models.factory import empty_like
    from tests.support.tiny_models import llama, qwen2

    policy = qwen2() if tied_model else llama()
    state = policy.state_dict()
    wire, tied = torch.bfloat16, tied_names(state)
    assert bool(tied) == tied_model
    direct, sent = empty_like(policy, torch.bfloat16), empty_like(policy, torch.bfloat16)
    direct.load_state_dict(state)
    sent.load_state_dict(unpack_state(pack_state(state, wire, tied), state_layout(state, wire), torch.device("cpu"),
                                      tied))
    d, s = direct.state_dict(), sent.state_dict()
    assert d.keys() == s.keys() and all(torch.equal(d[k], s[k]) for k in d)
    assert any(not torch.equal(v.float(), state[k]) for k, v in d.items())  # the rounding is real here


def _inputs(**sections):
    from a3po.config import RunPlan, config_from_dict
    from a3po.placement.in_process import RolloutInputs
    from tests.support.tiny_models import llama

    cfg = config_from_dict({"distributed": {"rollout_workers": 1}, **sections})
    policy = llama()
    if cfg.model.lora is not None:
        from a3po.models.lora import with_lora

        policy = with_lora(policy, cfg.model.lora)
    return RolloutInputs(cfg, RunPlan.of(cfg, cores=2), policy, tokenizer=None, train_rows=[], score=None)


def test_versions_travel_in_bf16_only_where_the_worker_needs_nothing_more():
    assert version_wire(_inputs(rollout={"dtype": "bfloat16"})) is torch.bfloat16
    assert version_wire(_inputs(rollout={"dtype": "float32"})) is None
    assert version_wire(_inputs()) is None  # float32 trainer, engine in its dtype
    # The worker re-scores each batch in the trainer's precision: it needs the trainer's bytes.
    assert version_wire(_inputs(rollout={"dtype": "bfloat16"}, rl={"proximal": "metrics"})) is None
    # LoRA: a version is the adapters, merged into the worker's full-precision base.
    assert version_wire(_inputs(rollout={"dtype": "bfloat16"}, model={"lora": {"r": 4}})) is None


def test_push_figures_sum_the_versions_sent_since_the_last_batch_took_them():
    pushed = PushFigures()
    assert pushed.take() == {"perf/weights_push_s": 0.0, "perf/weights_push_mb": 0.0}
    pushed.add(0.5, 2**20)
    pushed.add(0.25, 2**21)
    assert pushed.take() == {"perf/weights_push_s": 0.75, "perf/weights_push_mb": 3.0}
    assert pushed.take() == {"perf/weights_push_s": 0.0, "perf/weights_push_mb": 0.0}


def test_a_version_carries_the_bound_in_force_when_it_was_published():
    bounds = VersionBounds(1)
    bounds.move(3, 2)  # set after step 2, before version 3 was published
    bounds.move(5, 3)
    bounds.move(5, 2)  # moved twice before version 5: the last one holds
    assert [bounds.at(v) for v in range(8)] == [1, 1, 1, 2, 2, 2, 2, 2]
    with pytest.raises(ValueError, match="before its last move"):
        bounds.move(4, 1)


def test_rollout_worker_config_errors_name_the_field(tmp_path):
    from a3po.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match="distributed.rollout_workers must be >= 0, got -1"):
        config_from_dict({"distributed": {"rollout_workers": -1}})


@pytest.mark.skipif(not deepspeed_available(), reason="DeepSpeed is not installed")
def test_deepspeed_ranks_with_rollout_workers_are_accepted_at_every_zero_stage_and_vllm_only_in_the_workers():
    from a3po.config import config_from_dict, preflight

    for stage in (1, 2, 3):
        shipped = str(REPO_ROOT / f"infra/deepspeed_zero{stage}.json")
        cfg = preflight(config_from_dict({"distributed": {"rollout_workers": 1, "deepspeed_config": shipped}}))
        assert (cfg.distributed.rollout_workers, cfg.distributed.deepspeed_config) == (1, shipped)
    # vLLM in the worker beside ZeRO trainer ranks (the production topology); without workers every
    # DeepSpeed rank would start its own vLLM.
    cfg = config_from_dict({"rollout": {"engine": "vllm"}, "distributed": {"rollout_workers": 1, "deepspeed_config": shipped}})
    assert (cfg.rollout.engine, cfg.distributed.rollout_workers) == ("vllm", 1)
    with pytest.raises(ValueError, match="rollout.engine 'vllm' with distributed.deepspeed_config and no rollout workers: every trainer rank"):
        config_from_dict({"rollout": {"engine": "vllm"}, "distributed": {"deepspeed_config": shipped}})


def test_several_trainer_ranks_beside_workers_without_deepspeed_are_refused_before_joining(monkeypatch):
    """torchrun --nproc_per_node 3 with rollout_workers 1 leaves 2 trainer ranks: without a
    DeepSpeed config they would train two copies; refused before any process group is joined."""
    import torch.distributed as dist

    from a3po.parallel.ranks import init_ranks

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(RuntimeError, match=r"launched as 3 processes with distributed.rollout_workers 1: that leaves 2 trainer ranks, "
                                           r"but distributed.deepspeed_config is null"):
        init_ranks(None, rollout_workers=1)
    assert not dist.is_initialized()


def test_ranks_split_the_launch_into_trainer_ranks_then_workers():
    from a3po.parallel.ranks import ranks_from_env

    trainer = ranks_from_env({"RANK": "0", "WORLD_SIZE": "3"}, rollout_workers=2)
    worker = ranks_from_env({"RANK": "2", "WORLD_SIZE": "3"}, rollout_workers=2)
    assert (trainer.world_size, trainer.launch_size, trainer.is_main, trainer.is_rollout_worker) == (1, 3, True, False)
    assert (worker.is_main, worker.is_rollout_worker) == (False, True)
    with pytest.raises(ValueError, match=r"rollout_workers is 1 but the launch has 1 process\(es\).*--nproc_per_node 2"):
        ranks_from_env({}, rollout_workers=1)
    # 2 DeepSpeed trainer ranks and a worker: ranks 0 and 1 train, rank 2 generates
    split = [ranks_from_env({"RANK": str(r), "WORLD_SIZE": "3"}, rollout_workers=1) for r in range(3)]
    assert [(r.world_size, r.launch_size, r.is_main, r.is_rollout_worker) for r in split] == [
        (2, 3, True, False), (2, 3, False, False), (2, 3, False, True)]


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
