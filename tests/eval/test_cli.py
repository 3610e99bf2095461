"""``a3po eval`` (eval.cli.main): a table, then the key figures as one JSON object on the last line."""

from __future__ import annotations

import json
from pathlib import Path

from eval.cli import main
from eval.data import fixture_path


def test_tiny_model_on_fixtures(tmp_path: Path, capsys) -> None:
    rc = main([
        "--model", "tiny", "--benchmarks", "gsm8k,math500,aime24", "--data-dir", str(fixture_path("gsm8k").parent),
        "--limit", "2", "--max-new-tokens", "4", "--out", str(tmp_path),
    ])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    figures = json.loads(out[-1])
    assert figures["model"] == "tiny"
    assert {"gsm8k/pass@1", "math500/pass@1", "aime24/pass@1"} <= set(figures)
    assert figures["gsm8k/n_problems"] == 2
    assert any(line.startswith("benchmark") for line in out[:-1])  # the human-readable table comes first
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["benchmarks"]["aime24"]["pass@1"] == figures["aime24/pass@1"]
    assert len((tmp_path / "records.jsonl").read_text().splitlines()) == 3 * 2


def test_bad_arguments_and_paths_exit_2(tmp_path: Path, capsys) -> None:
    assert main(["--model", "tiny", "--n-samples", "2", "--k", "4"]) == 2
    assert main(["--model", str(tmp_path / "missing"), "--benchmarks", "arith"]) == 2
    assert main(["--model", "tiny", "--benchmarks", "mmlu", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "pass@4" in err and "does not exist" in err and "mmlu" in err
