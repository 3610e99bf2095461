"""Device and dtype settings on the CPU: the config fields are checked when built, ``auto``
picks what is there, a CUDA request without CUDA fails with a clear error before any work, CPU
fp32 warm-start caches keep their keys, and bf16 weights run rollout and training with fp32
log-probs. The CUDA paths themselves are in tests/test_gpu.py (``make test-gpu``)."""

from __future__ import annotations

import pytest
import torch

from a3po.algorithms.proximal import PROXIMAL_METHODS
from a3po.config import RLConfig, TrainConfig, Variant, config_from_dict, config_to_dict, load_config, preset, proximal_method_name
from a3po.data.arithmetic import WORDS
from a3po.devices import Device, DType, resolve_device
from a3po.models.factory import build_tiny_model, empty_like, load_model, load_tokenizer
from a3po.models.logprobs import token_logprobs
from a3po.producer.weight_store import clone_state
from a3po.training.run import build_model, warmstart_folder
from a3po.training.step import train_step
from bench.prox_logp import make_scored_batch

pytestmark = pytest.mark.usefixtures("core_one_thread")

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised when CUDA is absent")


def test_device_and_dtype_fields_default_parse_and_round_trip(tmp_path):
    cfg = preset("micro")
    assert (cfg.device, cfg.dtype) == (Device.AUTO, DType.FLOAT32)
    d = config_to_dict(cfg)
    assert (d["device"], d["dtype"]) == ("auto", "float32")  # plain strings: YAML, JSON and MLflow params
    path = tmp_path / "c.yaml"
    path.write_text("device: cpu\ndtype: bfloat16\nrl: {steps: 2}\n")
    loaded = load_config(path)
    assert (loaded.device, loaded.dtype, loaded.dtype.torch) == (Device.CPU, DType.BFLOAT16, torch.bfloat16)
    assert config_from_dict(config_to_dict(loaded)) == loaded


@pytest.mark.parametrize("field,value", [("device", "gpu"), ("device", "cuda:0"), ("dtype", "float16"), ("dtype", "bf16")])
def test_unknown_device_or_dtype_raises_naming_the_field_and_the_choices(field, value):
    with pytest.raises(ValueError, match=rf"{field} must be one of .*got '{value}'"):
        TrainConfig(**{field: value})  # the dataclass's own check
    with pytest.raises(ValueError, match=rf"{field}.*'{value}'") as e:
        config_from_dict({field: value})  # the builder's (its wording may differ), same facts
    assert "cuda" in str(e.value) or "bfloat16" in str(e.value)  # the valid choices are listed


def test_auto_resolves_to_what_is_there_and_cpu_is_cpu():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


