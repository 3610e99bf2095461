"""LoRA (``model.lora``) with DeepSpeed trainer ranks and with a rollout worker process.

The slow tests run the real command, ``python -m a3po.training.command``, on the micro preset with LoRA
(r 4, alpha 8: 14 adapter tensors, 2176 floats) and the config of tests/parallel/test_deepspeed_ranks.py and
tests/placement/test_rollout_workers.py (warm start of 150 steps, lr 1e-3 without warm-up, 8 steps, the
deterministic schedule at s = 2), one warm start shared by every run:

* 2 ZeRO-2 ranks against one process: equal within the tolerances of tests/parallel/test_deepspeed_ranks.py
  (float summation order of the gradient over two half-minibatches; nothing else differs), the
  discrete figures exactly, the exported merged weights within 1e-5, and only the adapted
  projections of the export moved; the checkpoint's optimizer holds the adapters' partitions
  alone (1088 + 1088 of 2176 floats, no base weight). Measured: weights 1.5e-8 apart, worst
  metric 1.5e-6 abs (``stability/behav_iw_max`` on 1.62), 4.0e-6 relative (``policy/approx_kl``).
* 2 ZeRO-3 ranks, every parameter partitioned (the frozen base too), the same tolerances.
* 1 trainer + 1 rollout worker against one process: equal exactly, as without LoRA (the worker
  builds the same peft model on the same warm start, receives each adapter version as raw bytes
  and merges it into its base with the same code as the single process's engine).
* 2 ZeRO-1 or ZeRO-3 ranks + 1 rollout worker: the 2-rank tolerances.
* 2 ZeRO-2 or ZeRO-3 ranks killed after a checkpoint: the rerun resumes and ends equal to the
  uninterrupted 2-rank run, bit for bit.

The fast tests: a worker's model fed the trainer's adapters samples with the trainer's adapted
log-probs (tolerance 1e-4, that of tests/models/test_lora.py: the engine decodes merged weights with its
own kernels, the trainer runs peft's ``W0 x + s B (A x)``: measured 4.8e-7 max here); the merges
read the whole base kept before ZeRO-3 partitions the module.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

from a3po.config import RunPlan, config_from_dict, preset, with_overrides
from a3po.config.preflight import deepspeed_available
from a3po.data.arithmetic import WORDS
from a3po.data.datasets import load_rows
from a3po.models.factory import build_tiny_model
from a3po.models.logprobs import token_logprobs
from a3po.models.lora import MergedWeights, apply_lora, is_lora, keep_base_whole, trained_state
from a3po.parallel.updaters import plain_model
from a3po.placement.in_process import RolloutInputs, local_producer
from a3po.placement.worker_loop import worker_inputs
from a3po.placement.worker_wire import pack_state, state_layout, unpack_state
from a3po.producer.weight_store import WeightStore, clone_state
from a3po.rollout.types import SamplingParams
from a3po.storage.checkpoint import latest_checkpoint, load_checkpoint
from tests.support.cli_runs import assert_same_trajectory, deepspeed_json, killed_at_step, run_and_kill, run_to_json
from tests.support.cli_runs import final_weights as _final_weights
from tests.support.cli_runs import share_warmstart as _share_warmstart
from tests.support.cli_runs import step_metrics as _metrics
from tests.support.cli_runs import train_command as _command

REPO_ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
LORA = {"r": 4, "alpha": 8.0}
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
ADAPTER_FLOATS = 2176  # r 4 on the micro model's seven projections (tests/models/test_lora.py derives it)
# tests/parallel/test_deepspeed_ranks.py's tolerances: float summation order across ranks.
RTOL, ATOL, WEIGHTS_ATOL = 1e-4, 1e-6, 1e-5
TOL = 1e-4  # engine (merged weights) vs the trainer's peft forward, as tests/models/test_lora.py


def _env() -> dict[str, str]:
    return {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1", "DO_NOT_TRACK": "true"}


def _config(tmp: Path, name: str, distributed: str = "") -> Path:
    path = tmp / f"config-{name}.yaml"
    path.write_text(
        f"model: {{lora: {{r: {LORA['r']}, alpha: {LORA['alpha']}}}}}\n"
        "warm_start: {steps: 150, batch_size: 32}\n"
        f"rl: {{steps: {STEPS}, batch_prompts: 8, group_size: 4, minibatches: 2, max_new_tokens: 12, lr: 1.0e-3,\n"
        "     lr_warmup_steps: 0, eval_every: 4, checkpoint_every: 2, schedule: deterministic, max_staleness: 2}\n"
        + (f"distributed: {{{distributed}}}\n" if distributed else "")
    )
    return path


def _train(config: Path, out: Path, nproc: int | None = None) -> dict:
    return run_to_json(_command(config, out, nproc), REPO_ROOT, _env())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One LoRA process, 2 ZeRO-2 LoRA ranks, 1 trainer + 1 rollout worker with LoRA; one warm start."""
    if not deepspeed_available():
        pytest.skip("DeepSpeed is not installed (pip install -e '.[distributed]')")
    tmp = tmp_path_factory.mktemp("lora-dist")
    single = _train(_config(tmp, "single"), tmp / "single")
    zero2_config = _config(tmp, "zero2", f"deepspeed_config: {deepspeed_json(REPO_ROOT, tmp, 2)}")
    _share_warmstart(tmp / "single", tmp / "zero2")
    zero2 = _train(zero2_config, tmp / "zero2", nproc=2)
    _share_warmstart(tmp / "single", tmp / "worker")
    worker = _train(_config(tmp, "worker", "rollout_workers: 1"), tmp / "worker", nproc=2)
    return {"single": single, "zero2": zero2, "zero2_config": zero2_config, "worker": worker, "tmp": tmp}


