"""The runner: metrics pinned with a scripted "model", then the real tiny model end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import eval.runner as runner
from eval.data import fixture_path, load_benchmark
from eval.runner import EvalConfig, run_eval, truncate_at_stop
from eval.synthetic import natural_completion, wrong_answer


@pytest.fixture(scope="module")
def tiny():
    model, tok, _ = runner.load_model("tiny")
    return model, tok


def test_metrics_with_a_scripted_model(monkeypatch, tiny, tmp_path: Path) -> None:
    # Greedy: always right. Sampled: samples alternate right, wrong (2 of 4 correct per problem):
    # mean@4 = 0.5; pass@2 = 1 - C(2,2)/C(4,2) = 5/6; pass@4 = 1.
    records = load_benchmark("math500", fixture_path("math500"))
    gold_of = {}

    def scripted(model, tokenizer, prompts, cfg, sampled):
        if not gold_of:
            from eval.prompts import render

            gold_of.update({render(r.prompt, tokenizer): r.gold for r in records})
        return [natural_completion(wrong_answer(gold_of[p]) if sampled and i % 2 else gold_of[p]) for i, p in enumerate(prompts)]

    monkeypatch.setattr(runner, "_generate", scripted)
    res = run_eval(tiny, ["math500"], EvalConfig(n_samples=4), data_dir=fixture_path("math500").parent, out_dir=tmp_path)
    m = res["benchmarks"]["math500"]
    assert m["n_problems"] == 6 and m["pass@1"] == 1.0
    assert m["mean@4"] == pytest.approx(0.5) and m["pass@2"] == pytest.approx(5 / 6) and m["pass@4"] == 1.0
    lines = [json.loads(x) for x in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert len(lines) == 6 * (1 + 4)
    assert {"prompt", "completion", "extracted", "gold", "score"} <= set(lines[0])
    assert json.loads((tmp_path / "results.json").read_text())["benchmarks"]["math500"] == pytest.approx(m)


def _force_completion(model, tokenizer, text: str):
    """Make the real model write ``text`` then EOS, greedy or sampled: a forward hook replaces the
    last position's logits by +-1e4 on the scripted token. The decode step is read off the
    attention mask (the prefill's width, then one column more per step)."""
    script = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    state = {}

    def hook(module, args, kwargs, out):
        ids, attn = kwargs["input_ids"], kwargs["attention_mask"]
        if ids.shape[1] > 1:
            state["prefill"] = attn.shape[1]
        t = min(attn.shape[1] - state["prefill"], len(script) - 1)
        logits = out.logits.clone()
        logits[:, -1] = -1e4
        logits[:, -1, script[t]] = 1e4
        out.logits = logits
        return out

    return model.register_forward_hook(hook, with_kwargs=True)


def test_tiny_model_end_to_end(tiny, tmp_path: Path) -> None:
    # The real tiny model, generation, decoding, grading and aggregation, with the model's output
    # forced to "#### 3" for every prompt (greedy and sampled). Known from the data:
    #   arith, first 2 problems: golds "3" and "12" -> scores 1, 0: pass@1 = 0.5; both samples of
    #     each problem alike: mean@2 = 0.5, pass@2 = (1 + 0) / 2 = 0.5;
    #   math500 fixture, first 2: golds \frac{14}{3} and (3, pi/2): "3" equals neither -> all 0,
    #     yet an answer is found in every completion: no_answer_rate = 0.
    model, tok = tiny
    cfg = EvalConfig(max_new_tokens=8, n_samples=2, limit=2, batch_size=4)
    benches = ["math500", "arith"]
    handle = _force_completion(model, tok, "#### 3")
    try:
        res = run_eval(tiny, benches, cfg, data_dir=fixture_path("math500").parent, out_dir=tmp_path)
    finally:
        handle.remove()
    arith, math500 = res["benchmarks"]["arith"], res["benchmarks"]["math500"]
    assert (arith["n_problems"], arith["pass@1"], arith["mean@2"], arith["pass@2"], arith["no_answer_rate"]) == (2, 0.5, 0.5, 0.5, 0.0)
    assert (math500["n_problems"], math500["pass@1"], math500["mean@2"], math500["pass@2"], math500["no_answer_rate"]) == (2, 0.0, 0.0, 0.0, 0.0)
    lines = [json.loads(x) for x in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert len(lines) == len(benches) * 2 * (1 + 2)
    assert {x["completion"] for x in lines} == {"#### 3"}
    assert [x["score"] for x in lines if x["benchmark"] == "arith" and x["sample"] == "greedy"] == [1.0, 0.0]


def test_checkpoint_path_loads_the_same_weights(tiny, tmp_path: Path) -> None:
    import torch

    model, tok = tiny
    model.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    res = run_eval(str(tmp_path / "ckpt"), ["arith"], EvalConfig(max_new_tokens=4, limit=1), out_dir=tmp_path / "out")
    assert res["model"] == str(tmp_path / "ckpt") and res["benchmarks"]["arith"]["n_problems"] == 1
    loaded, _, _ = runner.load_model(str(tmp_path / "ckpt"))
    ids = torch.tensor([tok("Question: Mia has 3 pens.")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_checkpoint_tokenizer_round_trips(tiny, tmp_path: Path) -> None:
    model, tok = tiny
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    _, loaded_tok, _ = runner.load_model(str(tmp_path))
    assert loaded_tok("Question: Mia")["input_ids"] == tok("Question: Mia")["input_ids"]


def test_truncate_at_stop() -> None:
    assert truncate_at_stop("x = 5\n#### 5\nQuestion: next", runner.DEFAULT_STOPS) == "x = 5\n#### 5"
    assert truncate_at_stop("no stop", runner.DEFAULT_STOPS) == "no stop"


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="k=1"):
        EvalConfig(n_samples=4, ks=(1,))
    with pytest.raises(ValueError, match="nothing to do"):
        EvalConfig(greedy=False)
    assert runner.pass_ks(EvalConfig(n_samples=8)) == (2, 4, 8)


def test_a_model_folder_without_tokenizer_files_is_refused_when_loaded(tiny, tmp_path: Path) -> None:
    # Weights saved without the tokenizer: AutoTokenizer alone would build a one-token tokenizer
    # from config.json and the run would fail far later ("prompt 0 is empty").
    model, tok = tiny
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    with pytest.raises(FileNotFoundError) as refused:
        runner.load_model(str(folder))
    msg = str(refused.value)
    assert f"model folder {folder} has no tokenizer" in msg, msg
    assert "tokenizer.json" in msg and "vocab.json" in msg  # what it needs
    assert "config.json" in msg and "model.safetensors" in msg  # what it holds
    # The same folder once the tokenizer is saved beside the weights loads, with the same ids.
    tok.save_pretrained(folder)
    _, loaded, _ = runner.load_model(str(folder))
    assert loaded("12 + 30 = 42").input_ids == tok("12 + 30 = 42").input_ids
