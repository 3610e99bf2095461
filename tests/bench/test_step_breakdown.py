"""bench.step_breakdown: its argument checks, and (e2e) a micro run whose figures are each run's own
``metrics.jsonl`` means, float32 beside auto, with the ratios between them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.step_breakdown import main


@pytest.mark.parametrize("dtypes", ["float32", "float32,float32", "float32,fp8"])
def test_one_dtype_a_repeated_one_or_an_unknown_one_is_refused(dtypes, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--dtypes", dtypes])
    assert e.value.code == 2
    assert "--dtypes" in capsys.readouterr().err


def _means(run_dir: Path) -> dict[str, float]:
    (metrics,) = run_dir.rglob("metrics.jsonl")  # a launched (disaggregated) run writes one folder down
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in rows if "perf/step_time_s" in r]
    means = {k: sum(r[k] for r in steps) / len(steps) for k in ("perf/train_s", "perf/generate_s", "perf/idle_s")}
    return {**means, "step": sum(r["perf/step_time_s"] + r.get("perf/wait_time_s", 0.0) for r in steps) / len(steps)}


ARMS = ("sync", "loglinear", "sync@disaggregated", "loglinear@disaggregated")


@pytest.mark.e2e
@pytest.mark.usefixtures("core_one_thread", "prefect_server")
def test_micro_float32_beside_auto_reports_each_runs_own_phases(tmp_path, capsys):
    argv = ["--preset", "micro", "--steps", "2", "--variants", "sync,loglinear", "--placements", "colocated,disaggregated",
            "--output-dir", str(tmp_path)]
    out = main(argv)
    printed = capsys.readouterr().out
    assert json.loads(printed.strip().splitlines()[-1]) == json.loads(json.dumps(out))
    assert out["precisions"]["float32"] == "float32"
    for dtype in ("float32", "auto"):
        for arm in ARMS:
            (run_dir,) = (tmp_path / f"dtype-{dtype}").glob(f"{arm}-seed0-*")
            means = _means(run_dir)
            figs = out["rows"][dtype][arm]
            assert figs["mean_step_time_s"] == pytest.approx(means["step"])
            assert figs["mean_train_s"] == pytest.approx(means["perf/train_s"])
            assert figs["mean_generate_s"] == pytest.approx(means["perf/generate_s"])
            assert figs["mean_idle_s"] == pytest.approx(means["perf/idle_s"])
            assert f"| {arm} | {dtype} | {out['precisions'][dtype]} |" in printed
    for arm in ARMS:
        before, after = out["rows"]["float32"][arm], out["rows"]["auto"][arm]
        assert out["ratios"][arm]["auto"]["update"] == pytest.approx(before["mean_train_s"] / after["mean_train_s"], abs=1e-4)
        assert out["ratios"][arm]["auto"]["step"] == pytest.approx(before["mean_step_time_s"] / after["mean_step_time_s"], abs=1e-4)
    assert list(tmp_path.rglob("checkpoints")) == []  # a finished comparison keeps none, wherever a run put them
    # A second invocation on the same folder reuses both comparisons: the same figures, no new runs.
    again = main(argv)
    assert again["rows"] == json.loads(json.dumps(out["rows"]))
