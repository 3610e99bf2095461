"""Precision: ``dtype: auto`` computes in bf16 (autocast on fp32 master weights and AdamW state,
a bf16 rollout engine) where the hardware has native bf16 and in fp32 elsewhere; ``dtype:
bfloat16`` on a CPU that emulates bf16 runs with a warning; a checkpoint moves between the
precisions ``auto`` resolves to with a warning and is refused under another dtype, naming both.
The machine's detection is simulated by handing the plan its result (``native_bf16``), so each
branch is tested on any CPU; one test uses the real detection and is skipped where bf16 is emulated."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from a3po.algorithms.proximal import PROXIMAL_METHODS
from a3po.config import RLConfig, RunPlan, config_from_dict, preset, with_overrides
from a3po.data.arithmetic import WORDS
from a3po.data.datasets import load_rows
from a3po.devices import (
    DType,
    autocast_for,
    autocasts,
    cpu_native_bf16,
    resolve_precision,
    set_autocast,
)
from a3po.models.factory import build_tiny_model, empty_like
from a3po.models.logprobs import token_logprobs
from a3po.parallel.ranks import Ranks
from a3po.producer.weight_store import clone_state
from a3po.rollout.engines import build_engine
from a3po.storage.checkpoint import CheckpointError, load_latest_checkpoint
from a3po.training.step import train_step
from bench.prox_logp import make_scored_batch

pytestmark = pytest.mark.usefixtures("core_one_thread")

# /proc/cpuinfo lines of a CPU with AMX (and AVX512-BF16), one with AVX512-BF16 alone, one with neither.
AMX = "processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 amx_tile amx_bf16\n"
AVX512_BF16 = "processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16\n"
NONE = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f\n"
HERE = cpu_native_bf16()


def test_cpu_flags_decide_native_bf16():
    assert cpu_native_bf16(AMX) == "amx_bf16"
    assert cpu_native_bf16(AVX512_BF16) == "avx512_bf16"
    assert cpu_native_bf16(NONE) is None
    assert cpu_native_bf16("model name\t: amx_bf16 in a name, not a flag\n") is None


def test_auto_is_bf16_autocast_on_fp32_weights_where_native_and_fp32_elsewhere():
    mixed = resolve_precision("auto", "cpu", "amx_bf16")
    assert (mixed.weights, mixed.autocast, mixed.engine, mixed.name) == (
        DType.FLOAT32,
        True,
        DType.BFLOAT16,
        "bf16-autocast",
    )
    assert "amx_bf16" in mixed.reason
    plain = resolve_precision("auto", "cpu", None)  # a CPU that emulates bf16: auto never picks it
    assert (plain.weights, plain.autocast, plain.engine, plain.name) == (DType.FLOAT32, False, DType.FLOAT32, "float32")
    assert "neither amx_bf16 nor avx512_bf16" in plain.reason
    # float32 stays the identity whatever the CPU has: the existing runs are unchanged.
    assert resolve_precision("float32", "cpu", "amx_bf16") == resolve_precision("float32", "cpu", None)
    assert not resolve_precision("float32", "cpu", "amx_bf16").autocast


def test_bfloat16_where_emulated_runs_with_a_warning_naming_why():
    slow = resolve_precision("bfloat16", "cpu", None)
    assert slow.slow and slow.weights is DType.BFLOAT16
    assert "emulated" in slow.reason and "amx_bf16" in slow.reason and "float32" in slow.reason
    assert not resolve_precision("bfloat16", "cpu", "avx512_bf16").slow


def test_the_plan_resolves_precision_and_the_engine_dtype():
    auto = with_overrides(preset("micro"), dtype="auto")
    native = RunPlan.of(auto, cores=1, native_bf16="amx_bf16")
    assert native.precision.autocast and native.engine_dtype is DType.BFLOAT16
    lacking = RunPlan.of(auto, cores=1, native_bf16=None)
    assert not lacking.precision.autocast and lacking.engine_dtype is DType.FLOAT32
    # an explicit rollout.dtype wins over the precision's choice
    asked = RunPlan.of(with_overrides(auto, rollout={"dtype": "float32"}), cores=1, native_bf16="amx_bf16")
    assert asked.precision.autocast and asked.engine_dtype is DType.FLOAT32
    assert RunPlan.of(preset("micro"), cores=1, native_bf16="amx_bf16").precision.name == "float32"


def test_rollout_dtype_auto_is_refused_and_presets_choose_as_documented():
    with pytest.raises(ValueError, match="rollout.dtype must be null .*got 'auto'"):
        config_from_dict({"rollout": {"dtype": "auto"}})
    assert preset("smol").dtype is DType.AUTO  # the pretrained model
    assert preset("tiny").dtype is DType.FLOAT32 and preset("micro").dtype is DType.FLOAT32


def test_the_engine_copy_is_bf16_when_the_plan_asks_and_fp32_otherwise():
    policy, tok = build_tiny_model("micro", WORDS, seed=0)
    cfg = with_overrides(preset("micro"), dtype="auto")
    for native, want in (("amx_bf16", torch.bfloat16), (None, torch.float32)):
        plan = RunPlan.of(cfg, cores=1, native_bf16=native)
        engine = build_engine(policy, tok, clone_state(policy), 0, cfg, plan.engine_dtype)
        assert {p.dtype for p in engine.model.parameters()} == {want}, native
        assert not autocasts(engine.model)  # bf16 weights run bf16 kernels; no autocast on top


def _linear_dtypes(model: torch.nn.Module) -> list[tuple[bool, torch.dtype]]:
    """(grad enabled, output dtype) of every call of the model's first Linear, recorded by a hook."""
    seen: list[tuple[bool, torch.dtype]] = []
    linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    linear.register_forward_hook(lambda mod, inp, out: seen.append((torch.is_grad_enabled(), out.dtype)))
    return seen


