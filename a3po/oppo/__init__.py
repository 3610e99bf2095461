"""OPPO: intra-step streaming of partial answers to the scorers, the chunk-size tuner, and
inter-step overcommit with carry-over."""
