"""The training loop and one run end to end: the RL step, warm start, held-out evaluation,
PPO parts (critic, reference, reward model), metrics and thread budgets; and the ``a3po train``
command that runs it (``python -m a3po.training.command``)."""
