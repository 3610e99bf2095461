"""Smoke test of ``python -m bench.version_push`` on the micro model: it runs both processes, its
last line is one JSON object, and each wire's bytes are the state dict's, counted here by hand."""

from __future__ import annotations

import json

import pytest

from bench import version_push
from bench.roofline import load


def test_version_push_runs_on_micro_and_ends_with_one_json_line(capsys):
    figures = version_push.main(["--model", "micro", "--reps", "1"])
    out = capsys.readouterr().out.strip().splitlines()
    assert json.loads(out[-1]) == json.loads(json.dumps(figures))
    assert figures["command"] == "python -m bench.version_push --model micro --reps 1"
    state = load("micro")[0].state_dict()
    fp32 = sum(v.numel() * v.element_size() for v in state.values()) / 2**20
    wires = figures["wires"]
    assert list(wires) == ["fp32", "fp32-once", "bf16-once"]
    assert wires["fp32"]["mb"] == pytest.approx(fp32, rel=1e-12)
    assert wires["bf16-once"]["mb"] == pytest.approx(wires["fp32-once"]["mb"] / 2, rel=1e-12)
    for w in wires.values():
        assert w["trainer_s"] == pytest.approx(w["pack"] + w["send"]) and w["trainer_s"] > 0
        assert w["worker_s"] == pytest.approx(w["receive"] + w["unpack"] + w["engine_load"]) and w["worker_s"] > 0


def test_version_push_refuses_an_unknown_wire():
    with pytest.raises(SystemExit):
        version_push.main(["--model", "micro", "--wires", "fp16"])
