"""Generation: the torch rollout engine, the engine protocol and registry, the vLLM engine and
the engine-vs-trainer log-prob check."""
