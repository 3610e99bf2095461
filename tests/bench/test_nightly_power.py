"""The power bench's out-of-sample verdicts: nights drawn only from held-out seeds, judged against a
calibration on the others."""

from __future__ import annotations

import numpy as np
import pytest

from bench.nightly_power import detectable_shortfall, fail_rate_held_out, main


def test_held_out_nights_are_judged_against_the_other_seeds_calibration_alone():
    # Calibration: pooled differences 0, +0.01, -0.01 -> mu_h 0, sigma 0.01, N 3. At K = 2 the
    # shortfall threshold is -t_{0.95, 2} * 0.01 * sqrt(1/2 + 1/3) = -2.920 * 0.01 * 0.9129 = -0.0267.
    calibration = np.array([[0.0, 0.0], [0.01, 0.01], [-0.01, -0.01]])
    # Held out: 0, 0, -0.06. Nights (pairs): {0, 0} mean 0 passes; the two {0, -0.06} mean -0.03 fail.
    held_out = np.array([[0.0, 0.0], [0.0, 0.0], [-0.05, -0.07]])
    rate, nights = fail_rate_held_out("shortfall", calibration, held_out, 2, 0.0, tolerance=0.1)
    assert (rate, nights) == (pytest.approx(2 / 3), 3)
    # Shifted down by 0.03 every night is below -0.0267: all fail.
    assert fail_rate_held_out("shortfall", calibration, held_out, 2, 0.03, tolerance=0.1)[0] == 1.0
    # Control: the same nights against a calibration that includes the -0.06 seed pass (mu_h -0.015,
    # sigma 0.0311, N 4: threshold -0.015 - 2.353 * 0.0311 * sqrt(1/2 + 1/4) = -0.078).
    wide = np.vstack([calibration, held_out[2:]])
    assert fail_rate_held_out("shortfall", wide, held_out, 2, 0.0, tolerance=0.1)[0] == 0.0


def test_held_out_seeds_that_are_calibration_seeds_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--runs-dir", str(tmp_path), "--seeds", "0-3", "--holdout-seeds", "3-5", "--report-only"])
    assert stop.value.code == 2
    assert "share [3]" in capsys.readouterr().err


def test_the_detectable_shortfall_is_the_rules_threshold_plus_the_powers_quantile():
    # sigma 0.01 on N = 3 seeds, a night of K = 2: (t_{0.95, 2} + z_{0.8}) sigma sqrt(1/2 + 1/3)
    # = (2.9200 + 0.8416) x 0.01 x 0.91287 = 0.03434 (t and z from the tables).
    assert detectable_shortfall(0.01, 3, 2) == pytest.approx(0.03434, abs=2e-5)
    # More calibration seeds and more seeds a night both shrink it: N = 10, K = 6,
    # (1.8331 + 0.8416) x 0.01 x sqrt(1/6 + 1/10) = 0.01381.
    assert detectable_shortfall(0.01, 10, 6) == pytest.approx(0.01381, abs=2e-5)


@pytest.mark.parametrize("effects", ["", "-0.1", "a"])
def test_effects_that_are_not_shortfalls_are_refused(effects, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--runs-dir", str(tmp_path), "--effects", effects, "--report-only"])
    assert stop.value.code == 2
    assert "--effects" in capsys.readouterr().err
