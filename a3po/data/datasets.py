"""Prompt datasets for RL: the embedded arithmetic task or JSONL files of {id, prompt, gold}.

Bad rows never reach training silently: an empty, malformed or undecodable (not UTF-8) row, or
a prompt longer than the context budget, raises an error naming the source and the row, or
(``on_bad_row='skip'``) is dropped and counted in :class:`DatasetReport`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from a3po.config import DataConfig
from a3po.data.arithmetic import ArithmeticDifficulty, generate_split
from a3po.data.prompts import PromptStyle
from a3po.storage.utf8_lines import json_lines


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


def prompt_style(cfg: DataConfig) -> PromptStyle:
    """How this data config's prompts become model inputs (see :mod:`a3po.data.prompts`)."""
    return PromptStyle(format=cfg.prompt_format, instruction=cfg.instruction)


def read_jsonl(path: str | Path, on_bad_row: str = "error") -> list[dict]:
    """Rows of a JSONL file; a line that is not UTF-8 or not a JSON object raises naming file and
    line, or (``on_bad_row='skip'``) becomes a row carrying ``_error`` that :func:`validate_rows`
    counts."""
    rows = []
    for lineno, row, problem in json_lines(path):  # each line decoded on its own: bad bytes name their row
        if problem is None and not isinstance(row, dict):
            problem = f"expected a JSON object, got {type(row).__name__}"
        if problem is not None:
            if on_bad_row == "error":
                raise BadRowError(f"{path}: row {lineno}: {problem}")
            row = {"_error": problem}
        row.setdefault("_row", lineno)
        rows.append(row)
    return rows


def validate_rows(
    rows: list[dict],
    tokenizer,
    max_prompt_tokens: int,
    on_bad_row: str,
    source: str,
    style: PromptStyle = PromptStyle(),
    fields: tuple[str, str] = REQUIRED_FIELDS,
    extra_fields: tuple[str, ...] = (),
) -> tuple[list[dict], DatasetReport]:
    """Check every row has a non-empty string prompt and gold (read from ``fields``, the
    prompt and gold field names; kept rows carry them as 'prompt' and 'gold' as well), has
    ``extra_fields``, that its prompt, formatted by ``style``, fits the prompt budget, and that
    its id (``id``, else ``<source>#<index>``) is not a kept row's."""
    report = DatasetReport(source=source, n_rows=len(rows))
    kept = []
    rows_of_id: dict[str, int] = {}  # id -> the row that holds it: ids name rows (completion tables, errors)
    for i, row in enumerate(rows):
        number = row.get("_row", i + 1)
        where = f"{source}: row {number}"
        rid = str(row.get("id", f"{source}#{i}"))
        problem = None
        missing = [k for k in (*fields, *extra_fields) if k not in row]
        if "_error" in row:
            problem = row["_error"]
        elif missing:
            problem = f"missing field(s) {missing}"
        elif not all(isinstance(row[k], str) and row[k].strip() for k in fields):
            problem = f"empty or non-string {fields[0]!r}/{fields[1]!r}"
        else:
            n_tok = len(tokenizer(style.render(row[fields[0]], tokenizer), add_special_tokens=False)["input_ids"])
            if n_tok > max_prompt_tokens:
                problem = f"prompt has {n_tok} tokens, over data.max_prompt_tokens={max_prompt_tokens}"
            elif rid in rows_of_id:
                problem = (f"id {rid!r} is also the id of row {rows_of_id[rid]} "
                           "(ids must be unique: rows are looked up by id)")
        if problem is None:
            rows_of_id[rid] = number
            named = dict(zip(REQUIRED_FIELDS, (row[fields[0]], row[fields[1]]), strict=True))
            kept.append({**{k: v for k, v in row.items() if k != "_row"}, **named, "id": rid})
            continue
        if on_bad_row == "error":
            raise BadRowError(f"{where}: {problem}")
        report.skipped.append(f"{where}: {problem}")
    report.n_kept = len(kept)
    if not kept:
        raise BadRowError(f"{source}: no usable rows ({len(report.skipped)} skipped)")
    return kept, report


def require_batch_rows(rows: list[dict], cfg: DataConfig, batch_prompts: int) -> None:
    """BadRowError naming the training set when it holds fewer usable rows than one batch draws
    (``rl.batch_prompts`` distinct prompts): a batch cut to the set would be smaller than the size
    the staleness bound admits, and the producer would run ahead of the bound."""
    if len(rows) < batch_prompts:
        source = cfg.train_path or "arith:train (data.n_train)"
        raise BadRowError(f"{source}: {len(rows)} usable training rows, fewer than rl.batch_prompts "
                          f"{batch_prompts} (each batch "
                          "draws that many distinct problems); lower rl.batch_prompts or add rows")


def load_rows(cfg: DataConfig, tokenizer,
              require_solution: bool = False) -> tuple[list[dict], list[dict], list[DatasetReport]]:
    """Train and held-out rows for ``cfg``, validated against ``tokenizer``. With
    ``require_solution`` (a warm start will run) every training row needs a 'solution'."""
    diff = ArithmeticDifficulty(max_add=cfg.max_add, max_mul=cfg.max_mul, slip_rate=cfg.teacher_slip_rate,
                                long_tail_frac=cfg.long_tail_frac, long_tail_steps=cfg.long_tail_steps)
    raw_train = (read_jsonl(cfg.train_path, cfg.on_bad_row) if cfg.train_path
                 else generate_split(cfg.n_train, "train", cfg.seed, diff))
    raw_held = (read_jsonl(cfg.heldout_path, cfg.on_bad_row) if cfg.heldout_path
                else generate_split(cfg.n_heldout, "heldout", cfg.seed, diff))
    try:
        style = prompt_style(cfg)
        style.render("x", tokenizer)  # 'chat' without a chat template fails here, before any row
    except ValueError as e:
        raise BadRowError(f"data.prompt_format: {e}") from None
    fields = (cfg.prompt_field, cfg.gold_field)
    check = dict(max_prompt_tokens=cfg.max_prompt_tokens, on_bad_row=cfg.on_bad_row, style=style, fields=fields)
    solution = ("solution",) if require_solution else ()
    try:
        train, r1 = validate_rows(raw_train, tokenizer, source=cfg.train_path or "arith:train",
                                  extra_fields=solution, **check)
    except BadRowError as e:
        if require_solution and "'solution'" in str(e):
            raise BadRowError(f"{e} (the warm start trains on it; set warm_start.steps: "
                              "0 to skip the warm start)") from None
        raise
    held, r2 = validate_rows(raw_held, tokenizer, source=cfg.heldout_path or "arith:heldout", **check)
    return train, held, [r1, r2]
