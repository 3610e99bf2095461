"""Rollout engines behind one interface (a3po/engines): the registry, the config checks made when
the config is built, the between-batch schedule (rollout.weight_updates: batch, the only one the
vLLM engine can follow) and the engine/trainer log-prob mismatch reported by ``proximal: metrics``.

The vLLM engine itself is tested in tests/rollout/test_vllm_engine.py (``-m vllm``)."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import itertools
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch

from a3po.config import ConfigError, mid_batch_updates, preflight, preset, with_overrides
from a3po.data.arithmetic import WORDS, generate_split
from a3po.data.datasets import load_rows
from a3po.models.factory import build_tiny_model
from a3po.producer.producer import Admission, PromptSampler, RolloutProducer
from a3po.producer.weight_store import WeightStore, clone_state
from a3po.rollout.engines import ROLLOUT_ENGINES, build_engine
from a3po.rollout.logprob_mismatch import BehaviourCheck, behaviour_mismatch
from a3po.rollout.torch_engine import RolloutEngine
from a3po.rollout.types import Engine, SamplingParams
from a3po.training.loop import rl_train

pytestmark = pytest.mark.usefixtures("core_one_thread")

VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None


def test_registry_names_and_capabilities():
    assert ROLLOUT_ENGINES.names() == ["torch", "vllm"]
    assert ROLLOUT_ENGINES.get("torch").mid_batch_updates is True
    assert ROLLOUT_ENGINES.get("vllm").mid_batch_updates is False
    with pytest.raises(KeyError, match="valid: torch, vllm"):
        ROLLOUT_ENGINES.get("sglang")


def test_config_rejects_an_unknown_engine_naming_the_field_and_the_valid_ones():
    with pytest.raises(ConfigError, match=r"rollout\.engine: unknown rollout engine 'sglang'; valid: torch, vllm"):
        with_overrides(preset("micro"), rollout={"engine": "sglang"})


def test_config_rejects_mid_batch_updates_for_an_engine_that_cannot_do_them():
    # Checked before availability: the same answer with or without vLLM installed.
    with pytest.raises(ConfigError, match="rollout.weight_updates 'decode_step': the vllm engine only loads weights between batches"):
        with_overrides(preset("micro"), rollout={"engine": "vllm", "weight_updates": "decode_step"})
    with pytest.raises(ConfigError, match="rollout.weight_updates: expected one of 'decode_step', 'batch', got 'sometimes'"):
        with_overrides(preset("micro"), rollout={"weight_updates": "sometimes"})


def test_weight_updates_default_to_the_finest_the_engine_does():
    assert mid_batch_updates(preset("micro").rollout) is True
    assert mid_batch_updates(with_overrides(preset("micro"), rollout={"weight_updates": "batch"}).rollout) is False


@pytest.mark.skipif(VLLM_INSTALLED, reason="vLLM is installed here; this checks the error where it is not")
def test_vllm_engine_without_vllm_is_a_clear_config_error():
    with pytest.raises(ConfigError) as e:
        preflight(with_overrides(preset("micro"), rollout={"engine": "vllm"}))
    msg = str(e.value)
    assert "rollout.engine 'vllm'" in msg and "vLLM is not installed" in msg
    assert "infra/install_vllm_cpu.sh" in msg and ".[gpu]" in msg


def test_producer_refuses_mid_batch_updates_with_an_engine_that_cannot():
    class BatchOnly(RolloutEngine):
        mid_batch_updates = False

    model, tok = build_tiny_model("micro", WORDS, seed=0)
    store = WeightStore()
    with pytest.raises(ValueError, match="cannot swap weights inside a batch"):
        RolloutProducer(BatchOnly(model, tok.eos_token_id, tok.pad_token_id), store, Admission(store, 1, 4),
                        None, SamplingParams(4), score=None, decode=None, max_staleness=1, schedule="deterministic", seed=0)


@pytest.mark.parametrize("s", [0, 2])
def test_between_batch_schedule_runs_each_batch_on_one_version(s):
    # Batch j is wholly on version max(0, j - s): staleness min(j, s) on every token (the
    # mid-batch schedule would put half of them at s - 1; tests/producer/test_producer.py).
    M, steps = 6, 4
    model, tok = build_tiny_model("micro", WORDS, seed=0)
    trainer_model, _ = build_tiny_model("micro", WORDS, seed=0)
    store = WeightStore()
    store.publish(0, clone_state(trainer_model))
    sampler = PromptSampler(generate_split(20, "train", 0), tok, batch_prompts=2, group_size=2, seed=0)
    producer = RolloutProducer(
        RolloutEngine(model, tok.eos_token_id, tok.pad_token_id, version=0), store, Admission(store, s, batch_size=4),
        sampler, SamplingParams(M), score=lambda c, m: [0.0] * len(c), decode=lambda ids: tok.decode(ids),
        max_staleness=s, schedule="deterministic", seed=0, mid_batch_updates=False,
    )
    check = BehaviourCheck(trainer_model, store.get, 1.0)
    producer.start()
    try:
        for j in range(steps):
            b = producer.next_batch(timeout=60).rollout
            assert b.versions[b.response_mask].eq(max(0, j - s)).all(), (j, b.versions)
            # and the tokens really come from that version's weights (versions differ by 0.01
            # per weight, far more than float32 rounding)
            assert check(b)["rollout/behav_logp_abs_err_max"] < 1e-5, j
            with torch.no_grad():
                for p in trainer_model.parameters():
                    p.add_(0.01)
            store.publish(j + 1, clone_state(trainer_model))
    finally:
        producer.stop()
        producer.join(timeout=10)
    assert not producer.is_alive()


def protocol_gaps(cls: type) -> list[str]:
    """What ``cls`` lacks of the :class:`Engine` protocol, read from the class alone (no instance:
    the vLLM engine's constructor needs vLLM). A data member is a class attribute, a property or
    an attribute ``__init__`` assigns; a method takes the protocol's parameters first, in order, by
    name, kind and default, and gives any further parameter a default."""
    gaps = []
    init_sets = {node.attr for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(cls.__init__))))
                 if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                 and isinstance(node.value, ast.Name) and node.value.id == "self"}
    for name in sorted(Engine.__annotations__):  # data members: version, mid_batch_updates, pad_token_id
        if not hasattr(cls, name) and name not in init_sets:
            gaps.append(f"attribute {name}")
    for name, member in vars(Engine).items():
        if name.startswith("_"):
            continue
        if isinstance(member, property):
            if not isinstance(getattr(cls, name, None), property) and name not in init_sets:
                gaps.append(f"property {name}")
            continue
        impl = getattr(cls, name, None)
        if not callable(impl):
            gaps.append(f"method {name}")
            continue
        want = list(inspect.signature(member).parameters.values())[1:]  # without self
        have = list(inspect.signature(impl).parameters.values())[1:]
        for w, h in itertools.zip_longest(want, have[: len(want)]):
            if h is None or (w.name, w.kind, w.default) != (h.name, h.kind, h.default):
                gaps.append(f"{name}: parameter {w.name}{'' if h is None else f' is {h}'}")
        gaps += [f"{name}: extra parameter {h.name} without a default" for h in have[len(want):]
                 if h.default is inspect.Parameter.empty and h.kind not in (h.VAR_POSITIONAL, h.VAR_KEYWORD)]
    return gaps


def test_both_engines_satisfy_the_engine_protocol():
    from a3po.rollout.vllm_engine import VllmEngine  # importable without vLLM: the engine imports it when built

    assert ROLLOUT_ENGINES.names() == ["torch", "vllm"]  # a new engine belongs in this check too
    assert protocol_gaps(RolloutEngine) == []
    assert protocol_gaps(VllmEngine) == []


def test_the_protocol_check_finds_what_an_engine_lacks():
    class NoPad(RolloutEngine):
        def __init__(self) -> None:
            self.version = 0

        def generate_batch(self, prompts, params, seed, between_steps=None, on_token=None, meta=None):  # swapped
            raise NotImplementedError

        def load_weights(self, state, version, strict):  # an extra parameter the producer never passes
            raise NotImplementedError

    gaps = protocol_gaps(NoPad)
    assert "attribute pad_token_id" in gaps
    assert any(g.startswith("generate_batch: parameter meta") for g in gaps)
    assert any(g.startswith("generate_batch: parameter on_token") for g in gaps)
    assert "load_weights: extra parameter strict without a default" in gaps


def test_library_code_uses_only_the_engine_protocol_members():
    # The producer and OPPO hold an Engine: an attribute outside the protocol would work with one engine only.
    members = set(Engine.__annotations__) | {n for n in vars(Engine) if not n.startswith("_")}
    root = Path(__file__).resolve().parents[2] / "a3po"
    used = {(m.group(1), str(f.relative_to(root))) for f in [*root.glob("producer/*.py"), *root.glob("oppo/*.py")]
            for m in re.finditer(r"\bself\.engine\.(\w+)", f.read_text())}
    assert used, "the producer calls its engine as self.engine"
    assert sorted((a, f) for a, f in used if a not in members) == []


def test_build_engine_torch_holds_the_given_weights_and_version():
    cfg = preset("micro")
    policy, tok = build_tiny_model("micro", WORDS, seed=0)
    other, _ = build_tiny_model("micro", WORDS, seed=1)
    engine = build_engine(policy, tok, clone_state(other), 7, cfg)
    assert engine.version == 7 and engine.model is not policy
    assert all(torch.equal(a, b) for a, b in zip(engine.model.state_dict().values(), other.state_dict().values(), strict=True))


def test_behaviour_mismatch_measures_a_known_offset():
    engine = torch.tensor([[0.0, -1.0, -2.0, -3.0]])
    trainer = torch.tensor([[5.0, -1.1, -2.0, -2.7]])  # column 0 is outside the mask
    mask = torch.tensor([[False, True, True, True]])
    m = behaviour_mismatch(engine, trainer, mask)
    # |diffs| on the mask: 0.1, 0, 0.3 -> mean 0.4/3, max 0.3
    assert m["rollout/behav_logp_abs_err"] == pytest.approx(0.4 / 3, abs=1e-6)
    assert m["rollout/behav_logp_abs_err_max"] == pytest.approx(0.3, abs=1e-6)
    # |exp(d) - 1| for d = 0.1, 0, -0.3
    assert m["rollout/behav_iw_err"] == pytest.approx((0.10517092 + 0 + 0.25918178) / 3, abs=1e-6)


def test_torch_engine_behaviour_logprobs_match_a_fresh_forward():
    # The torch engine decodes with a KV cache, the trainer runs one full forward: the same
    # math in another order, so equal to float32 rounding (the vLLM engine: rollout/test_vllm_engine.py).
    model, tok = build_tiny_model("micro", WORDS, seed=0)
    store = WeightStore()
    store.publish(0, clone_state(model))
    engine = RolloutEngine(model, tok.eos_token_id, tok.pad_token_id)
    prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in generate_split(6, "train", 0)]
    batch = engine.generate_batch(prompts, SamplingParams(8, temperature=0.7), seed=3)
    m = BehaviourCheck(model, store.get, 0.7)(batch)
    assert m["rollout/behav_logp_abs_err_max"] < 1e-5
    # a wrong record is seen: shift the engine's log-probs by 0.05 on every generated token
    batch.behav_logp = torch.where(batch.response_mask, batch.behav_logp - 0.05, batch.behav_logp)
    assert BehaviourCheck(model, store.get, 0.7)(batch)["rollout/behav_logp_abs_err"] == pytest.approx(0.05, abs=1e-4)


def test_metrics_mode_reports_the_engine_mismatch_per_step(core_stub_rewards):
    cfg = with_overrides(preset("micro"), rl={"variant": "recompute", "proximal": "metrics", "steps": 3},
                         rollout={"weight_updates": "batch"})
    model, tok = build_tiny_model("micro", WORDS, seed=0)
    train, held, _ = load_rows(cfg.data, tok)
    res = rl_train(cfg, model, tok, train, held, warmstart_acc=0.0)
    for h in res.history:
        assert 0.0 <= h["rollout/behav_logp_abs_err"] <= h["rollout/behav_logp_abs_err_max"] < 1e-5
    plain = rl_train(with_overrides(cfg, rl={"proximal": None}), *build_tiny_model("micro", WORDS, seed=0), train, held, warmstart_acc=0.0)
    assert "rollout/behav_logp_abs_err" not in plain.history[0]



# An engine owner (the process that builds VllmEngine) naming itself, or another process, as the
# owner, then starting a stand-in for vLLM's engine core, which runs the plugin as vLLM would.
_OWNER = """
import os, subprocess, sys, time
os.environ["A3PO_VLLM_ENGINE_OWNER"] = str(os.getpid()) if sys.argv[2] == "self" else "1"
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
print(child.pid, flush=True)
time.sleep(120)
"""
_ENGINE_CORE = """
import pathlib, sys, time
from a3po.rollout.vllm_support import die_with_the_engine_owner
die_with_the_engine_owner()
pathlib.Path(sys.argv[1]).write_text("armed")
time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("owner", ["self", "another"])
def test_a_process_the_engine_owner_starts_dies_with_it(tmp_path, owner):
    """vLLM's engine core outlives an owner killed with SIGKILL unless armed: a process started by
    the pid named in A3PO_VLLM_ENGINE_OWNER dies with it; one whose parent is not the named owner
    is left alone (the plugin runs in the owner itself too, and in processes it did not start)."""
    armed = tmp_path / "armed"
    code = _ENGINE_CORE.replace("sys.argv[1]", repr(str(armed)))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-c", _OWNER, code, owner], stdout=subprocess.PIPE, text=True, env=env)
    child = psutil.Process(int(proc.stdout.readline()))
    try:
        deadline = time.monotonic() + 30
        while not armed.exists():
            assert time.monotonic() < deadline and child.is_running(), "the stand-in never armed"
            time.sleep(0.05)
        proc.kill()
        proc.wait()
        gone, _ = psutil.wait_procs([child], timeout=10)
        assert (child in gone) == (owner == "self")
    finally:
        if child.is_running():
            child.kill()
