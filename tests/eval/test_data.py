"""Benchmark loaders: one record shape from every source; schema errors say file, row and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval.data import BENCHMARKS, EvalRecord, SchemaError, fixture_path, load_benchmark


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_fixtures_load_into_one_record_shape() -> None:
    gsm = load_benchmark("gsm8k", fixture_path("gsm8k"))
    math = load_benchmark("math500", fixture_path("math500"))
    aime = load_benchmark("aime24", fixture_path("aime24"))
    assert [len(gsm), len(math), len(aime)] == [5, 6, 3]
    assert all(isinstance(r, EvalRecord) and r.id and r.prompt and r.gold for r in gsm + math + aime)
    assert gsm[1].gold == "1250"  # "#### 1,250": the number on the #### line, commas dropped
    assert [r.gold for r in math[:4]] == ["\\frac{14}{3}", "\\left( 3, \\frac{\\pi}{2} \\right)", "90^\\circ", "\\text{Evelyn}"]
    assert math[0].id == "fixture/algebra/1.json" and math[0].metadata["subject"] == "Algebra"
    assert [r.gold for r in aime] == ["001", "025", "073"]  # kept as written; the grader compares integers
    assert len({r.id for r in gsm + math + aime}) == 14


def test_folder_layouts_and_limit(tmp_path: Path) -> None:
    # <dir>/<name>/test.jsonl like the offline copies, and flat <dir>/<name>.jsonl like the fixtures
    (tmp_path / "gsm8k").mkdir()
    _write_jsonl(tmp_path / "gsm8k" / "test.jsonl", [{"question": "q1", "answer": "a\n#### 3"}, {"question": "q2", "answer": "#### 4"}])
    assert [r.gold for r in load_benchmark("gsm8k", tmp_path)] == ["3", "4"]
    assert [r.gold for r in load_benchmark("gsm8k", tmp_path, limit=1)] == ["3"]
    assert len(load_benchmark("math500", fixture_path("math500").parent)) == 6
    with pytest.raises(FileNotFoundError, match="aime24"):
        load_benchmark("aime24", tmp_path)


def test_json_and_parquet_sources(tmp_path: Path) -> None:
    rows = [{"ID": "2024-I-1", "Problem": "p", "Solution": "s", "Answer": 204}]  # the hub copy's capitalised columns
    (tmp_path / "a.json").write_text(json.dumps(rows))
    rec = load_benchmark("aime24", tmp_path / "a.json")[0]
    assert (rec.id, rec.prompt, rec.gold) == ("2024-I-1", "p", "204")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    rec_pq = load_benchmark("aime24", tmp_path / "a.parquet")[0]
    assert (rec_pq.id, rec_pq.prompt, rec_pq.gold, rec_pq.metadata["row"]) == ("2024-I-1", "p", "204", 1)


def test_missing_field_names_file_row_and_field(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"problem": "p", "answer": "1"}, {"problem": "p"}])
    with pytest.raises(SchemaError) as e:
        load_benchmark("math500", path)
    msg = str(e.value)
    assert str(path) in msg and "row 2" in msg and "'answer'" in msg


def test_row_numbers_are_line_numbers_and_bad_json_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "q", "answer": "#### 1"}\n\n{"question": "q"}\n')
    with pytest.raises(SchemaError, match=r"row 3: missing field 'answer'"):
        load_benchmark("gsm8k", path)
    path.write_text('{"question": "q", "answer": "#### 1"}\n{oops\n')
    with pytest.raises(SchemaError, match=r"bad.jsonl: row 2: not valid JSON"):
        load_benchmark("gsm8k", path)


def test_gsm8k_answer_without_final_line_is_a_schema_error(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "g.jsonl", [{"question": "q", "answer": "just text"}])
    with pytest.raises(SchemaError, match=r"g.jsonl: row 1: field 'answer' has no '#### N'"):
        load_benchmark("gsm8k", path)


def test_hub_unreachable_says_to_use_local_files() -> None:
    # conftest sets HF_HUB_OFFLINE / HF_DATASETS_OFFLINE: the hub path must fail with advice, not hang
    with pytest.raises(RuntimeError, match="data-dir"):
        load_benchmark("aime24", "no-such-org/no-such-dataset-a3po")


def test_arith_benchmark_is_generated_in_code() -> None:
    recs = load_benchmark("arith", limit=4)
    assert len(recs) == 4 and all(r.prompt.startswith("Question: ") and r.gold.isdigit() for r in recs)
    assert BENCHMARKS.get("arith").default_template == "raw"


def test_unknown_benchmark_lists_valid_ones() -> None:
    with pytest.raises(KeyError, match="aime24, arith, gsm8k, math500"):
        load_benchmark("mmlu")
