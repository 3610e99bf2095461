"""Prompt templates: chat template with the \\boxed{} instruction when the tokenizer has one."""

from __future__ import annotations

import copy

import pytest

from a3po.data.arithmetic import WORDS
from a3po.models.tokenizer import build_tokenizer
from eval.prompts import DEFAULT_INSTRUCTION, PromptConfig, render

CHAT = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"


@pytest.fixture(scope="module")
def plain_tok():
    return build_tokenizer(WORDS)


@pytest.fixture(scope="module")
def chat_tok(plain_tok):
    tok = copy.deepcopy(plain_tok)
    tok.chat_template = CHAT
    return tok


def test_auto_uses_the_chat_template_when_there_is_one(chat_tok) -> None:
    out = render("What is 2+2?", chat_tok)
    assert out == f"<|user|>What is 2+2?\n{DEFAULT_INSTRUCTION}\n<|assistant|>"
    assert "\\boxed{}" in out


def test_auto_falls_back_to_the_question_answer_layout(plain_tok) -> None:
    assert render("What is 2+2?", plain_tok) == f"Question: What is 2+2?\n{DEFAULT_INSTRUCTION}\nAnswer: "
    assert render("What is 2+2?", plain_tok, PromptConfig(template="qa")) == render("What is 2+2?", plain_tok)


def test_system_message_and_raw(chat_tok) -> None:
    out = render("Q", chat_tok, PromptConfig(template="chat", system="Be brief."))
    assert out.startswith("<|system|>Be brief.\n<|user|>Q\n")
    assert render("Question: 1+1?\nAnswer: ", chat_tok, PromptConfig(template="raw")) == "Question: 1+1?\nAnswer: "


def test_chat_without_a_template_and_unknown_names_raise(plain_tok) -> None:
    with pytest.raises(ValueError, match="chat template"):
        render("Q", plain_tok, PromptConfig(template="chat"))
    with pytest.raises(KeyError, match="auto, chat, qa, raw"):
        PromptConfig(template="fancy")


def test_the_old_name_of_qa_is_refused_naming_the_new_one() -> None:
    # 'plain' means the text unchanged in training (data.prompt_format); here it named the qa layout.
    with pytest.raises(ValueError, match="prompt template 'plain' is now 'qa'"):
        PromptConfig(template="plain")
