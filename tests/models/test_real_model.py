"""Bringing a real model and dataset: a model directory with a chat template, a JSONL dataset in
GSM8K's schema (question / answer, no solutions) and no warm start.

The model is the micro Qwen2 with the in-code tokenizer, given a small chat template and saved
with ``save_pretrained``, so it loads through the same path as a downloaded chat model. The
expected prompts are written out by hand from the template below.
"""

from __future__ import annotations

import json

import pytest
import torch

from a3po.config import ConfigError, config_from_dict, preset, with_overrides
from a3po.data.arithmetic import WORDS
from a3po.data.datasets import BadRowError, load_rows
from a3po.models.factory import build_tiny_model, load_pretrained
from a3po.producer.producer import PromptSampler
from a3po.training.run import prepare_warmstart, train_variant
from a3po.training.warmstart import warm_start

# Only characters and words the in-code tokenizer knows, so decoding gives the text back.
CHAT_TEMPLATE = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}{% if add_generation_prompt %} Answer: {% endif %}"
INSTRUCTION = "Answer with ####."
ROWS = [
    {"question": "Amy has 3 pens. How many pens does Amy have?", "answer": "Amy has 3.\n#### 3"},
    {"question": "Ben has 4 cups and buys 2. How many cups does Ben have?", "answer": "4 + 2 = 6\n#### 6"},
    {"question": "Eva has 9 eggs. She gives away 8. How many eggs are left?", "answer": "#### 1"},
    {"question": "Tom has 5 books and finds 1. How many books does Tom have?", "answer": "#### 6"},
]
# The chat rendering of each question: [question + newline + instruction], then the opened turn.
CHAT_PROMPTS = {
    "Amy has 3 pens. How many pens does Amy have?":
        "[Amy has 3 pens. How many pens does Amy have?\nAnswer with ####.] Answer: ",
    "Ben has 4 cups and buys 2. How many cups does Ben have?":
        "[Ben has 4 cups and buys 2. How many cups does Ben have?\nAnswer with ####.] Answer: ",
    "Eva has 9 eggs. She gives away 8. How many eggs are left?":
        "[Eva has 9 eggs. She gives away 8. How many eggs are left?\nAnswer with ####.] Answer: ",
    "Tom has 5 books and finds 1. How many books does Tom have?":
        "[Tom has 5 books and finds 1. How many books does Tom have?\nAnswer with ####.] Answer: ",
}


@pytest.fixture
def chat_model_dir(tmp_path):
    model, tokenizer = build_tiny_model("micro", WORDS, seed=3)
    tokenizer.chat_template = CHAT_TEMPLATE
    out = tmp_path / "chat-model"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _chat_config(tmp_path, model_dir, **data):
    return config_from_dict({
        "model": {"name": str(model_dir)},
        "data": {
            "train_path": _write_jsonl(tmp_path / "train.jsonl", ROWS),
            "heldout_path": _write_jsonl(tmp_path / "heldout.jsonl", ROWS[:2]),
            "prompt_field": "question", "gold_field": "answer", "instruction": INSTRUCTION, **data,
        },
        "warm_start": {"steps": 0},
        "rl": {"steps": 2, "batch_prompts": 2, "group_size": 2, "minibatches": 2, "max_new_tokens": 4,
               "eval_every": 2, "eval_samples": 1, "checkpoint_every": 2},
        "device": "cpu",
    }, where="test")


def test_chat_model_trains_and_is_benchmarked_on_its_chat_prompts(tmp_path, chat_model_dir, monkeypatch, core_one_thread):
    from eval.data import EvalRecord
    from eval.prompts import PromptConfig, render
    from eval.runner import EvalConfig, evaluate_records, load_model

    cfg = _chat_config(tmp_path, chat_model_dir)
    seen: list[list[int]] = []  # every prompt the trainer's sampler handed to the rollout engine
    real_batch = PromptSampler.batch

    def recording_batch(self, j):
        prompts, meta = real_batch(self, j)
        seen.extend(prompts)
        return prompts, meta

    monkeypatch.setattr(PromptSampler, "batch", recording_batch)
    ws_dir, ws_acc = prepare_warmstart(cfg, tmp_path / "cache", log=lambda _: None)
    result = train_variant(cfg, tmp_path / "run", ws_dir, ws_acc)
    assert result.steps == 2 and len(seen) >= 2 * 2 * 2

    _, tokenizer = load_pretrained(chat_model_dir)
    decoded = {tokenizer.decode(ids) for ids in seen}
    assert decoded <= set(CHAT_PROMPTS.values()) and len(decoded) >= 2

    # The benchmarks render the same question the same way, through the exported model's tokenizer.
    model, final_tok, _ = load_model(str(tmp_path / "run" / "final"))
    question = ROWS[0]["question"]
    assert render(question, final_tok, PromptConfig(template="auto", instruction=INSTRUCTION)) == CHAT_PROMPTS[question]
    _, items = evaluate_records(
        model, final_tok, "arith", [EvalRecord("q0", question, "3")],
        EvalConfig(max_new_tokens=2, prompt=PromptConfig(template="chat", instruction=INSTRUCTION)),
    )
    assert items[0]["prompt"] == CHAT_PROMPTS[question]


