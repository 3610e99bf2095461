"""Completion tables: what the policy writes, next to the curves, at each held-out evaluation.

At every held-out evaluation of the loop (each ``rl.eval_every`` steps, and the last step) the
run folder gets ``completions/step_<step, 6 digits>.jsonl``: one JSON object per line, every line
with the keys of :data:`COLUMNS`, at most ``rl.log_completions`` lines. The tracking side
(``tasks.completions``) logs each file as an MLflow table; the library only writes files.

What the rows are, and why both kinds:

* ``source: "train"``: the first half (rounded up) of the rows, spread evenly over the batch the
  trainer has just updated on (TRL's ``log_completions``: what the policy was reinforced on).
  ``reward`` is the grader's score, ``group_mean_reward`` the mean reward of the sample's GRPO
  group (the baseline a group-relative advantage compares it with; the advantage itself depends
  on the estimator and, on the PPO path, on the critic's values, and is not kept after the step).
  Only these rows have a staleness: ``staleness_min|max`` = the trainer's version at the update
  minus the newest / oldest policy version among the sample's tokens (``version_max|min``; a
  sequence can mix two versions when weights change mid-batch). ``finished`` is False for a
  sample cut at ``rl.max_new_tokens``.
* ``source: "heldout"``: the rest, greedy answers of the evaluated policy to the first held-out
  problems (verl's validation generations). The same problems at every evaluation, so a reader
  follows one problem through the run; ``reward`` is the grader's score (1 = correct), the
  versions are the evaluated one, and there is no staleness (null): nothing is trained on them.

A training batch shows the sampled, possibly stale behaviour that the update saw; the held-out
answers show what the current weights do on fixed problems. Neither alone says both.

Bounds: at most ``rl.log_completions`` rows a table (0: no tables), and the prompt and the
completion each cut to ``max_chars`` characters, with a marker saying how many were left out.

Crash and resume: each file is written whole or not at all (:mod:`a3po.storage.atomic`). At the
start of a run the tables of steps after the checkpoint it resumes from are removed (the resumed
run writes them again), as the metrics file is rewound: the folder never holds a table of a step
whose metrics the run does not have, and never two of one step.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from a3po.storage.atomic import atomic_write_bytes

# The reader's order: what was asked and written, how it scored, how stale it was; ids last.
COLUMNS = ("step", "source", "prompt", "completion", "gold", "reward", "group_mean_reward", "staleness_min",
           "staleness_max",
           "version_min", "version_max", "tokens", "finished", "id")
MAX_CHARS = 2000  # per prompt and per completion: a table of 16 rows stays well under 100 kB
_FILE = re.compile(r"^step_(\d+)\.jsonl$")


def table_path(folder: str | Path, step: int) -> Path:
    return Path(folder) / f"step_{step:06d}.jsonl"


def table_steps(folder: str | Path) -> list[int]:
    """The steps that have a table in ``folder``, ascending (none when it does not exist)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir() if (m := _FILE.match(p.name)))


def read_table(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def clip_text(text: str, max_chars: int) -> str:
    """``text`` cut to ``max_chars`` characters, then a marker with the number left out."""
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]} [... {len(text) - max_chars} more characters]"


def split_rows(limit: int) -> tuple[int, int]:
    """(training rows, held-out rows) of a table of at most ``limit`` rows: half each, the odd
    one to the training batch."""
    return limit - limit // 2, limit // 2


