"""Generation behind one interface: the types engines and their callers share (``types``), the
engine registry, the torch and vLLM engines and the engine-vs-trainer log-prob check."""
