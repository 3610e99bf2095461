"""Benchmark loaders: a hub name or a local file, normalised to one record shape.

Every benchmark, wherever it comes from, becomes a list of ``EvalRecord(id, prompt, gold,
metadata)`` so the runner, the grader and the records JSONL never special-case a source.
``prompt`` is the bare problem text; templates are applied later (``eval.prompts``).

Sources (``load_benchmark(name, source)``):

- ``None``: the benchmark's hub dataset (``openai/gsm8k``, ``HuggingFaceH4/MATH-500``,
  ``Maxwell-Jia/AIME_2024``) through ``datasets``; needs the hub or its local cache;
- a hub name (any string that is not an existing path);
- a ``.json`` / ``.jsonl`` / ``.parquet`` file;
- a folder laid out like the offline copies: ``DIR/<name>/test.jsonl`` (or ``DIR/<name>.jsonl``).

Field names are matched case-insensitively (the AIME hub copy says ``Problem``/``Answer``, the
local copy ``problem``/``answer``). A row without a required field raises ``SchemaError``
naming the file, the 1-based row number and the field; so does a line that is not UTF-8 (with
its byte offset). The embedded arithmetic task is here too (``arith``: held-out problems
generated in code, no file needed).

Shipped fixtures (``eval/fixtures/<name>.jsonl``, a few hand-written rows per format) keep the
tests and the ``--data-dir`` examples independent of any external copy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from a3po.registry import Registry
from a3po.storage.utf8_lines import json_lines, undecodable, unencodable

FIXTURES_DIR = Path(__file__).with_name("fixtures")


class SchemaError(ValueError):
    """A source row does not have what the benchmark needs (message names file, row and field)."""


@dataclass(frozen=True)
class EvalRecord:
    id: str
    prompt: str  # the bare problem text (no template)
    gold: str  # the gold final answer, as the grader expects it for the benchmark's task
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BenchmarkSpec:
    """Where a benchmark lives on the hub and how its rows become records."""

    task: str  # the grading task (a3po.grading.TASKS)
    hub_path: str | None
    hub_name: str | None
    hub_split: str
    prompt_field: str
    answer_field: str
    gold_from_answer: Callable[[str], str]
    id_field: str | None = None
    metadata_fields: tuple[str, ...] = ()
    default_template: str = "auto"  # eval.prompts template name
    generate: Callable[[int], list[dict]] | None = None  # in-code benchmarks (no source file)


BENCHMARKS: Registry[BenchmarkSpec] = Registry("benchmark")


def _gsm8k_gold(answer: str) -> str:
    """The number on the ``#### N`` line of a GSM8K answer, thousands commas removed."""
    head, sep, tail = str(answer).rpartition("####")
    if not sep or not tail.strip():
        raise ValueError("has no '#### N' final-answer line")
    return tail.strip().replace(",", "")


def _as_str(answer: Any) -> str:
    return str(answer).strip()


def _arith_rows(n: int) -> list[dict]:
    from a3po.data.arithmetic import generate_split

    return [{"id": r["id"], "prompt": r["prompt"], "answer": r["gold"], "solution": r["solution"]} for r in generate_split(n, "heldout", seed=0)]


BENCHMARKS.register("gsm8k")(
    BenchmarkSpec(
        task="gsm8k", hub_path="openai/gsm8k", hub_name="main", hub_split="test",
        prompt_field="question", answer_field="answer", gold_from_answer=_gsm8k_gold,
    )
)
BENCHMARKS.register("math500")(
    BenchmarkSpec(
        task="math500", hub_path="HuggingFaceH4/MATH-500", hub_name=None, hub_split="test",
        prompt_field="problem", answer_field="answer", gold_from_answer=_as_str,
        id_field="unique_id", metadata_fields=("subject", "level", "solution"),
    )
)
BENCHMARKS.register("aime24")(
    BenchmarkSpec(
        task="aime24", hub_path="Maxwell-Jia/AIME_2024", hub_name=None, hub_split="train",
        prompt_field="problem", answer_field="answer", gold_from_answer=_as_str,
        id_field="id", metadata_fields=("url", "solution"),
    )
)
BENCHMARKS.register("arith")(
    BenchmarkSpec(
        task="arith", hub_path=None, hub_name=None, hub_split="heldout",
        prompt_field="prompt", answer_field="answer", gold_from_answer=_as_str,
        id_field="id", default_template="raw", generate=_arith_rows,
    )
)


# ---------------------------------------------------------------- reading rows


