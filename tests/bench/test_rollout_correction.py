"""bench.rollout_correction on micro: ``none`` measures no mismatch, ``metrics`` measures it without a
correction, and ``--dtype auto`` says what the trainer computed in."""

from __future__ import annotations

import json

import pytest

from a3po.devices import machine_precision, resolve_device
from bench.rollout_correction import main


@pytest.mark.usefixtures("core_one_thread")
def test_micro_under_auto_measures_the_mismatch_with_and_without_a_correction(capsys):
    out = main(["--preset", "micro", "--dtype", "auto", "--methods", "none,metrics,tis", "--steps", "2", "--batch-prompts", "2"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(json.dumps(out))
    assert out["trainer_computes_in"] == machine_precision("auto", resolve_device("cpu")).name
    rows = {r["method"]: r for r in out["rows"]}
    assert all(r["trainer_computes_in"] == out["trainer_computes_in"] for r in rows.values())  # the run's own
    assert rows["none"]["logp_abs_err"] is None  # nothing re-scores a batch without a correction or metrics
    # A bf16 engine copy never matches the trainer's forward exactly; both ways of measuring see it.
    assert rows["metrics"]["logp_abs_err"] > 0 and rows["tis"]["logp_abs_err"] > 0
    assert rows["metrics"]["ratio_p99"] is None and rows["tis"]["ratio_p99"] is not None


def test_an_unknown_dtype_is_refused():
    with pytest.raises(SystemExit):
        main(["--dtype", "fp8"])
