"""Evaluation for a3po: the GSM8K / MATH500 / AIME24 benchmarks.

The grader (answer extraction, tasks, the math-verify worker) lives below, in
``a3po.grading``, because the RL reward needs it too: ``eval`` imports ``a3po``, never the
reverse. Importing ``eval`` pulls in nothing heavy (no torch, sympy, datasets or lm-eval), so
the CLI starts fast. Submodules:

- ``eval.data``           benchmark loaders (hub name or local JSON/JSONL/parquet) to one record shape
- ``eval.prompts``        prompt templates (the training prompt format ``a3po.data.prompts`` for chat, or a
                          plain "Question: ... Answer:" layout)
- ``eval.metrics``        pass@k (Chen et al. 2021), mean@n
- ``eval.runner``         batched evaluation of a model through ``a3po.rollout.torch_engine.generate_text``
- ``eval.lm_eval_bridge`` lm-eval's own gsm8k / minerva_math500 / aime24 tasks on local files
- ``eval.synthetic``      synthetic completions for grader checks
- ``eval.cli``            ``a3po eval``
"""
