"""Files that survive crashes: atomic writes, checkpoints, the run-folder lock, UTF-8 line readers."""
