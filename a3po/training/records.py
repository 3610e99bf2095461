"""A finished run's record (``result.json``, written last) and the checks before it is reused.

A flow that meets a run folder whose run finished takes that run's record instead of training it
again (its checkpoints may have been deleted to save disk). A record is reused only when it is what
the run wrote: :func:`seal` writes with it the digests of what it vouches for, and
:func:`finished_record` checks them, then the cross-checks that cost nothing:

* ``digest``: the sha256 of the record's own canonical JSON (every other field), so an edit of
  ``result.json`` is seen;
* ``history_sha256``: of the history's text (:func:`history_text`, what ``history.jsonl`` holds,
  written from the same rows by the flow's task), so an edited step is seen;
* ``final_files``: ``{name: sha256}`` of the final model folder, so other weights under
  ``final/`` are seen;
* the record's variant, seed and steps against the config it is reused for, its final held-out
  figure against the last point of its own eval curve and the history's last evaluation, its
  steps against the history's length.

A record that fails one is refused (:class:`RecordRefused`, naming the file and the check): the
run is not reused, it resumes from its checkpoints (which rewrite the record), and without
checkpoints it is refused by :func:`a3po.training.run.refuse_finished_without_checkpoints`.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

from a3po.storage.content import folder_hashes, folder_mismatch

RECORD_FILE = "result.json"
HISTORY_FILE = "history.jsonl"
FINAL_DIR = "final"
# What a reuse reads from the record (a3po.training.loop.TrainResult.record) besides the digests.
RECORD_FIELDS = ("variant", "seed", "warmstart_acc", "final_acc", "steps", "wall_s", "eval_curve")
DIGESTS = ("digest", "history_sha256", "final_files")


class RecordRefused(ValueError):
    """A finished run's record that is not what the run wrote, or not of the run it is reused for."""


def history_text(history: list[dict[str, float]]) -> str:
    """``history.jsonl``'s text: one line per step ``{"step", **metrics}``, steps from 1."""
    return "".join(json.dumps({"step": i + 1, **h}) + "\n" for i, h in enumerate(history))


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def record_digest(record: dict[str, Any]) -> str:
    """sha256 of the record's canonical JSON, its ``digest`` field aside."""
    body = {k: v for k, v in record.items() if k != "digest"}
    return _sha256_text(json.dumps(body, sort_keys=True, allow_nan=True))


def seal(record: dict[str, Any], history: list[dict[str, float]], final_dir: str | Path) -> dict[str, Any]:
    """``record`` with the digests of its history's text, its final model's files and itself."""
    sealed = {**record, "history_sha256": _sha256_text(history_text(history)), "final_files": folder_hashes(final_dir)}
    return {**sealed, "digest": record_digest(sealed)}


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def finished_record(run_dir: str | Path, variant: str, seed: int,
                    steps: int) -> tuple[dict[str, Any], list[dict]] | None:
    """``(record, history rows)`` of the run that finished in ``run_dir``; None when it did not
    finish (no ``result.json``, ``history.jsonl`` or ``final/``: a run cut short resumes from its
    checkpoints). Raises :class:`RecordRefused`, naming the file and the check, when it finished
    and its record fails a check (module docstring) for a run of ``variant``, ``seed`` and
    ``steps``."""
    run_dir = Path(run_dir)
    result, history, final = run_dir / RECORD_FILE, run_dir / HISTORY_FILE, run_dir / FINAL_DIR
    if not (result.is_file() and history.is_file() and final.is_dir()):
        return None
    try:
        record = json.loads(result.read_text())
    except (OSError, ValueError) as e:
        raise RecordRefused(f"{result}: unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(record, dict) or any(k not in record for k in RECORD_FIELDS + DIGESTS):
        missing = [k for k in RECORD_FIELDS + DIGESTS if not isinstance(record, dict) or k not in record]
        raise RecordRefused(f"{result}: lacks {', '.join(missing)} (an earlier version's record, or not a record)")
    if record["digest"] != record_digest(record):
        raise RecordRefused(f"{result}: its content does not match the digest written with it (edited after the run)")
    text = history.read_text()
    if _sha256_text(text) != record["history_sha256"]:
        raise RecordRefused(f"{history}: its content does not match the digest in {result} (edited after the run)")
    bad = folder_mismatch(final, record["final_files"])
    if bad is not None:
        raise RecordRefused(f"{bad} (the final model recorded in {result})")
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    for name, want in (("variant", variant), ("seed", seed), ("steps", steps)):
        if record[name] != want:
            raise RecordRefused(f"{result}: {name} {record[name]!r}, but this folder's run has {name} {want!r}")
    if record["steps"] != len(rows):
        raise RecordRefused(f"{result}: {record['steps']} steps, but {history} holds {len(rows)}")
    curve = record["eval_curve"]
    if not curve or not _same(curve[-1][1], record["final_acc"]):
        raise RecordRefused(f"{result}: final_acc {record['final_acc']} is not the last point of its own eval_curve "
                            f"({curve[-1][1] if curve else 'empty'})")
    evaluated = [r for r in rows if "eval/heldout_acc" in r]
    if evaluated and (evaluated[-1].get("step") != record["steps"]
                      or not _same(evaluated[-1]["eval/heldout_acc"], record["final_acc"])):
        raise RecordRefused(f"{result}: final_acc {record['final_acc']} is not {history}'s last evaluation "
                            f"({evaluated[-1]['eval/heldout_acc']} at step {evaluated[-1].get('step')})")
    return record, rows
