"""Prompt datasets for RL: the embedded arithmetic task or JSONL files of {id, prompt, gold}.

Bad rows never reach training silently: an empty, malformed or undecodable (not UTF-8) row, or
a prompt longer than the context budget, raises an error naming the source and the row, or
(``on_bad_row='skip'``) is dropped and counted in :class:`DatasetReport`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from a3po.arithmetic import ArithmeticDifficulty, generate_split
from a3po.config import DataConfig
from a3po.utf8_lines import utf8_lines


class BadRowError(ValueError):
    """A dataset row that cannot be used; the message names the source and the row."""


@dataclass
class DatasetReport:
    source: str
    n_rows: int = 0
    n_kept: int = 0
    skipped: list[str] = field(default_factory=list)  # one reason per skipped row

    def as_metrics(self, prefix: str) -> dict[str, float]:
        return {f"{prefix}/rows": float(self.n_rows), f"{prefix}/skipped_rows": float(len(self.skipped))}


REQUIRED_FIELDS = ("prompt", "gold")


def read_jsonl(path: str | Path, on_bad_row: str = "error") -> list[dict]:
    """Rows of a JSONL file; a line that is not UTF-8 or not a JSON object raises naming file and
    line, or (``on_bad_row='skip'``) becomes a row carrying ``_error`` that :func:`validate_rows`
    counts."""
    rows = []
    for lineno, line, problem in utf8_lines(path):  # each line decoded on its own: bad bytes name their row
        if line is not None:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                problem = None if isinstance(row, dict) else f"expected a JSON object, got {type(row).__name__}"
            except json.JSONDecodeError as e:
                problem = f"not valid JSON ({e.msg})"
        if problem is not None:
            if on_bad_row == "error":
                raise BadRowError(f"{path}: row {lineno}: {problem}")
            row = {"_error": problem}
        row.setdefault("_row", lineno)
        rows.append(row)
    return rows


def validate_rows(rows: list[dict], tokenizer, max_prompt_tokens: int, on_bad_row: str, source: str) -> tuple[list[dict], DatasetReport]:
    """Check every row has a non-empty string prompt and gold and fits the prompt budget."""
    report = DatasetReport(source=source, n_rows=len(rows))
    kept = []
    for i, row in enumerate(rows):
        where = f"{source}: row {row.get('_row', i + 1)}"
        problem = None
        missing = [k for k in REQUIRED_FIELDS if k not in row]
        if "_error" in row:
            problem = row["_error"]
        elif missing:
            problem = f"missing field(s) {missing}"
        elif not all(isinstance(row[k], str) and row[k].strip() for k in REQUIRED_FIELDS):
            problem = "empty or non-string 'prompt'/'gold'"
        else:
            n_tok = len(tokenizer(row["prompt"], add_special_tokens=False)["input_ids"])
            if n_tok > max_prompt_tokens:
                problem = f"prompt has {n_tok} tokens, over data.max_prompt_tokens={max_prompt_tokens}"
        if problem is None:
            kept.append({**{k: v for k, v in row.items() if k != "_row"}, "id": str(row.get("id", f"{source}#{i}"))})
            continue
        if on_bad_row == "error":
            raise BadRowError(f"{where}: {problem}")
        report.skipped.append(f"{where}: {problem}")
    report.n_kept = len(kept)
    if not kept:
        raise BadRowError(f"{source}: no usable rows ({len(report.skipped)} skipped)")
    return kept, report


def load_rows(cfg: DataConfig, tokenizer) -> tuple[list[dict], list[dict], list[DatasetReport]]:
    """Train and held-out rows for ``cfg``, validated against ``tokenizer``."""
    diff = ArithmeticDifficulty(max_add=cfg.max_add, max_mul=cfg.max_mul, slip_rate=cfg.teacher_slip_rate,
                                long_tail_frac=cfg.long_tail_frac, long_tail_steps=cfg.long_tail_steps)
    raw_train = read_jsonl(cfg.train_path, cfg.on_bad_row) if cfg.train_path else generate_split(cfg.n_train, "train", cfg.seed, diff)
    raw_held = read_jsonl(cfg.heldout_path, cfg.on_bad_row) if cfg.heldout_path else generate_split(cfg.n_heldout, "heldout", cfg.seed, diff)
    train, r1 = validate_rows(raw_train, tokenizer, cfg.max_prompt_tokens, cfg.on_bad_row, cfg.train_path or "arith:train")
    held, r2 = validate_rows(raw_held, tokenizer, cfg.max_prompt_tokens, cfg.on_bad_row, cfg.heldout_path or "arith:heldout")
    return train, held, [r1, r2]
