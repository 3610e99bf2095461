"""bench.evaluation: its argument checks, and (e2e) a micro model's evaluation on two thread
counts and two dtypes whose rows are the evaluation runner's own figures."""

from __future__ import annotations

import json

import pytest

from a3po.devices import cpu_native_bf16
from bench.evaluation import main


@pytest.mark.parametrize("option,value", [*(("--threads", v) for v in ("", "0,1", "2,2", "a")),
                                          *(("--dtypes", v) for v in ("", "float16", "auto,auto"))])
def test_an_empty_zero_repeated_or_unknown_entry_is_refused_naming_its_option(option, value, capsys):
    with pytest.raises(SystemExit) as e:
        main([option, value])
    assert e.value.code == 2
    assert option in capsys.readouterr().err


@pytest.mark.e2e
def test_micro_on_one_and_two_threads_reports_the_runners_figures(tmp_path, capsys):
    data = tmp_path / "data" / "gsm8k"
    data.mkdir(parents=True)
    rows = [{"question": f"What is {a} plus {a}?", "answer": f"{a} + {a} = {2 * a}\n#### {2 * a}"} for a in range(1, 6)]
    (data / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = main(["--preset", "micro", "--threads", "1,2", "--dtypes", "float32,auto", "--benchmarks", "gsm8k",
                "--data-dir", str(tmp_path / "data"), "--bench-limit", "4", "--bench-max-new-tokens", "6",
                "--cache", str(tmp_path / "cache")])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(json.dumps(out))
    assert [(r["dtype"], r["threads"]) for r in out["rows"]] == [("float32", 1), ("float32", 2), ("auto", 1), ("auto", 2)]
    assert {r["weights"] for r in out["rows"][:2]} == {"float32"}
    assert {r["weights"] for r in out["rows"][2:]} == {"bfloat16" if cpu_native_bf16() else "float32"}
    for r in out["rows"]:
        results = json.loads((tmp_path / "cache" / f"{r['dtype']}-threads-{r['threads']}" / "results.json").read_text())
        gsm8k = results["benchmarks"]["gsm8k"]
        assert gsm8k["n_problems"] == 4
        assert r["figures"]["gsm8k/pass_at_1"] == gsm8k["pass@1"]
        assert r["benchmarks_s"] == pytest.approx(gsm8k["seconds"], abs=0.01)
        assert r["total_s"] == pytest.approx(r["benchmarks_s"] + r["rest_s"], abs=0.02)
        assert r["speedup"] == pytest.approx(out["rows"][0]["total_s"] / r["total_s"], rel=1e-3)