def spread(n: int, k: int) -> list[int]:
    """``min(k, n)`` indices spread evenly over ``range(n)`` from 0 (every group of a batch
    of consecutive groups gets its share)."""
    k = min(k, n)
    return [i * n // k for i in range(k)]


def train_rows(scored, trainer_version: int, k: int, prompts: dict[str, str], max_chars: int) -> list[dict[str, Any]]:
    """``k`` rows of a :class:`a3po.producer.producer.ScoredBatch` trained at ``trainer_version``."""
    batch = scored.rollout
    rewards = scored.rewards.detach().float().cpu()
    groups = [m.get("group", i) for i, m in enumerate(batch.meta)]
    out = []
    for i in spread(len(batch), k):
        mask = batch.response_mask[i]
        versions = batch.versions[i][mask]
        same = torch.tensor([g == groups[i] for g in groups])
        v_min, v_max = (int(versions.min()), int(versions.max())) if versions.numel() else (None, None)
        out.append({
            "source": "train",
            "id": str(batch.meta[i]["id"]),
            "prompt": clip_text(prompts.get(str(batch.meta[i]["id"]), ""), max_chars),
            "completion": clip_text(scored.completions[i], max_chars),
            "gold": str(batch.meta[i]["gold"]),
            "reward": float(rewards[i]),
            "group_mean_reward": float(rewards[same].mean()),
            "tokens": int(mask.sum()),
            "finished": bool(batch.finished[i]),
            "version_min": v_min,
            "version_max": v_max,
            "staleness_min": None if v_max is None else trainer_version - v_max,
            "staleness_max": None if v_min is None else trainer_version - v_min,
        })
    return out


def heldout_rows(rows: list[dict], greedy: list[str], scores: list[float], version: int, k: int,
                 max_chars: int) -> list[dict[str, Any]]:
    """The greedy answers of policy ``version`` to the first ``k`` held-out ``rows``."""
    return [{
        "source": "heldout",
        "id": str(r["id"]),
        "prompt": clip_text(r["prompt"], max_chars),
        "completion": clip_text(c, max_chars),
        "gold": str(r["gold"]),
        "reward": float(s),
        "version_min": version,
        "version_max": version,
    } for r, c, s in list(zip(rows, greedy, scores, strict=True))[:k]]


class CompletionTables:
    """Writes the loop's tables into ``folder`` (see the module's docstring)."""

    def __init__(self, folder: str | Path, limit: int, train_data: list[dict], heldout_data: list[dict],
                 max_chars: int = MAX_CHARS):
        if limit < 1 or max_chars < 1:
            raise ValueError(f"a completion table needs limit >= 1 and max_chars >= 1, got {limit}, {max_chars}")
        self.folder, self.limit, self.max_chars = Path(folder), limit, max_chars
        self.heldout_data = heldout_data
        self.prompts = {str(r["id"]): r["prompt"] for r in train_data}

    def rewind(self, step: int) -> list[int]:
        """Remove the tables of steps after ``step`` (the run resumes there); returns their steps."""
        gone = [s for s in table_steps(self.folder) if s > step]
        for s in gone:
            table_path(self.folder, s).unlink(missing_ok=True)
        return gone

    def training_rows(self, step: int, scored) -> list[dict[str, Any]]:
        """The ``source: "train"`` rows of step ``step``'s table, of ``scored`` (the batch trained
        at version ``step - 1``): plain JSON values, taken at the step, so that they can wait for
        the held-out rows of an evaluation still running (in memory, or in the checkpoint of
        ``step``: :class:`a3po.training.run_state.PendingEvaluation`)."""
        return train_rows(scored, step - 1, split_rows(self.limit)[0], self.prompts, self.max_chars)

    def write(self, step: int, scored=None, heldout: tuple[list[str], list[float]] | None = None) -> Path:
        """The table of the evaluation after ``step`` updates: rows of ``scored`` (the batch
        trained at version ``step - 1``; None at step 0) and of ``heldout`` (the greedy answers
        and scores of version ``step``, one per held-out problem, in order)."""
        return self.write_rows(step, None if scored is None else self.training_rows(step, scored), heldout)

    def write_rows(self, step: int, training: list[dict[str, Any]] | None,
                   heldout: tuple[list[str], list[float]] | None = None) -> Path:
        """:meth:`write` with the training rows taken earlier (:meth:`training_rows`; None: no
        training batch, at step 0)."""
        n_held = split_rows(self.limit)[1]
        if training is None:  # no training batch yet: the held-out rows take the whole table
            training, n_held = [], self.limit
        rows = list(training)
        if heldout is not None:
            rows += heldout_rows(self.heldout_data, *heldout, version=step, k=n_held, max_chars=self.max_chars)
        body = "".join(json.dumps({c: ({"step": step} | row).get(c) for c in COLUMNS}, ensure_ascii=False) + "\n"
                       for row in rows)
        path = table_path(self.folder, step)
        atomic_write_bytes(path, lambda f: f.write(body.encode("utf-8")))
        return path
