"""LoRA (``model.lora``, :mod:`a3po.models.lora`): the config's ranges and refusals, the engine's
behaviour log-probs against the trainer's forward of the adapted model, the weight store holding
adapters only, a micro run per variant, resume, and the exported merged model.

All on the 15k-parameter "micro" Qwen2 model (hidden 32, MLP 64, one layer) in fp32. The engine
decodes merged weights with its own kernels, the trainer runs peft's ``W0 x + s B (A x)``: they
agree to float rounding, so log-probs are compared at the rollout tests' 1e-4.
"""

from __future__ import annotations

import copy

import pytest
import torch

from a3po.config import ConfigError, LoraConfig, RunPlan, config_from_dict, preset, warmstart_key, with_overrides
from a3po.data.arithmetic import WORDS
from a3po.data.datasets import load_rows
from a3po.models.decoders import decoder_for, llama_like
from a3po.models.factory import build_tiny_model, load_pretrained
from a3po.models.logprobs import token_logprobs
from a3po.models.lora import MergedWeights, apply_lora, load_trained_state, merged_model, trained_state, with_lora
from a3po.placement.in_process import RolloutInputs, local_producer
from a3po.producer.weight_store import WeightStore, clone_state
from a3po.rollout.types import SamplingParams
from a3po.storage.checkpoint import load_checkpoint
from a3po.training.loop import rl_train
from tests.support.resume import assert_same_final_state, run_interrupted_and_resumed

pytestmark = pytest.mark.usefixtures("core_one_thread")

TOL = 1e-4
LORA = {"r": 4, "alpha": 8.0}
# Adapter parameters of the micro model at r = 4 with the default targets, A (r, in) + B (out, r):
# q, k, v, o (32 -> 32): 4 * (4*32 + 32*4) = 1024; gate, up (32 -> 64): 2 * (4*32 + 64*4) = 768;
# down (64 -> 32): 4*64 + 32*4 = 384. 2176 floats, 8704 bytes, 14 tensors (an A and a B per layer).
MICRO_ADAPTER_BYTES = 2176 * 4


def _micro_policy(seed: int = 0, r: int = 4):
    """The micro model with adapters whose B is random (not 0), so they change what it computes."""
    model, tok = build_tiny_model("micro", WORDS, seed=seed)
    base = copy.deepcopy(model)
    policy = apply_lora(model, LoraConfig(r=r, alpha=8.0))
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(1)
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    return policy, base, tok


# --- config -------------------------------------------------------------------------------------


