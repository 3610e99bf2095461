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


def test_tiny_model_end_to_end(tiny, tmp_path: Path) -> None:
    cfg = EvalConfig(max_new_tokens=4, n_samples=2, limit=2, batch_size=4)
    benches = ["math500", "arith"]
    res = run_eval(tiny, benches, cfg, data_dir=fixture_path("math500").parent, out_dir=tmp_path)
    for b in benches:
        m = res["benchmarks"][b]
        assert m["n_problems"] == 2 and 0.0 <= m["pass@1"] <= 1.0 and {"mean@2", "pass@2"} <= set(m)
    assert len((tmp_path / "records.jsonl").read_text().splitlines()) == len(benches) * 2 * (1 + 2)


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