def test_a_marked_policy_trains_in_bf16_with_fp32_weights_state_and_log_probs():
    model, tok = build_tiny_model("micro", WORDS, seed=0)
    scored = make_scored_batch(model, tok, n_prompts=4, group_size=2, max_new_tokens=8, seed=0)
    set_autocast(model, True)
    seen = _linear_dtypes(model)
    init = clone_state(model)
    # A learning rate whose update bf16 weights would round away: |dw| ~ 1e-7 per step against
    # weights ~0.02-1, whose bf16 spacing is 2^-8 relative (~1e-4 at 0.02). fp32 keeps 2^-23 (~2e-9).
    cfg = RLConfig(
        variant="recompute", batch_prompts=4, group_size=2, minibatches=2, max_new_tokens=8, temperature=1.0, lr=1e-7
    )
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    metrics = train_step(model, opt, scored, 1, cfg, PROXIMAL_METHODS.get("recompute"))
    assert metrics["policy/grad_norm"] > 0
    assert {d for grad, d in seen if grad} == {torch.bfloat16}  # the trainer's forward ran under autocast
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    states = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
    assert states and {t.dtype for t in states} == {torch.float32}  # AdamW's moments
    after = model.state_dict()
    moved = sum(int((after[k] != init[k]).sum()) for k in init)
    moved_in_bf16 = sum(int((after[k].bfloat16() != init[k].bfloat16()).sum()) for k in init)
    # fp32 master weights keep the small update (every weight with a gradient moves by ~lr); held in
    # bf16, ~1e-7 / 1e-4 of them would cross a rounding step, i.e. almost all of it would be lost.
    assert moved > 1000 and moved_in_bf16 < 0.1 * moved
    b = scored.rollout
    with torch.no_grad(), autocast_for(model):
        assert model(b.input_ids[:2]).logits.dtype == torch.bfloat16
    with torch.no_grad():  # the log-probs are still fp32 (logits .float() before log_softmax)
        assert token_logprobs(model, b.input_ids, b.attention_mask).dtype == torch.float32


def test_a_copy_like_the_policy_computes_like_it_and_one_in_another_dtype_does_not():
    policy, _ = build_tiny_model("micro", WORDS, seed=0)
    set_autocast(policy, True)
    assert autocasts(empty_like(policy))  # the re-scoring copy (trainer precision)
    assert not autocasts(empty_like(policy, torch.bfloat16))


def test_held_out_figures_decode_from_the_engines_weights_and_leave_the_policy_as_it_is(monkeypatch):
    """Under auto where bf16 is native, the held-out evaluation (step 0, in the run, final) decodes
    from a bf16 copy, as the rollout engine does, and the autocast policy keeps its fp32 weights and
    mark; under float32 it decodes from the policy itself, no copy."""
    import a3po.devices
    import a3po.training.heldout as heldout

    policy, tok = build_tiny_model("micro", WORDS, seed=0)
    _, rows, _ = load_rows(preset("micro").data, tok)
    seen = []
    monkeypatch.setattr(heldout, "generate_text", lambda model, tokenizer, prompts, *a, **k: seen.append(
        (next(model.parameters()).dtype, autocasts(model), model is policy)) or [""] * len(prompts))
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    for dtype, native, expected in (("auto", "amx_bf16", (torch.bfloat16, False, False)),
                                    ("float32", "amx_bf16", (torch.float32, False, True))):
        monkeypatch.setattr(a3po.devices, "native_bf16", lambda device, native=native: native)
        set_autocast(policy, dtype == "auto")  # as the loop marks it under each
        seen.clear()
        heldout.heldout_evaluation(policy, tok, rows[:2], with_overrides(preset("micro"), dtype=dtype))
        assert seen and set(seen) == {expected}, dtype
        assert autocasts(policy) == (dtype == "auto") and next(policy.parameters()).dtype == torch.float32
        assert all(torch.equal(v, before[k]) for k, v in policy.state_dict().items())


