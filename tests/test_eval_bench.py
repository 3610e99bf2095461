"""``python -m bench.grading``: 1000 realistic completions graded in under 10 s, every decision right."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.grading", *args], cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bench_on_fixtures() -> None:
    figures = _run("--data-dir", str(REPO / "eval" / "fixtures"))
    assert figures["n"] == 1000 and figures["wrong_decisions"] == 0 and figures["timeouts"] == 0
    assert figures["seconds"] < 10.0  # cold: the math-verify worker start is included
    assert figures["math_verify"] > 0 and figures["fast"] > 0  # both paths exercised


@pytest.mark.data
def test_bench_on_real_data(shared_data: Path) -> None:
    figures = _run("--data-dir", str(shared_data))
    assert figures["n"] == 1000 and figures["wrong_decisions"] == 0 and figures["seconds"] < 10.0
