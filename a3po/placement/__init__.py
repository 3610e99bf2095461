"""Where generation runs (the placement), chosen by name: in the trainer's process, or in rollout
worker processes of their own."""
