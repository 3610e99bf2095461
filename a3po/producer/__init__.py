"""The asynchronous producer: a thread that generates batches ahead of the trainer within the
staleness bound, the weight versions it samples with, admission control and prompt sampling."""
