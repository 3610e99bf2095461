"""Evaluation for a3po: verifiable math rewards and the GSM8K / MATH500 / AIME24 benchmarks.

Kept light on purpose: importing ``eval`` pulls in nothing heavy (no torch, sympy, datasets or
lm-eval), because the RL trainer imports ``eval.grading`` for its reward on every sample and
the CLI should start fast. Submodules:

- ``eval.answers``       pure answer extraction (last ``\\boxed{}``, ``#### N``, fallbacks) and plain numbers
- ``eval.grading``       ``score`` / ``grade`` / ``stats``: the reward and the benchmark grader
- ``eval.verify_worker`` the math-verify worker process that bounds every symbolic comparison
- ``eval.data``          benchmark loaders (hub name or local JSON/JSONL/parquet) to one record shape
- ``eval.prompts``       prompt templates (chat template with a ``\\boxed{}`` instruction, or plain)
- ``eval.metrics``       pass@k (Chen et al. 2021), mean@n
- ``eval.runner``        batched evaluation of a model through ``a3po.rollout.generate_text``
- ``eval.lm_eval_bridge`` lm-eval's own gsm8k / minerva_math500 / aime24 tasks on local files
- ``eval.cli``           ``a3po eval``
"""
