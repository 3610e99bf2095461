"""Benchmarks, each runnable as ``python -m bench.<name>``; each ends with one JSON line of its key figures."""
