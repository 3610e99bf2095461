"""Smoke test of ``python -m bench.prox_logp`` on the micro model: it runs, its last line is one
JSON object with the key figures, and the figures are consistent with each other."""

from __future__ import annotations

import json
import math

import pytest

from bench import prox_logp

pytestmark = pytest.mark.usefixtures("core_one_thread")

ARGS = ["--model", "micro", "--batch", "8", "--group-size", "2", "--seq-len", "6", "--minibatches", "2", "--repeats", "3", "--prox-inner", "5"]


def test_bench_runs_and_ends_with_one_json_line(capsys):
    figures = prox_logp.main(ARGS)
    out = capsys.readouterr().out.strip().splitlines()
    last = json.loads(out[-1])
    assert last == json.loads(json.dumps(figures))
    for key in ["params", "prox_time_loglinear_s", "prox_time_recompute_s", "prox_speedup", "step_time_sync_s",
                "step_time_recompute_s", "step_time_loglinear_s", "step_speedup_loglinear_vs_recompute", "command"]:
        assert key in last
    assert last["command"] == "python -m bench.prox_logp " + " ".join(ARGS)
    assert last["params"] == 15_104  # the micro model
    for key, value in last.items():
        if key.endswith("_s") or "speedup" in key:
            assert math.isfinite(value) and value > 0, key
    assert last["prox_speedup"] == pytest.approx(last["prox_time_recompute_s"] / last["prox_time_loglinear_s"])
    # A forward pass of even the micro model (8 x ~50 tokens) costs far more than loglinear's
    # few elementwise ops on the same (8, ~50) tensors.
    assert last["prox_time_recompute_s"] > last["prox_time_loglinear_s"]
    assert any("train_step" in line for line in out)


def test_bench_help_and_argument_checks(capsys):
    with pytest.raises(SystemExit) as e:
        prox_logp.parse_args(["--help"])
    assert e.value.code == 0
    assert "--repeats" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        prox_logp.parse_args(["--batch", "10", "--group-size", "4"])
    with pytest.raises(SystemExit):
        prox_logp.parse_args(["--batch", "12", "--group-size", "4", "--minibatches", "5"])
    assert prox_logp.parse_args([]).model == "small"
