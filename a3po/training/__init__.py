"""The training loop and one run end to end: the RL step, warm start, held-out evaluation,
PPO parts (critic, reference, reward model), metrics and thread budgets."""