def read_rows(path: str | Path) -> Iterator[tuple[int, dict]]:
    """``(row_number, row)`` from a JSONL, JSON (a list, or ``{"data": [...]}``) or parquet file;
    row numbers are 1-based (the line number for JSONL)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        for i, row in enumerate(pq.read_table(path).to_pylist(), start=1):
            yield i, row
        return
    if suffix == ".json":
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8-sig")  # a byte-order mark is fine
        except UnicodeDecodeError as e:
            line = raw.count(b"\n", 0, e.start) + 1
            raise SchemaError(f"{path}: line {line}: {undecodable(e)}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise SchemaError(f"{path}: line {e.lineno}: not valid JSON ({e.msg})") from None
        rows = data.get("data", data.get("rows")) if isinstance(data, dict) else data
        if not isinstance(rows, list):
            raise SchemaError(f"{path}: expected a JSON list of objects (or {{'data': [...]}})")
        for i, row in enumerate(rows, start=1):
            problem = unencodable(row)  # a "\\ud800" escape: valid JSON, not UTF-8 text
            if problem is not None:
                raise SchemaError(f"{path}: row {i}: {problem}")
            yield i, row
        return
    for lineno, row, problem in json_lines(path):  # each line decoded on its own: bad bytes name their row
        if problem is not None:
            raise SchemaError(f"{path}: row {lineno}: {problem}")
        yield lineno, row


def _get(row: dict, name: str) -> Any:
    """Field ``name`` of ``row``, matched case-insensitively; KeyError when absent or null."""
    if name in row and row[name] is not None:
        return row[name]
    lowered = name.lower()
    for k, v in row.items():
        if isinstance(k, str) and k.lower() == lowered and v is not None:
            return v
    raise KeyError(name)


def to_record(spec: BenchmarkSpec, row: Any, where: str, rownum: int) -> EvalRecord:
    """One source row -> ``EvalRecord``; ``SchemaError`` names ``where``, ``rownum`` and the field."""
    if not isinstance(row, dict):
        raise SchemaError(f"{where}: row {rownum}: expected a JSON object, got {type(row).__name__}")
    fields = {}
    for name in (spec.prompt_field, spec.answer_field):
        try:
            fields[name] = _get(row, name)
        except KeyError:
            have = ", ".join(sorted(map(str, row))) or "none"
            raise SchemaError(
                f"{where}: row {rownum}: missing field '{name}' "
                f"(needs {spec.prompt_field!r} and {spec.answer_field!r}; the row has: {have})"
            ) from None
    try:
        gold = spec.gold_from_answer(fields[spec.answer_field])
    except ValueError as e:
        raise SchemaError(f"{where}: row {rownum}: field '{spec.answer_field}' {e}") from None
    rid = None
    if spec.id_field is not None:
        try:
            rid = str(_get(row, spec.id_field))
        except KeyError:
            pass
    meta = {"row": rownum, "source": where, "answer": fields[spec.answer_field]}
    for name in spec.metadata_fields:
        try:
            meta[name] = _get(row, name)
        except KeyError:
            pass
    return EvalRecord(id=rid or f"{spec.task}-{rownum}", prompt=str(fields[spec.prompt_field]), gold=gold, metadata=meta)


# ---------------------------------------------------------------- sources


def resolve_local(name: str, source: str | Path) -> Path | None:
    """The file to read for benchmark ``name`` from a local ``source`` (file or folder), or None
    when ``source`` is not an existing path (then it is a hub name)."""
    p = Path(source).expanduser()
    if p.is_file():
        return p
    if p.is_dir():
        for candidate in (
            p / name / "test.jsonl",
            p / name / "test.json",
            p / name / "test.parquet",
            p / f"{name}.jsonl",
            p / f"{name}.json",
            p / f"{name}.parquet",
        ):
            if candidate.is_file():
                return candidate
        raise FileNotFoundError(f"no {name} file in {p} (looked for {name}/test.jsonl and {name}.jsonl)")
    return None


def _hub_rows(spec: BenchmarkSpec, hub_path: str) -> Iterable[tuple[int, dict]]:
    import datasets

    try:
        ds = datasets.load_dataset(hub_path, spec.hub_name if hub_path == spec.hub_path else None, split=spec.hub_split)
    except Exception as e:  # noqa: BLE001 - offline, missing cache, auth: all mean "use a local copy"
        raise RuntimeError(
            f"could not load {hub_path!r} from the hub ({type(e).__name__}: {e}); "
            f"pass a local file or a --data-dir laid out as <dir>/<benchmark>/test.jsonl"
        ) from e
    return enumerate(ds, start=1)


def load_benchmark(name: str, source: str | Path | None = None, limit: int | None = None) -> list[EvalRecord]:
    """Records of benchmark ``name`` (``gsm8k``, ``math500``, ``aime24``, ``arith``) from
    ``source`` (see the module docstring), the first ``limit`` of them when given."""
    spec = BENCHMARKS.get(name)
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if spec.generate is not None:
        rows: Iterable[tuple[int, dict]] = enumerate(spec.generate(limit or 200), start=1)
        where = f"{name} (generated)"
    else:
        local = resolve_local(name, source) if source is not None else None
        if local is not None:
            rows, where = read_rows(local), str(local)
        else:
            hub_path = str(source) if source is not None else spec.hub_path
            rows, where = _hub_rows(spec, hub_path), hub_path
    out: list[EvalRecord] = []
    for rownum, row in rows:
        out.append(to_record(spec, row, where, rownum))
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise SchemaError(f"{where}: no rows")
    return out


def fixture_path(name: str) -> Path:
    """The shipped hand-written sample of benchmark ``name`` (same schema as the real file)."""
    return FIXTURES_DIR / f"{name}.jsonl"