@pytest.mark.parametrize("lora, field", [
    ({"r": 0}, "model.lora.r"),
    ({"alpha": 0.0}, "model.lora.alpha"),
    ({"dropout": 1.0}, "model.lora.dropout"),
    ({"dropout": -0.1}, "model.lora.dropout"),
    ({"target_modules": []}, "model.lora.target_modules"),
    ({"target_modules": ["q_proj", " "]}, "model.lora.target_modules"),
])
def test_lora_ranges_are_checked_when_the_config_is_built(lora, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        config_from_dict({"model": {"lora": lora}})


@pytest.mark.parametrize("sections, reason", [
    ({"rl": {"advantage": "gae"}, "ppo": {"critic": "policy_copy"}}, "ppo.critic 'policy_copy'"),
])
def test_combinations_lora_cannot_run_are_refused_with_the_reason(sections, reason):
    config_from_dict(sections)  # each runs without LoRA
    with pytest.raises(ConfigError, match=f"{reason}.*model.lora|model.lora.*{reason}"):
        config_from_dict({**sections, "model": {"lora": LORA}})


def test_lora_is_off_by_default_and_read_from_yaml_values():
    assert config_from_dict({}).model.lora is None
    cfg = config_from_dict({"model": {"lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]}}})
    assert cfg.model.lora == LoraConfig(r=4, alpha=16.0, target_modules=("q_proj", "v_proj"), dropout=0.0)
    # The warm start is full fine-tuning either way: LoRA and full-fine-tuning runs share it.
    assert warmstart_key(cfg, {}) == warmstart_key(config_from_dict({}), {})


# --- the model ----------------------------------------------------------------------------------


def test_only_the_adapters_train_and_the_fast_decoder_is_not_used_on_peft_layers():
    policy, base, _ = _micro_policy()
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert len(trainable) == 14 and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert sum(p.numel() for n, p in policy.named_parameters() if n in trainable) == MICRO_ADAPTER_BYTES // 4
    # llama_like reads q_proj.weight directly: on peft's layers it would decode without the adapters.
    assert llama_like(base) is not None and llama_like(policy) is None
    with pytest.raises(ValueError, match="does not support"):
        decoder_for(policy, "llama_like")


def test_merged_weights_equal_peft_merge_and_unload():
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    policy, base, _ = _micro_policy()
    merged = MergedWeights(policy)(clone_state(policy))
    # peft's own merge of the same adapters (W0 += B @ A * s in its code).
    other = get_peft_model(copy.deepcopy(base), PeftLoraConfig(r=4, lora_alpha=8.0, target_modules=list(LoraConfig().target_modules)))
    load_trained_state(other.get_base_model(), clone_state(policy))
    reference = other.merge_and_unload().state_dict()
    assert merged.keys() == reference.keys() == base.state_dict().keys()
    for k in reference:
        torch.testing.assert_close(merged[k], reference[k], rtol=0, atol=1e-6)
    moved = [k for k in reference if not torch.equal(reference[k], base.state_dict()[k])]
    assert len(moved) == 7  # the seven adapted projections, nothing else


def test_engine_behaviour_logprobs_equal_the_trainers_for_the_adapted_model():
    policy, base, tok = _micro_policy()
    cfg = with_overrides(preset("micro"), model={"lora": LORA})
    store = WeightStore()
    store.publish(0, clone_state(policy))
    v0 = clone_state(policy)
    with torch.no_grad():  # version 1: other adapters (as after an update)
        for name, p in policy.named_parameters():
            if "lora_A" in name:
                p.mul_(-1.5)
    store.publish(1, clone_state(policy))
    rows = load_rows(cfg.data, tok)[0]
    inputs = RolloutInputs(cfg, RunPlan.of(cfg, cores=1), policy, tok, rows, score=lambda c, m: [0.0] * len(c))
    producer = local_producer(inputs, store, start=0)
    engine = producer.engine
    assert decoder_for(engine.model) is not None and llama_like(engine.model) is not None  # the fast path, on plain weights
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ("Question: Mia has 23 pens.", "Question: Sam", "Question: 7")]
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    # The engine starts on the newest version (1); then loads version 0's adapters.
    for version, adapters in ((1, clone_state(policy)), (0, v0)):
        if engine.version != version:
            engine.load_weights(store.get(version), version)
        b = engine.generate_batch(prompts, params, seed=3)
        load_trained_state(policy, adapters)
        with torch.no_grad():
            trainer = token_logprobs(policy, b.input_ids, b.attention_mask, 1.0, start=b.prompt_len, share_prompt=True)
            plain_base = token_logprobs(base, b.input_ids, b.attention_mask, 1.0, start=b.prompt_len)
        m = b.response_mask
        assert int(m.sum()) >= 10 and bool((b.versions[m] == version).all())
        torch.testing.assert_close(b.behav_logp[m], trainer[m], rtol=0, atol=TOL)
        # The adapters matter: without them the log-probs are far off (so the check above can fail).
        assert (b.behav_logp[m] - plain_base[m]).abs().max() > 0.05


def test_the_store_holds_adapter_tensors_only_and_is_smaller():
    policy, base, tok = _micro_policy()
    lora_store, full_store = WeightStore(), WeightStore()
    lora_store.publish(0, clone_state(policy))
    full_store.publish(0, clone_state(base))
    held = lora_store.get(0)
    assert len(held) == 14 and all(".lora_A." in k or ".lora_B." in k for k in held)
    assert lora_store.nbytes() == MICRO_ADAPTER_BYTES
    # Full weights: the layer's q, k, v with biases 3 * (32*32 + 32), o 32*32, gate and up 2 * 32*64,
    # down 64*32, two norms 2 * 32 (10400), the final norm 32, and the V x 32 embedding listed twice
    # (lm_head is tied to it, and the state dict names both).
    assert full_store.nbytes() == (10400 + 32 + 2 * len(tok) * 32) * 4
    assert full_store.nbytes() > 9 * lora_store.nbytes()
    # A version is a copy: training the policy afterwards leaves it as it was.
    before = {k: v.clone() for k, v in held.items()}
    with torch.no_grad():
        next(p for n, p in policy.named_parameters() if "lora_B" in n).add_(1.0)
    assert all(torch.equal(before[k], held[k]) for k in held)


def test_adapter_state_must_match_and_a_second_wrap_is_checked():
    policy, base, _ = _micro_policy()
    with pytest.raises(ValueError, match="not the adapters"):
        load_trained_state(policy, base.state_dict())
    assert with_lora(policy, LoraConfig(r=4, alpha=8.0)) is policy
    with pytest.raises(ValueError, match="not those model.lora asks for"):
        with_lora(policy, LoraConfig(r=8))
    with pytest.raises(ValueError, match="model.lora is null"):
        with_lora(policy, None)
    with pytest.raises(ValueError, match="not linear layers"):
        apply_lora(copy.deepcopy(base), LoraConfig(target_modules=("embed_tokens",)))


# --- runs -----------------------------------------------------------------------------------------


def _lora_run(variant: str = "loglinear", ckpt_dir=None, progress=None, steps: int = 4):
    cfg = with_overrides(preset("micro"), model={"lora": LORA}, rl={"variant": variant, "steps": steps})
    model, tok = build_tiny_model("micro", WORDS, seed=0)
    train, held, _ = load_rows(cfg.data, tok)
    res = rl_train(cfg, model, tok, train, held, ckpt_dir=ckpt_dir, warmstart_acc=0.0, progress=progress)
    return res, model


@pytest.mark.parametrize("variant", ["sync", "recompute", "loglinear"])
def test_a_micro_run_trains_the_adapters_alone_and_checkpoints_them(core_stub_rewards, variant, tmp_path):
    base, _ = build_tiny_model("micro", WORDS, seed=0)
    res, policy = _lora_run(variant, ckpt_dir=str(tmp_path))
    assert len(res.history) == 4 and all(torch.isfinite(torch.tensor(h["loss/policy"])) for h in res.history)
    # The base weights are the warm start's, bit for bit; the adapters moved off B = 0.
    frozen = MergedWeights(policy)
    held = {**frozen.rest, **{f"{name}.weight": w0 for name, (w0, _) in frozen.adapted.items()}}
    assert held.keys() == base.state_dict().keys()
    assert all(torch.equal(held[k], v) for k, v in base.state_dict().items())
    assert any(p.abs().max() > 0 for n, p in policy.named_parameters() if "lora_B" in n)
    # sync keeps one version (the newest); the async variants (s = 2, deterministic) two: 0..2 and the newest.
    kept = 1 if variant == "sync" else 2
    assert res.history[-1]["weights/store_mb"] == kept * MICRO_ADAPTER_BYTES / 2**20
    state = load_checkpoint(tmp_path / "step_000004")
    assert state["policy"].keys() == trained_state(policy).keys()
    assert all(torch.equal(state["policy"][k], v) for k, v in trained_state(policy).items())
    assert len(state["optimizer"]["state"]) == 14  # AdamW moments of the 14 adapter tensors only
    assert all(w.keys() == state["policy"].keys() for w in state["weights_history"].values())


def test_a_resumed_lora_run_equals_the_uninterrupted_one(core_stub_rewards, tmp_path):
    full = _lora_run(steps=6)
    resumed = run_interrupted_and_resumed(lambda d, p: _lora_run(ckpt_dir=d, progress=p, steps=6), tmp_path, kill_at=5)
    assert resumed[0].resumed_from == 4
    assert_same_final_state((resumed[0], resumed[1].state_dict()), (full[0], full[1].state_dict()))


@pytest.mark.slow  # ~5 s: a warm start and a run saved as model folders, two evaluations
def test_the_exported_model_is_the_merged_policy_in_a_plain_folder(core_stub_rewards, tmp_path):
    from a3po.training.run import prepare_warmstart, train_variant

    cfg = with_overrides(preset("micro"), model={"lora": LORA}, rl={"steps": 2, "eval_samples": 1}, warm_start={"steps": 0},
                         data={"n_heldout": 4})
    ws_dir, ws_acc = prepare_warmstart(cfg, tmp_path / "cache", log=lambda _: None)
    train_variant(cfg, tmp_path / "run", ws_dir, ws_acc)
    exported, tok = load_pretrained(tmp_path / "run" / "final")
    assert not any("lora" in k or "base_layer" in k for k in exported.state_dict())
    state = load_checkpoint(tmp_path / "run" / "checkpoints" / "step_000002")
    policy, _ = load_pretrained(ws_dir)
    policy = apply_lora(policy, cfg.model.lora)
    load_trained_state(policy, state["policy"])
    assert any(p.abs().max() > 0 for n, p in policy.named_parameters() if "lora_B" in n)
    ids = torch.tensor([tok("Question: Mia has 23 pens. She buys 4", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, policy(ids).logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(exported(ids).logits, merged_model(policy)(ids).logits, rtol=0, atol=0)
