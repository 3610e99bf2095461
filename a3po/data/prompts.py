"""How a problem becomes the text the policy continues: the one prompt-formatting function for
RL training (:class:`a3po.producer.producer.PromptSampler`), the supervised warm start, held-out
evaluation (:mod:`a3po.training.heldout`), prompt-length validation (:mod:`a3po.data.datasets`) and the
benchmarks (``eval.prompts``), so a chat model is trained and evaluated on one format.

Formats (``data.prompt_format``):

- ``chat``:  the tokenizer's chat template over one user message (optionally after a system
  message), with the assistant turn opened (``add_generation_prompt``); an error when the
  tokenizer has no chat template;
- ``plain``: the text unchanged (the embedded task stores ready-made prompts);
- ``auto``:  ``chat`` when the tokenizer has a chat template, else ``plain``.

Light on purpose (no torch, no transformers): ``eval.prompts`` imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from a3po.catalog import PROMPT_FORMATS


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def resolved_format(tokenizer: Any, fmt: str) -> str:
    """``chat`` or ``plain``: what ``fmt`` means for ``tokenizer``."""
    if fmt not in PROMPT_FORMATS:
        raise ValueError(f"prompt format must be one of {list(PROMPT_FORMATS)}, got {fmt!r}")
    if fmt == "chat" and not has_chat_template(tokenizer):
        raise ValueError("prompt format 'chat' needs a tokenizer with a chat template (this one has "
                         "none); use 'plain' or 'auto'")
    if fmt == "auto":
        return "chat" if has_chat_template(tokenizer) else "plain"
    return fmt


def format_prompt(text: str, tokenizer: Any, fmt: str = "auto", instruction: str = "",
                  system: str | None = None) -> str:
    """The model input for ``text`` (a bare problem or a dataset row's prompt), with
    ``instruction`` on a line of its own after it when given."""
    content = f"{text}\n{instruction}" if instruction else text
    if resolved_format(tokenizer, fmt) == "plain":
        return content
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": content.strip()})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@dataclass(frozen=True)
class PromptStyle:
    """A training run's prompt settings (from ``data.prompt_format`` and ``data.instruction``;
    see :func:`a3po.data.datasets.prompt_style`). The default leaves prompts unchanged."""

    format: str = "plain"
    instruction: str = ""

    def __post_init__(self) -> None:
        if self.format not in PROMPT_FORMATS:
            raise ValueError(f"prompt format must be one of {list(PROMPT_FORMATS)}, got {self.format!r}")

    def render(self, text: str, tokenizer: Any) -> str:
        return format_prompt(text, tokenizer, self.format, self.instruction)
