"""Smoke test of ``python -m bench.roofline`` on the micro model: it runs, its last line is one JSON
object with the key figures, the FLOP counts are the hand-computed ones, and the rates are consistent."""

from __future__ import annotations

import json

import pytest

from bench import roofline

pytestmark = pytest.mark.usefixtures("core_one_thread")

ARGS = [
    "--model",
    "micro",
    "--threads",
    "1",
    "--matmul-n",
    "128",
    "--batch",
    "4",
    "--prompt-len",
    "6",
    "--response-len",
    "8",
    "--decode-tokens",
    "8",
    "--reps",
    "1",
    "--no-overlap",
]


def test_roofline_runs_on_micro_and_ends_with_one_json_line(capsys):
    figures = roofline.main(ARGS)
    out = capsys.readouterr().out.strip().splitlines()
    last = json.loads(out[-1])
    assert last == json.loads(json.dumps(figures))
    assert last["command"] == "python -m bench.roofline " + " ".join(ARGS)
    assert last["overlap"] == {"skipped": "--no-overlap"}
    precisions = ["float32", "bf16"] if last["native_bf16"] else ["float32"]
    assert sorted(last["peak_gflops"]) == sorted(precisions) and sorted(last["update"]) == sorted(precisions)
    assert sorted(last["decode"]) == sorted(f"{p}/{e}" for p in precisions for e in ("engine", "engine+inverse_cdf", "transformers"))
    # The micro model (tests/bench/test_prox_logp.py): 15,104 parameters, the tied embedding 146 x 32 = 4,672
    # of them, so the body is 10,432; hidden 32, vocabulary 146, 1 layer, 2 heads of 16 (32 on the query side).
    assert (last["params"], last["body_params"]) == (15_104, 10_432)
    # Update, 4 sequences of T = 6 + 8 = 14: forward 2*10,432*4*14 = 1,168,384 (body)
    # + 2*32*146*4*8 = 299,008 (head on the 8 response positions) + 2*1*4*14^2*32 = 50,176 (attention)
    # = 1,517,568; with the backward (2 x forward) 3 x that = 4,552,704.
    assert all(r["flops"] == 4_552_704 for r in last["update"].values())
    # Where the update's time goes: each kind of op timed, the matmuls (every layer has them) among them.
    for r in last["update"].values():
        assert list(r["breakdown"]) == ["matmul", "attention", "casts", "vocabulary", "the rest"]
        assert r["breakdown"]["matmul"] > 0 and r["breakdown"]["attention"] > 0 and r["breakdown"]["the rest"] > 0
    assert any(line.startswith("where the update's time goes") for line in out)
    for phase in ("update", "decode"):
        for key, r in last[phase].items():
            assert r["s"] > 0 and r["gflops"] > 0, key
            assert r["gflops"] == pytest.approx(r["flops"] / r["s"] / 1e9)
            peak = last["peak_gflops"][key.split("/")[0]]
            assert r["pct_peak"] == pytest.approx(100 * r["gflops"] / peak)
            # The matmul peak bounds what a model of 32-wide matmuls achieves (x5: the peak is measured
            # once, on a machine other work may share; the micro model's rates are far below it).
            assert r["gflops"] <= 5 * peak, key
    for key, r in last["decode"].items():
        assert 0 < r["tokens"] <= 4 * 8, key  # live rows' tokens: at most batch x new tokens
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["s"])
        # at least the prefill: 2*10,432*4*6 + 2*1*4*36*32 + 2*32*146*4 = 500,736 + 9,216 + 37,376 = 547,328
        assert r["flops"] > 547_328, key
    assert any(line.startswith("peak matmul 128^2") for line in out)
    keys = {"logprob_full_ms", "logprob_chunked_ms", "sample_multinomial_ms", "sample_inverse_cdf_ms"}
    assert sorted(last["vocabulary"]) == sorted(precisions)
    assert all(set(v) == keys and min(v.values()) > 0 for v in last["vocabulary"].values())


def test_roofline_refuses_bad_arguments():
    with pytest.raises(SystemExit):
        roofline.main(["--model", "micro", "--precisions", "fp16"])
    with pytest.raises(SystemExit):
        roofline.main(["--model", "micro", "--reps", "0"])
