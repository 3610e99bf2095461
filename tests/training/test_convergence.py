"""Each variant learns on the embedded preset: the convergence check (+0.15 held-out accuracy per variant), end to end.

Runs the documented command ``a3po train --variant V --preset tiny --seed 0`` for the three
variants (one shared warm start) and reads each run's JSON line. Slow tier: ~6 min on 2 cores.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

MIN_GAIN = 0.15  # absolute held-out accuracy over the warm start
MAX_RL_SECONDS = 600  # "within 10 minutes of training per variant"


@pytest.mark.parametrize("variant", ["sync", "recompute", "loglinear"])
def test_variant_raises_heldout_accuracy(variant, tmp_path_factory):
    out = tmp_path_factory.getbasetemp() / "convergence"  # shared, so the warm start is built once
    proc = subprocess.run(
        [sys.executable, "-m", "a3po.training.command", "--variant", variant, "--preset", "tiny", "--seed", "0",
         "--output-dir", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert 0.15 <= result["warmstart_acc"] <= 0.6, result  # partial competence, room for RL
    assert result["final_acc"] - result["warmstart_acc"] >= MIN_GAIN, result
    assert result["rl_wall_s"] < MAX_RL_SECONDS, result  # RL steps and their held-out evaluations
