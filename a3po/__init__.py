"""a3po: asynchronous RL post-training for LLMs.

Three variants, one loss: ``sync`` (on-policy), ``recompute`` (decoupled PPO with an
extra forward pass for the proximal policy) and ``loglinear`` (A-3PO, which interpolates
the proximal log-probs in log space instead). The library never imports Prefect or MLflow.
"""

__version__ = "0.1.0"