@needs_no_cuda
def test_cuda_without_cuda_fails_before_any_work(tmp_path, capsys):
    with pytest.raises(RuntimeError, match="device 'cuda' was requested but torch.cuda.is_available\\(\\) is False"):
        resolve_device("cuda")
    from cli import main

    # Checked with the config, before the model is built: one line naming the field, exit 2.
    assert main(["train", "--preset", "micro", "--device", "cuda", "--output-dir", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("a3po train: error: device: device 'cuda' was requested"), err
    assert not any(tmp_path.rglob("*.safetensors"))  # nothing was trained


def test_cli_rejects_an_unknown_device(capsys):
    from cli import main

    with pytest.raises(SystemExit):
        main(["train", "--device", "tpu"])
    assert "invalid choice: 'tpu'" in capsys.readouterr().err


def test_cpu_float32_warmstart_cache_keeps_its_key_and_bf16_gets_another():
    cfg = config_from_dict({**config_to_dict(preset("micro")), "device": "cpu"})
    # The key the micro preset's warm start had before device/dtype existed (a run of main at 4c45f24).
    assert warmstart_folder(cfg, "cache").name == "warmstart-192d261a74f6350b"
    bf16 = config_from_dict({**config_to_dict(cfg), "dtype": "bfloat16"})
    assert warmstart_folder(bf16, "cache") != warmstart_folder(cfg, "cache")
    # The step-0 held-out figure decodes from the engine's weights: an fp32 run with a bf16 engine has
    # another figure, so another warm start record.
    bf16_engine = config_from_dict({**config_to_dict(cfg), "rollout": {"dtype": "bfloat16"}})
    assert warmstart_folder(bf16_engine, "cache") != warmstart_folder(cfg, "cache")


def test_build_model_places_weights_in_the_configured_dtype():
    cfg = config_from_dict({"model": {"name": "micro"}, "device": "cpu", "dtype": "bfloat16"})
    model, _ = build_model(cfg)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    # Initialised in fp32 and then cast: the same starting point as the fp32 model, rounded.
    fp32, _ = build_model(config_from_dict({"model": {"name": "micro"}, "device": "cpu"}))
    for (k, a), b in zip(model.state_dict().items(), fp32.state_dict().values(), strict=True):
        assert torch.equal(a, b.to(torch.bfloat16)), k


@pytest.mark.parametrize("policy_dtype,asked",
                         [(torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.bfloat16)])
def test_empty_like_is_the_policys_class_config_device_and_dtype_and_loads_its_logits_exactly(policy_dtype, asked):
    policy, _ = build_tiny_model("micro", WORDS, seed=3, dtype=policy_dtype)
    model = empty_like(policy, asked)
    assert type(model) is type(policy) and model is not policy
    assert model.config.to_dict() == policy.config.to_dict()
    assert {p.dtype for p in model.parameters()} == {asked or policy_dtype}
    assert {p.device for p in model.parameters()} == {next(policy.parameters()).device}
    ids = torch.tensor([[3, 7, 11, 5, 9]])
    model.eval()
    with torch.no_grad():
        assert not torch.equal(model(ids).logits, policy(ids).logits)  # fresh weights: only loading makes them equal
        model.load_state_dict(policy.state_dict())
        if asked is None:
            assert torch.equal(model(ids).logits, policy(ids).logits)
        else:  # the policy's weights rounded to the asked dtype: the same forward as the policy cast there
            assert torch.equal(model(ids).logits, policy.to(asked)(ids).logits)


def test_a_built_in_size_needs_the_tasks_vocabulary():
    with pytest.raises(ValueError, match="model 'micro' is built from scratch: its tokenizer needs the task's"):
        load_model("micro")
    with pytest.raises(ValueError, match="model 'micro' is built from scratch"):
        load_tokenizer("micro")
    tok = load_tokenizer("micro", words=WORDS)
    assert tok.get_vocab() == load_model("micro", words=WORDS)[1].get_vocab() and "apples" in tok.get_vocab()


def test_bf16_rollout_and_train_step_keep_log_probs_and_losses_in_fp32():
    model, tok = build_tiny_model("tiny", WORDS, seed=0, dtype=torch.bfloat16)
    scored = make_scored_batch(model, tok, n_prompts=4, group_size=2, max_new_tokens=8, seed=0)
    b = scored.rollout
    assert b.behav_logp.dtype == torch.float32
    with torch.no_grad():
        fresh = token_logprobs(model, b.input_ids, b.attention_mask)
    assert fresh.dtype == torch.float32
    m = b.response_mask
    # bf16 keeps 8 mantissa bits (relative 2^-8 ~ 0.004 per rounding); the KV-cache decode and a
    # full forward round differently. Measured: max 0.002 on log-probs of magnitude ~5.7, so
    # 0.02 is loose for rounding and still far below a wrong temperature or token (> 0.1).
    torch.testing.assert_close(b.behav_logp[m], fresh[m], rtol=0, atol=0.02)
    init = clone_state(model)
    for variant in Variant:
        model.load_state_dict(init)
        cfg = RLConfig(variant=variant, batch_prompts=4, group_size=2, minibatches=2, max_new_tokens=8, temperature=1.0, lr=1e-2)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
        metrics = train_step(model, opt, scored, 1, cfg, PROXIMAL_METHODS.get(proximal_method_name(cfg)))
        assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), variant
        assert metrics["policy/grad_norm"] > 0
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        assert any(not torch.equal(a, b) for a, b in zip(init.values(), model.state_dict().values(), strict=True)), variant
