"""Tasks and data: the embedded arithmetic task, dataset loading and prompt formatting."""
