"""OPPO on the vLLM engine (``-m vllm``; skipped without vLLM): the request-level loop of
:meth:`a3po.rollout.vllm_engine.VllmEngine.generate_until` carries the over-commitment and the
streamed scoring, in process and in a rollout worker.

* The ledger of tests/oppo/test_overcommit.py with the vLLM engine: producer threads, a trainer
  that moves the policy every step, a checkpoint while answers are mid-way, a new producer (and a
  new engine) resumed from it. Every admitted group is trained once or still in flight, and every
  trained token's behaviour log-prob is the trainer's forward at the token's own version: an
  answer resumed across versions is re-prefilled (prompt + partial answer) into the new weights.
* Launches (1 trainer + 1 vLLM rollout worker, ``torchrun``, as tests/oppo/test_rollout_workers.py does
  with the torch engine): intra's streamed figures equal the trainer's one-shot scoring of an
  intra-off run within tests/oppo/test_intra.py's tolerances; both overlaps on the PPO path, the worker
  killed once a checkpoint holds carried answers, rerun to the uninterrupted end exactly.

The model is the tiny preset's size with 3 heads of 32 (vLLM's CPU attention has no kernel for 24)
or the micro preset's with one head of 32, as tests/rollout/test_vllm_engine.py and tests/placement/test_vllm_workers.py.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import psutil
import pytest
import torch

from a3po.config import WarmStartConfig
from a3po.data.arithmetic import WORDS, generate_split
from a3po.models.factory import TinyArch, build_tiny_model
from a3po.models.logprobs import token_logprobs
from a3po.oppo.overcommit import DeltaController, OverlapProducer
from a3po.producer.producer import Admission, PromptSampler
from a3po.producer.weight_store import WeightStore, clone_state
from a3po.rollout.types import SamplingParams
from a3po.storage.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from tests.support.cli_runs import assert_equal_runs, killed_at_step, run_and_kill, run_to_json, share_warmstart, step_metrics
from tests.support.ledger import assert_every_group_trained_once
from tests.support.tiny_models import save_micro_h32

pytestmark = pytest.mark.vllm

if importlib.util.find_spec("vllm") is None:
    from a3po.rollout.vllm_support import INSTALL_HINT

    pytest.skip(f"vLLM is not installed ({INSTALL_HINT})", allow_module_level=True)

from a3po.rollout.vllm_engine import VllmEngine  # noqa: E402
from a3po.training.warmstart import warm_start  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
BEHAV_TOL_MAX = 1e-4  # nats, float32 (tests/rollout/test_vllm_engine.py)
B, G, M = 2, 2, 24  # groups per batch, samples per group, max new tokens
TINY_H32 = TinyArch(hidden_size=96, num_layers=2, num_heads=3, intermediate_size=192)


def _engine(model, tok, state, version: int) -> VllmEngine:
    return VllmEngine.from_policy(model, tok, state, version, work_dir=tempfile.mkdtemp(prefix="a3po-vllm-oppo-"),
                                  max_model_len=128, dtype="float32", seed=0, max_batch=(B + 4) * G)


def _producer(engine, sampler, store, start: int = 0) -> OverlapProducer:
    return OverlapProducer(
        engine, store, Admission(store, 1, B * G, admitted=start * B * G), sampler, SamplingParams(M, 1.0),
        score=lambda comps, meta: [float(len(c)) for c in comps], decode=lambda t: " ".join(map(str, t)),
        max_staleness=1, schedule="deterministic", seed=0, start=start, mid_batch_updates=False,
        batch_groups=B, group_size=G, delta=DeltaController(4, 4, 4, 0, 0, 2),
    )


def test_every_admitted_group_is_trained_once_across_a_checkpoint_and_each_token_is_its_versions(tmp_path):
    torch.manual_seed(0)
    model, tok = build_tiny_model(TINY_H32, WORDS, seed=0)
    # A short warm start: answers end on EOS after varied lengths, some past M (carried over).
    warm_start(model, tok, generate_split(400, "train", 0), WarmStartConfig(steps=25, batch_size=32, lr=3e-3, seed=0))
    sampler = PromptSampler(generate_split(40, "train", seed=0), tok, B, G, seed=0)
    store = WeightStore()
    store.publish(0, clone_state(model))
    trainer_model, _ = build_tiny_model(TINY_H32, WORDS, seed=0)
    trainer_model.load_state_dict(store.get(0))
    trained: list[tuple[int, object]] = []
    last_state: list[dict] = []
    CKPT, STEPS = 3, 7

    def consume(producer, steps):
        producer.start()
        try:
            for j in steps:
                scored = producer.next_batch(timeout=600)
                assert scored.index == j
                trained.append((j, scored.rollout))
                last_state[:] = [scored.producer_state]
                with torch.no_grad():  # the trainer's step: the policy moves far beyond vLLM's rounding
                    for p in trainer_model.parameters():
                        p.mul_(1.02)
                store.publish(j + 1, clone_state(trainer_model))
                if j + 1 == CKPT:
                    save_checkpoint(tmp_path, CKPT, {"oppo_state": scored.producer_state}, keep=1)
        finally:
            producer.stop()
            producer.join(timeout=60)
            producer.close()

    consume(_producer(_engine(model, tok, store.get(0), 0), sampler, store), range(CKPT))
    state = load_checkpoint(tmp_path / "step_000003")["oppo_state"]
    store.closed = False
    resumed = _producer(_engine(model, tok, store.get(CKPT - 1), CKPT - 1), sampler, store, start=CKPT)
    resumed.load_state_dict(state)
    consume(resumed, range(CKPT, STEPS))
    final = last_state[0]

    partial_at_ckpt = {s["group"] for g in state["buffer"]["groups"] for s in g if s["tokens"] and not s["done"]}
    assert partial_at_ckpt, "precondition: some answers were mid-way at the checkpoint"
    trained_groups = [batch.meta[i]["group"] for _, batch in trained for i in range(0, len(batch), G)]
    assert_every_group_trained_once(trained_groups, final, B, STEPS)

    # Each token's behaviour log-prob is the trainer's forward of its own version (answers that
    # span versions included): the weights of consecutive versions differ by 2%, far above rounding.
    checker, _ = build_tiny_model(TINY_H32, WORDS, seed=0)
    spanning = 0
    for _, batch in trained:
        resp = batch.response_mask
        for v in batch.versions[resp].unique().tolist():
            checker.load_state_dict(store.get(int(v)))
            with torch.no_grad():
                logp = token_logprobs(checker.eval(), batch.input_ids, batch.attention_mask, 1.0)
            here = resp & (batch.versions == v)
            assert (batch.behav_logp - logp)[here].abs().max() < BEHAV_TOL_MAX, v
        spanning += sum(len(batch.versions[i][resp[i]].unique()) > 1 for i in range(len(batch)))
    assert spanning > 0, "precondition: some trained answers were sampled by two versions"


# --- launches: 1 trainer + 1 vLLM rollout worker --------------------------------------------------

STEPS_RUN = 6
LAUNCH_TIMEOUT_S = 1800  # vLLM's start-up alone is 30-70 s; several launches on a loaded machine


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1", "DO_NOT_TRACK": "true"}


@pytest.fixture(scope="module")
def micro_h32(tmp_path_factory) -> Path:
    return save_micro_h32(tmp_path_factory.mktemp("micro-h32"))


def _config(tmp: Path, name: str, model: Path, oppo: str, max_staleness: int) -> Path:
    # tiny-ppo's PPO parts; update_threads 1 and a pinned chunk size as tests/oppo/test_rollout_workers.py.
    path = tmp / f"{name}.yaml"
    path.write_text(
        f"model: {{name: {model}}}\n"
        "warm_start: {steps: 150, batch_size: 32}\n"
        "rollout: {engine: vllm}\n"
        f"rl: {{steps: {STEPS_RUN}, batch_prompts: 8, group_size: 4, minibatches: 2, max_new_tokens: 12, lr: 1.0e-3,\n"
        f"     lr_warmup_steps: 0, eval_every: 3, checkpoint_every: 2, schedule: deterministic, max_staleness: {max_staleness},\n"
        "     advantage: gae}\n"
        "ppo: {critic: policy_copy, critic_lr: 1.0e-3, gamma: 1.0, lam: 0.95, kl_coef: 0.05, kl_estimator: k3}\n"
        f"oppo: {{{oppo}, chunk_min: 4, chunk_max: 4}}\n"
        "update_threads: 1\n"
        "distributed: {rollout_workers: 1}\n"
    )
    return path


def _command(config: Path, out: Path, variant: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "a3po.training.command",
            "--preset", "micro", "--config", str(config), "--output-dir", str(out), "--no-progress", "--variant", variant]


def _train(config: Path, out: Path, variant: str = "loglinear") -> dict:
    return run_to_json(_command(config, out, variant), REPO_ROOT, _env(), timeout=LAUNCH_TIMEOUT_S - 60)


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 + 1e-4 * abs(b)  # tests/oppo/test_intra.py's tolerance


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S)
def test_intra_in_a_vllm_worker_streams_what_one_shot_scoring_gives(micro_h32, tmp_path):
    """Synchronous PPO (s = 0): the worker's scorers stream the reference log-probs and the critic's
    values column by column as vLLM decodes; every per-step figure equals the intra-off run's (the
    trainer's one-shot forwards of the same tokens) within 1e-5 / rel 1e-4."""
    off = _train(_config(tmp_path, "off", micro_h32, "intra: false", 0), tmp_path / "off", variant="sync")
    share_warmstart(tmp_path / "off", tmp_path / "on")
    on = _train(_config(tmp_path, "on", micro_h32, "intra: true", 0), tmp_path / "on", variant="sync")
    assert (on["rollout_workers"], off["rollout_workers"]) == (1, 1)
    mon, moff = step_metrics(on), step_metrics(off)
    assert sorted(mon) == sorted(moff) == list(range(1, STEPS_RUN + 1))
    skip = ("oppo/", "ppo/value_clip_frac")  # clip counts flip on ~1e-7 ties (tests/oppo/test_rollout_workers.py)
    bad = {(s, k): (mon[s][k], moff[s][k]) for s in moff for k in moff[s] if not k.startswith(skip) and not _close(mon[s][k], moff[s][k])}
    assert not bad, bad
    assert all(mon[s]["oppo/chunk_size"] == 4 and mon[s]["oppo/scorer_busy_s/values"] > 0 for s in mon)
    assert moff[STEPS_RUN]["ppo/kl"] > 0 and len({round(m["ppo/value_mean"], 6) for m in moff.values()}) > 1  # the critic moved


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S)
def test_both_overlaps_in_a_vllm_worker_resume_after_a_kill_to_the_uninterrupted_end(micro_h32, tmp_path):
    """PPO, loglinear, s = 1, intra + inter in the vLLM worker. The worker is killed once a
    checkpoint holds carried answers (with their streamed figures); the rerun hands it the
    carry-over back and ends equal to the uninterrupted run: no group lost or trained twice."""
    both = "intra: true, inter: true, delta_init: 2, delta_min: 1, delta_max: 3"
    config = _config(tmp_path, "both", micro_h32, both, 1)
    whole = _train(config, tmp_path / "whole")
    carried = [m["oppo/carried"] for m in step_metrics(whole).values()]
    assert max(carried) > 0, f"precondition: nothing was carried over: {carried}"
    out = tmp_path / "killed"
    share_warmstart(tmp_path / "whole", out)
    latest = out / "loglinear-seed0" / "checkpoints" / "latest"
    proc, output, launch = run_and_kill(_command(config, out, "loglinear"), REPO_ROOT, _env(), latest, rank=1)
    killed_at = killed_at_step(proc, latest, STEPS_RUN)
    assert "rank      : 1" in output and "Signal 9 (SIGKILL)" in output, output[-3000:]  # torchrun names the dead rank
    # Nothing of the launch is left: the trainer, and the engine core the killed worker had started.
    _, left = psutil.wait_procs(launch, timeout=30)
    assert len(launch) >= 2 and not [p for p in left if p.status() != psutil.STATUS_ZOMBIE], (launch, left)
    carry = load_checkpoint(latest_checkpoint(latest.parent))["oppo_state"]
    assert any(s["tokens"] for w in carry["workers"] if w is not None for g in w["buffer"]["groups"] for s in g), \
        "precondition: the checkpoint holds no carried answer"
    resumed = _train(config, out)
    assert resumed["resumed_from"] is not None and resumed["resumed_from"] <= killed_at
    assert_equal_runs(whole, resumed, STEPS_RUN, ignore=("oppo/scorer_busy_s/",))  # the scorers' wall time aside