def _warmstart_weights(runs: dict) -> dict:
    from safetensors.torch import load_file

    (folder,) = (runs["tmp"] / "single" / "cache").iterdir()
    return load_file(folder / "model.safetensors")


def _zero3(runs: dict) -> dict:
    """The uninterrupted 2-rank ZeRO-3 run, every parameter partitioned (once per module)."""
    if "zero3" not in runs:
        tmp = runs["tmp"]
        _share_warmstart(tmp / "single", tmp / "zero3")
        runs["zero3_config"] = _config(tmp, "zero3", f"deepspeed_config: {deepspeed_json(REPO_ROOT, tmp, 3)}")
        runs["zero3"] = _train(runs["zero3_config"], tmp / "zero3", nproc=2)
    return runs["zero3"]


def _adapter_checkpoint(run: dict) -> dict:
    return load_checkpoint(latest_checkpoint(Path(run["run_dir"]) / "checkpoints"))


@pytest.mark.slow
def test_two_zero2_ranks_with_lora_match_one_lora_process(runs):
    single, zero2 = runs["single"], runs["zero2"]
    assert (single["world_size"], single["zero_stage"]) == (1, None)
    assert (zero2["world_size"], zero2["zero_stage"]) == (2, 2)
    assert_same_trajectory(single, zero2, STEPS, RTOL, ATOL)
    # Adapter versions in the store (two kept at s = 2: see tests/models/test_lora.py), as in one process.
    assert all(m["weights/store_mb"] == ms["weights/store_mb"] for m, ms in zip(_metrics(zero2).values(), _metrics(single).values(),
                                                                                  strict=True))
    ws, w2 = _final_weights(single), _final_weights(zero2)
    assert ws.keys() == w2.keys() and not any("lora" in k for k in ws)  # the merged plain model
    assert max(float((ws[k] - w2[k]).abs().max()) for k in ws) <= WEIGHTS_ATOL
    # Only the adapters trained under DeepSpeed: the export moved off the warm start in the seven
    # adapted projections alone (by far more than the tolerance), every other weight is the warm start's.
    warm = _warmstart_weights(runs)
    moved = {k for k in warm if not torch.equal(warm[k], w2[k])}
    assert moved == {f"model.layers.0.{m}.weight" for m in PROJECTIONS}
    assert min(float((warm[k] - w2[k]).abs().max()) for k in moved) > 100 * WEIGHTS_ATOL
    # The checkpoint: the adapters, and each rank's AdamW partition of the adapters alone.
    state, one = _adapter_checkpoint(zero2), _adapter_checkpoint(single)
    assert len(state["policy"]) == 14 and all(".lora_A." in k or ".lora_B." in k for k in state["policy"])
    assert max(float((state["policy"][k] - one["policy"][k]).abs().max()) for k in one["policy"]) <= WEIGHTS_ATOL
    ranks = state["optimizer"]["ranks"]
    assert [sum(t.numel() for t in r["master"]) for r in ranks] == [ADAPTER_FLOATS // 2] * 2
    assert all(st["exp_avg"].numel() == ADAPTER_FLOATS // 2 for r in ranks for st in r["adamw"]["state"].values())


@pytest.mark.slow
def test_trainer_plus_a_rollout_worker_with_lora_equals_the_single_lora_process(runs):
    single, worker = runs["single"], runs["worker"]
    assert (worker["world_size"], worker["rollout_workers"]) == (1, 1)
    ma, mb = _metrics(single), _metrics(worker)
    assert sorted(ma) == list(range(1, STEPS + 1))
    losses = [ma[s]["loss/policy"] for s in ma]
    assert sum(abs(x) > 1e-3 for x in losses) >= 3, f"degenerate trajectory, nothing to compare: {losses}"
    assert ma == mb  # exactly: module docstring
    assert [mb[s]["staleness/max"] for s in range(1, STEPS + 1)] == [0.0, 1.0] + [2.0] * (STEPS - 2)
    wa, wb = _final_weights(single), _final_weights(worker)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_two_zero3_lora_ranks_match_one_lora_process(runs):
    """ZeRO-3 with every parameter partitioned (the frozen base too): each rank generates from the
    whole base it kept before partitioning, rank 0 evaluates and exports merged copies."""
    run = _zero3(runs)
    assert (run["world_size"], run["zero_stage"]) == (2, 3)
    assert_same_trajectory(runs["single"], run, STEPS, RTOL, ATOL)
    ws, w3 = _final_weights(runs["single"]), _final_weights(run)
    assert ws.keys() == w3.keys() and max(float((ws[k] - w3[k]).abs().max()) for k in ws) <= WEIGHTS_ATOL
    state = _adapter_checkpoint(run)
    assert len(state["policy"]) == 14 and all(".lora_A." in k or ".lora_B." in k for k in state["policy"])
    ranks = state["optimizer"]["ranks"]  # each rank's fp32 partition: half of the adapters, nothing of the base
    assert [sum(t.numel() for t in r["master"]) for r in ranks] == [ADAPTER_FLOATS // 2] * 2


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [1, 3])
def test_two_zero_lora_ranks_and_a_rollout_worker_match_one_lora_process(runs, zero_stage):
    """torchrun --nproc_per_node 3: ranks 0 and 1 train the adapters under ZeRO-1 or ZeRO-3, rank 2
    generates with them; rank 0 pushes adapter versions (gathered under ZeRO-3) and hands each batch
    to rank 1. Within the 2-rank tolerances of the single process (the worker's batches are its)."""
    tmp = runs["tmp"]
    out = tmp / f"zero{zero_stage}-worker"
    _share_warmstart(tmp / "single", out)
    config = _config(tmp, out.name, f"rollout_workers: 1, deepspeed_config: {deepspeed_json(REPO_ROOT, tmp, zero_stage)}")
    run = _train(config, out, nproc=3)
    assert (run["world_size"], run["zero_stage"], run["rollout_workers"]) == (2, zero_stage, 1)
    assert_same_trajectory(runs["single"], run, STEPS, RTOL, ATOL)
    assert [_metrics(run)[s]["staleness/max"] for s in range(1, STEPS + 1)] == [0.0, 1.0] + [2.0] * (STEPS - 2)
    ws, wr = _final_weights(runs["single"]), _final_weights(run)
    assert ws.keys() == wr.keys() and max(float((ws[k] - wr[k]).abs().max()) for k in ws) <= WEIGHTS_ATOL


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_two_zero_lora_ranks_killed_after_a_checkpoint_resume_exactly(runs, zero_stage):
    """SIGKILL of rank 1 once a checkpoint exists; the rerun (adapters and both ranks' AdamW
    partitions from the checkpoint) ends equal to the uninterrupted 2-rank run, bit for bit."""
    uninterrupted = runs["zero2"] if zero_stage == 2 else _zero3(runs)
    config = runs[f"zero{zero_stage}_config"]
    tmp, out = runs["tmp"], runs["tmp"] / f"killed-zero{zero_stage}"
    _share_warmstart(tmp / "single", out)
    latest = out / "loglinear-seed0" / "checkpoints" / "latest"
    proc, _, _ = run_and_kill(_command(config, out, 2), REPO_ROOT, _env(), latest)
    killed_at = killed_at_step(proc, latest, STEPS)
    resumed = _train(config, out, nproc=2)
    assert resumed["resumed_from"] is not None and resumed["resumed_from"] <= killed_at < STEPS
    assert _metrics(resumed) == _metrics(uninterrupted)
    wr, wu = _final_weights(resumed), _final_weights(uninterrupted)
    assert all(torch.equal(wr[k], wu[k]) for k in wu)


# --- fast ---------------------------------------------------------------------------------------


def _adapted(policy: torch.nn.Module) -> torch.nn.Module:
    """``policy`` with adapters as after some updates: B off 0."""
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(1)
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    return policy


def test_a_workers_model_fed_the_trainers_adapters_samples_with_the_adapted_logprobs(core_one_thread):
    """The worker's side of a push, in one process: the worker builds its policy from the warm
    start (:func:`worker_inputs`), takes an adapter version as the bytes the trainer broadcasts, and
    its engine's behaviour log-probs equal the trainer's peft forward with those adapters."""
    cfg = with_overrides(preset("micro"), model={"lora": LORA})
    warm, tok = build_tiny_model("micro", WORDS, seed=0)
    trainer = _adapted(apply_lora(copy.deepcopy(warm), cfg.model.lora))
    version = clone_state(trainer)
    rows = load_rows(cfg.data, tok)[0]
    inp = worker_inputs(RolloutInputs(cfg, RunPlan.of(cfg, cores=1), warm, tok, rows, score=lambda c, m: [0.0] * len(c)))
    assert is_lora(inp.policy) and not any(p.requires_grad for n, p in inp.policy.named_parameters() if "lora_" not in n)
    layout = state_layout(trained_state(inp.policy))
    assert layout == state_layout(version) and len(layout) == 14  # the hello's check passes: adapters only
    store = WeightStore()
    store.publish(3, unpack_state(pack_state(version), layout, torch.device("cpu")))
    engine = local_producer(inp, store, start=0).engine
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ("Question: Mia has 23 pens.", "Question: Sam", "Question: 7")]
    b = engine.generate_batch(prompts, SamplingParams(max_new_tokens=10, temperature=1.0), seed=5)
    with torch.no_grad():
        adapted = token_logprobs(trainer, b.input_ids, b.attention_mask, 1.0, start=b.prompt_len)
        plain = token_logprobs(warm, b.input_ids, b.attention_mask, 1.0, start=b.prompt_len)
    m = b.response_mask
    assert int(m.sum()) >= 10 and bool((b.versions[m] == 3).all())
    torch.testing.assert_close(b.behav_logp[m], adapted[m], rtol=0, atol=TOL)
    # Without the adapters the log-probs are far off (so the check above can fail).
    assert (b.behav_logp[m] - plain[m]).abs().max() > 0.05


def test_lora_with_deepspeed_ranks_and_rollout_workers_builds():
    for distributed in ({"deepspeed_config": "infra/deepspeed_zero2.json"}, {"rollout_workers": 1},
                        {"deepspeed_config": "infra/deepspeed_zero1.json", "rollout_workers": 1}):
        cfg = config_from_dict({"distributed": distributed, "model": {"lora": LORA}})
        assert cfg.model.lora is not None and cfg.distributed == config_from_dict({"distributed": distributed}).distributed


def test_merges_read_the_whole_base_kept_before_zero3_partitions_it():
    """ZeRO-3 leaves each parameter an empty tensor outside a gather (``param.data = torch.empty(0)``
    in DeepSpeed's ``free_param``), done by hand here: the merge and the plain model rank 0 evaluates
    and exports read the copy :func:`keep_base_whole` took, and equal what they were before."""
    cfg = with_overrides(preset("micro"), model={"lora": LORA})
    warm, _ = build_tiny_model("micro", WORDS, seed=0)
    policy = _adapted(apply_lora(copy.deepcopy(warm), cfg.model.lora))
    adapters = clone_state(policy)
    before = MergedWeights(policy)(adapters)
    keep_base_whole(policy)
    for name, p in policy.named_parameters():
        if "lora_" not in name:
            p.data = torch.empty(0)
    after = MergedWeights(policy)(adapters)
    assert after.keys() == before.keys() == warm.state_dict().keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    plain = plain_model(policy, adapters)
    assert not is_lora(plain) and all(torch.equal(v, before[k]) for k, v in plain.state_dict().items())
    # The adapters are in it: the adapted projections moved off the warm start.
    q = "model.layers.0.self_attn.q_proj.weight"
    assert (plain.state_dict()[q] - warm.state_dict()[q]).abs().max() > 0.01