def test_prompt_budget_counts_the_chat_formatted_prompt(tmp_path, chat_model_dir):
    _, tokenizer = load_pretrained(chat_model_dir)
    question = ROWS[0]["question"]
    n_plain = len(tokenizer(question, add_special_tokens=False)["input_ids"])
    n_chat = len(tokenizer(CHAT_PROMPTS[question], add_special_tokens=False)["input_ids"])
    assert n_plain < n_chat
    cfg = _chat_config(tmp_path, chat_model_dir, max_prompt_tokens=n_chat - 1)
    with pytest.raises(BadRowError, match=rf"train.jsonl: row 1: prompt has {n_chat} tokens, over data.max_prompt_tokens={n_chat - 1}"):
        load_rows(cfg.data, tokenizer)
    # 'plain' measures the row's text and the instruction only: row 1 fits the same budget.
    plain = with_overrides(cfg, data={"prompt_format": "plain", "on_bad_row": "skip"})
    train, _, reports = load_rows(plain.data, tokenizer)
    assert train[0]["prompt"] == question and train[0]["gold"] == "Amy has 3.\n#### 3"
    assert len(tokenizer(f"{question}\n{INSTRUCTION}", add_special_tokens=False)["input_ids"]) <= n_chat - 1


def test_chat_format_without_a_chat_template_is_refused_before_training(tmp_path):
    cfg = with_overrides(preset("micro"), data={"prompt_format": "chat"})
    _, tokenizer = build_tiny_model("micro", WORDS)
    with pytest.raises(BadRowError, match="data.prompt_format: .*'chat' needs a tokenizer with a chat template"):
        load_rows(cfg.data, tokenizer)
    with pytest.raises(ConfigError, match=r"test: data.prompt_format: expected one of 'auto', 'chat', 'plain', got 'jinja'"):
        config_from_dict({"data": {"prompt_format": "jinja"}}, where="test")


def test_warm_start_steps_zero_evaluates_the_model_as_it_is(tmp_path, core_one_thread):
    cfg = with_overrides(preset("micro"), warm_start={"steps": 0}, device="cpu")
    ws_dir, acc = prepare_warmstart(cfg, tmp_path / "cache", log=lambda _: None)

    untouched, tokenizer = build_tiny_model("micro", WORDS, seed=cfg.model.init_seed)
    saved, _ = load_pretrained(ws_dir)
    for name, tensor in untouched.state_dict().items():
        assert torch.equal(saved.state_dict()[name], tensor), name
    meta = json.loads((ws_dir / "a3po_warmstart.json").read_text())
    assert meta["warmstart/steps"] == 0.0 and "warmstart/final_loss" not in meta

    from a3po.data.datasets import load_rows as rows_of
    from a3po.training.heldout import evaluate_heldout

    _, heldout, _ = rows_of(cfg.data, tokenizer)
    assert acc == evaluate_heldout(untouched, tokenizer, heldout, cfg)["eval/heldout_acc"]


def test_warm_start_zero_steps_needs_no_solutions_and_runs_no_step():
    model, tokenizer = build_tiny_model("micro", WORDS)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = with_overrides(preset("micro"), warm_start={"steps": 0})
    out = warm_start(model, tokenizer, [{"id": "a", "prompt": "Question: 1 + 1?", "gold": "2"}], cfg.warm_start)
    assert out == {"warmstart/steps": 0.0}
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_warm_start_without_solutions_names_the_file_and_row(tmp_path):
    rows = [{"prompt": "Question: Amy has 3 pens.", "gold": "3", "solution": "#### 3"}, {"prompt": "Question: Ben has 2 cups.", "gold": "2"}]
    cfg = with_overrides(preset("micro"), data={"train_path": _write_jsonl(tmp_path / "t.jsonl", rows)})
    _, tokenizer = build_tiny_model("micro", WORDS)
    with pytest.raises(BadRowError, match=r"t.jsonl: row 2: missing field\(s\) \['solution'\] .*warm_start.steps: 0"):
        load_rows(cfg.data, tokenizer, require_solution=True)
    train, _, _ = load_rows(cfg.data, tokenizer)  # no warm start: no solution needed
    assert len(train) == 2
    with pytest.raises(ConfigError, match="warm_start.steps must be >= 0"):
        with_overrides(cfg, warm_start={"steps": -1})