def _run(tmp_path, native: str | None, dtype: str = "auto", steps: int = 1, **rl):
    from a3po.training.loop import rl_train

    cfg = with_overrides(
        preset("micro"),
        dtype=dtype,
        rl={"steps": steps, "variant": "sync", "checkpoint_every": 1, **rl},
        update_threads=1,
    )
    plan = RunPlan.of(cfg, cores=1, native_bf16=native)
    model, tok = build_tiny_model("micro", WORDS, seed=0)
    seen = _linear_dtypes(model)
    train, held, _ = load_rows(cfg.data, tok)
    res = rl_train(
        cfg, model, tok, train, held, ckpt_dir=str(tmp_path / "ckpt"), warmstart_acc=0.0, ranks=Ranks(), plan=plan
    )
    return res, seen


def test_auto_through_the_loop_trains_in_bf16_where_native_and_in_fp32_where_not(tmp_path, core_stub_rewards):
    res, seen = _run(tmp_path / "native", "amx_bf16")
    assert {d for grad, d in seen if grad} == {torch.bfloat16}
    _, state = load_latest_checkpoint(tmp_path / "native" / "ckpt")
    assert state["precision"] == "bf16-autocast"
    assert {t.dtype for t in state["policy"].values()} == {torch.float32}  # master weights
    moments = [
        t for s in state["optimizer"]["state"].values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1
    ]
    assert moments and {t.dtype for t in moments} == {torch.float32}
    res, seen = _run(tmp_path / "lacking", None)  # auto on a CPU that lacks bf16 (simulated)
    assert {d for grad, d in seen if grad} == {torch.float32}
    assert load_latest_checkpoint(tmp_path / "lacking" / "ckpt")[1]["precision"] == "float32"


def test_the_bf16_engines_error_against_the_trainer_is_measured(tmp_path, core_stub_rewards):
    # rl.proximal metrics re-scores each batch with a copy that computes as the trainer does (autocast here).
    res, _ = _run(tmp_path / "auto", "amx_bf16", steps=2, variant="recompute", proximal="metrics")
    errs = [h["rollout/behav_logp_abs_err"] for h in res.history]
    # bf16 engine vs bf16-autocast trainer on fp32 weights: the residual stream, norms and the KV-cache
    # decode round differently; on the micro model ~5e-4 nats mean, 3e-3 max (fp32 against itself: < 1e-5,
    # tests/rollout/test_engines.py), and far below a wrong token or temperature (> 0.1).
    assert all(1e-5 < e < 0.05 for e in errs), errs


@pytest.mark.skipif(
    HERE is None, reason="this CPU reports neither amx_bf16 nor avx512_bf16: auto computes in fp32 here"
)
def test_auto_on_this_cpu_detects_its_native_bf16(tmp_path, core_stub_rewards):
    from a3po.training.loop import rl_train

    cfg = with_overrides(preset("micro"), dtype="auto", rl={"steps": 1, "variant": "sync"}, update_threads=1)
    model, tok = build_tiny_model("micro", WORDS, seed=0)
    seen = _linear_dtypes(model)
    train, held, _ = load_rows(cfg.data, tok)
    rl_train(cfg, model, tok, train, held, warmstart_acc=0.0, ranks=Ranks())  # the loop resolves the plan itself
    assert {d for grad, d in seen if grad} == {torch.bfloat16}


def test_a_checkpoint_resumes_in_the_other_precision_auto_resolves_to_with_a_warning(
    tmp_path, core_stub_rewards, caplog
):
    _run(tmp_path, "amx_bf16", steps=2)
    shutil.rmtree(tmp_path / "ckpt" / "step_000002")  # as if stopped after step 1
    with caplog.at_level(logging.WARNING, logger="a3po.training.run_state"):
        res, seen = _run(tmp_path, None, steps=2)
    assert res.resumed_from == 1 and len(res.history) == 2
    assert any("computing in bf16-autocast; resuming it in float32" in r.getMessage() for r in caplog.records)
    assert {d for grad, d in seen if grad} == {torch.float32}
    assert load_latest_checkpoint(tmp_path / "ckpt")[1]["precision"] == "float32"  # what it computes in now


def test_a_checkpoint_of_another_dtype_is_refused_naming_both(tmp_path, core_stub_rewards):
    _run(tmp_path, "amx_bf16", dtype="float32", steps=1)
    with pytest.raises(CheckpointError, match=r"\(dtype differ\) \(dtype: saved float32, now auto\)"):
        _run(tmp_path, "amx_bf16", dtype="auto", steps=1)


def test_bfloat16_where_emulated_is_warned_once_at_start(tmp_path, core_stub_rewards, monkeypatch, caplog):
    import a3po.training.run as run

    monkeypatch.setattr(run, "native_bf16", lambda device: None)  # a CPU without AMX / AVX512-BF16
    cfg = with_overrides(preset("micro"), dtype="bfloat16", rl={"steps": 1, "variant": "sync"}, update_threads=1)
    ws, acc = run.prepare_warmstart(cfg, tmp_path / "cache", log=lambda s: None)
    with caplog.at_level(logging.INFO, logger="a3po.training.run"):
        run.train_variant(cfg, tmp_path / "run", ws, acc)
    said = [r for r in caplog.records if r.name == "a3po.training.run"]
    assert [(r.levelno, "emulated" in r.getMessage()) for r in said] == [(logging.WARNING, True)], said
    assert "neither amx_bf16 nor avx512_bf16" in said[0].getMessage()
