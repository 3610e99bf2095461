"""Prompt templates: how a bare problem becomes the text the model continues.

Instruction-tuned models are evaluated through their own chat template, asked to put the final
answer in ``\\boxed{}`` (what the grader looks for first). The chat rendering is the function that
formats training prompts (``a3po.data.prompts.format_prompt``): a policy trained with
``data.prompt_format: auto`` (or ``chat``) and ``data.instruction`` set to the instruction below
sees identical prompts in training and on the benchmarks. Otherwise a tokenizer without a chat template
(a base model, the in-code tiny tokenizer) gets the ``qa`` layout, "Question: ... Answer:", with the
same instruction. ``auto`` picks between the two; ``raw`` passes the prompt through unchanged
(the embedded arithmetic task stores ready-made prompts; training's ``data.prompt_format: plain``
is that text with the instruction). Templates are registered by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from a3po.data.prompts import format_prompt, has_chat_template
from a3po.registry import Registry

DEFAULT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class PromptConfig:
    template: str = "auto"
    """Template name: auto | chat | qa | raw (see TEMPLATES)."""
    instruction: str = DEFAULT_INSTRUCTION
    """Appended to the problem; it names the answer format the grader reads first."""
    system: str | None = None
    """Optional system message (chat template only)."""

    def __post_init__(self) -> None:
        if self.template == "plain":  # the name of `qa` before training's `plain` (the text unchanged) took it
            raise ValueError("prompt template 'plain' is now 'qa' (\"Question: ... Answer:\"); "
                             "'raw' passes the problem unchanged")
        TEMPLATES.get(self.template)  # an unknown name raises here, listing the valid ones


Template = Callable[[str, Any, PromptConfig], str]
TEMPLATES: Registry[Template] = Registry("prompt template")


@TEMPLATES.register("chat")
def chat_prompt(problem: str, tokenizer: Any, cfg: PromptConfig) -> str:
    return format_prompt(problem, tokenizer, "chat", cfg.instruction, cfg.system)


@TEMPLATES.register("qa")
def qa_prompt(problem: str, tokenizer: Any, cfg: PromptConfig) -> str:
    instruction = f"{cfg.instruction}\n" if cfg.instruction else ""
    return f"Question: {problem}\n{instruction}Answer: "


@TEMPLATES.register("raw")
def raw_prompt(problem: str, tokenizer: Any, cfg: PromptConfig) -> str:
    return problem


@TEMPLATES.register("auto")
def auto_prompt(problem: str, tokenizer: Any, cfg: PromptConfig) -> str:
    return (chat_prompt if has_chat_template(tokenizer) else qa_prompt)(problem, tokenizer, cfg)


def render(problem: str, tokenizer: Any, cfg: PromptConfig = PromptConfig()) -> str:
    """The model input for ``problem`` under ``cfg.template``."""
    return TEMPLATES.get(cfg.template)(problem, tokenizer, cfg)
