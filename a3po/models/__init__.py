"""Models and their forward passes: the model factory, tokenizer, log-probabilities and the
fast incremental decoders."""
