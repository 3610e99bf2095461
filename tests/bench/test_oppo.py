"""bench.oppo: the settings' oppo sections with the bench's pins, its argument checks, and (slow)
a micro run where every PPO setting, intra + inter included, runs and reports."""

from __future__ import annotations

import pytest

from bench._ppo_workload import SETTINGS, oppo_overrides, parse_args
from bench.oppo import main


def test_pins_apply_to_the_mechanism_they_belong_to():
    args = parse_args(["--path", "ppo", "--chunk", "8", "--delta", "3"])
    assert oppo_overrides(args, SETTINGS["ppo"]["off"]) == {}
    assert oppo_overrides(args, SETTINGS["ppo"]["intra"]) == {"intra": True, "chunk_min": 8, "chunk_max": 8}
    assert oppo_overrides(args, SETTINGS["ppo"]["inter"]) == {"inter": True, "delta_init": 3, "delta_min": 3, "delta_max": 3}
    both = oppo_overrides(args, SETTINGS["ppo"]["both"])
    assert both["chunk_min"] == 8 and both["delta_max"] == 3
    free = parse_args(["--path", "ppo", "--chunk", "0", "--delta", "-1"])
    assert oppo_overrides(free, SETTINGS["ppo"]["both"]) == {"intra": True, "inter": True}  # the tuner and the Delta rule


@pytest.mark.parametrize("argv", [["--steps", "1"], ["--max-staleness", "-1"], ["--chunk", "-2"], ["--delta", "-2"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        parse_args(argv)


@pytest.mark.slow
@pytest.mark.usefixtures("core_one_thread")
def test_micro_ppo_bench_runs_every_setting():
    out = main(["--path", "ppo", "--preset", "micro", "--steps", "2", "--max-new-tokens", "8"])
    assert set(out["settings"]) == {"off", "intra", "inter", "both"}
    assert not any("refused" in f for f in out["settings"].values())
    assert out["settings"]["both"]["chunk_sizes"] == [16] and out["settings"]["both"]["carried_mean"] >= 0
    assert out["settings"]["off"]["bound_by"] == "in turn"
    # Without TRL 1.12 in this environment the TRL row says why and how to install it.
    assert isinstance(out["trl_ppo"], dict) or out["trl_ppo"].startswith("not run: ") and "bench-ppo" in out["trl_ppo"]
    assert {"speedup_intra", "speedup_inter", "speedup_both"} <= set(out)
