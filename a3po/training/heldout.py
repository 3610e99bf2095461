"""Held-out accuracy during training, scored by the same grader as the reward.

The trainer's measure is ``mean@n`` at the training temperature: the expected accuracy of the
policy that RL optimises (a tiny warm-started model's greedy output is brittle: it swings by
several points between neighbouring checkpoints while the sampled accuracy moves smoothly).
Greedy pass@1 is logged beside it (``eval/heldout_greedy_acc``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from a3po.config.plan import decoding_dtype
from a3po.data.datasets import prompt_style
from a3po.data.prompts import PromptStyle
from a3po.devices import machine_precision, model_device
from a3po.grading.rewards import score_completions
from a3po.models.factory import decoding_copy
from a3po.rollout.torch_engine import generate_text
from a3po.rollout.types import SamplingParams


@dataclass(frozen=True)
class HeldOutEvaluation:
    """The held-out figures (``eval/*`` metrics) and the greedy answers behind the greedy one,
    one per row in order, with their grader scores (the loop's completion tables read them)."""

    figures: dict[str, float]
    greedy: list[str]
    greedy_scores: list[float]


@torch.no_grad()
def heldout_completions(
    model,
    tokenizer,
    rows: list[dict],
    task: str,
    max_new_tokens: int,
    temperature: float = 0.0,
    samples: int = 1,
    seed: int = 0,
    batch_size: int = 64,
    style: PromptStyle = PromptStyle(),
    cancel: threading.Event | None = None,
) -> tuple[list[str], list[float]]:
    """``samples`` completions per row of ``rows`` (greedy when temperature is 0), prompts
    formatted by ``style`` as in training, and their grader scores: row-major lists. ``cancel``:
    see :func:`a3po.rollout.torch_engine.generate_text`."""
    prompts = [style.render(r["prompt"], tokenizer) for r in rows for _ in range(samples)]
    params = SamplingParams(max_new_tokens, temperature=temperature)
    completions = generate_text(model, tokenizer, prompts, params, seed=seed, batch_size=batch_size, cancel=cancel)
    golds = [r["gold"] for r in rows for _ in range(samples)]
    ids = [r["id"] for r in rows for _ in range(samples)]
    return completions, score_completions(task, completions, golds, ids)


def heldout_accuracy(
    model,
    tokenizer,
    rows: list[dict],
    task: str,
    max_new_tokens: int,
    temperature: float = 0.0,
    samples: int = 1,
    seed: int = 0,
    batch_size: int = 64,
    style: PromptStyle = PromptStyle(),
    cancel: threading.Event | None = None,
) -> float:
    """Mean grader score over ``rows`` x ``samples`` completions (greedy when temperature is 0),
    prompts formatted by ``style`` as in training."""
    _, scores = heldout_completions(model, tokenizer, rows, task, max_new_tokens, temperature, samples, seed,
                                    batch_size, style, cancel)
    return sum(scores) / len(scores)


def heldout_evaluation(model, tokenizer, rows: list[dict], cfg,
                       cancel: threading.Event | None = None) -> HeldOutEvaluation:
    """The trainer's held-out figures for a :class:`a3po.config.TrainConfig`: sampled mean@n at
    the training temperature (``eval/heldout_acc``) and greedy pass@1, with the greedy answers.
    The sampling seed is fixed, not the run's: every variant and checkpoint is scored on the same
    random numbers, which takes sampling noise out of the comparison. It decodes from weights in the
    run's decoding dtype (:func:`a3po.config.plan.decoding_dtype`: a bf16 copy of an autocast policy
    under ``dtype: auto`` where bf16 is native), so the step-0, in-run and final figures are taken
    alike, as the rollouts are. ``cancel``: see :func:`a3po.rollout.torch_engine.generate_text`."""
    model = decoding_copy(model, decoding_dtype(cfg, machine_precision(cfg.dtype, model_device(model))).torch)
    rl, style = cfg.rl, prompt_style(cfg.data)
    sampled = heldout_accuracy(model, tokenizer, rows, cfg.data.task, rl.max_new_tokens, rl.temperature,
                               rl.eval_samples, seed=0, style=style, cancel=cancel)
    greedy, scores = heldout_completions(model, tokenizer, rows, cfg.data.task, rl.max_new_tokens, style=style,
                                         cancel=cancel)
    figures = {"eval/heldout_acc": sampled, "eval/heldout_greedy_acc": sum(scores) / len(scores)}
    return HeldOutEvaluation(figures, greedy, scores)


def evaluate_heldout(model, tokenizer, rows: list[dict], cfg) -> dict[str, float]:
    """The figures of :func:`heldout_evaluation`: ``eval/heldout_acc`` and ``eval/heldout_greedy_acc``."""
    return heldout_evaluation(model, tokenizer, rows, cfg).figures
