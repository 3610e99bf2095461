"""Data-parallel trainer ranks: process groups, rank plumbing and the DeepSpeed updater."""
