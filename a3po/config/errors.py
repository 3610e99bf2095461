"""What the sections' checks share: the error a config value of the wrong type, out of range or
unknown raises where a config is read (:class:`ConfigError`; a section's own check raises ValueError
or KeyError), and the bounds that several sections check against (seeds, threads, rows, rates)."""

# Seeds go to random.Random, torch.manual_seed and numpy alike, plus small offsets (per step, per
# row): numpy takes [0, 2**32), so a config seed stays well inside it.
MAX_SEED = 2**31 - 1
# Intra-op threads: far above any core count wastes memory on idle OpenMP workers, and torch
# crashes (not an error: a segfault) when asked for 100000. A fixed bound, not the cores of the
# machine that builds the config: it may not be the one that trains.
MAX_THREADS = 1024
# The embedded task generates its rows up front, all in memory (about a kilobyte each).
MAX_GENERATED_ROWS = 1_000_000
# An Adam step moves each weight by about lr: above 1 every step rewrites the weights.
MAX_LR = 1.0


class ConfigError(ValueError):
    """A config value of the wrong type, out of range or unknown; the message starts with the
    source (file, preset or 'overrides') and the dotted field, e.g. ``my.yaml: rl.lr: ...``."""


def seed_ok(seed: int) -> bool:
    return 0 <= seed <= MAX_SEED
