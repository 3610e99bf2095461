"""``rl.staleness_control``: where an adaptive bound can run, refused elsewhere when the config is
built with a reason naming the field; its thresholds checked; what the run plan resolves."""

from __future__ import annotations

import pytest

from a3po.config import ConfigError, RunPlan, config_from_dict, staleness_settings

ADAPTIVE = {"staleness_control": "adaptive", "schedule": "threaded", "max_staleness": 4}


@pytest.mark.parametrize("rl, match", [
    ({"staleness_control": "sometimes"}, "rl.staleness_control: unknown staleness control 'sometimes'; valid: adaptive, fixed"),
    # where the bound cannot move mid-run
    ({**ADAPTIVE, "schedule": "deterministic"}, "rl.staleness_control 'adaptive' with rl.schedule 'deterministic'"),
    ({**ADAPTIVE, "variant": "sync"}, "rl.staleness_control 'adaptive' with rl.variant 'sync' and rl.max_staleness 4: the bound is 0"),
    ({**ADAPTIVE, "max_staleness": 0}, "rl.staleness_control 'adaptive' with rl.variant 'loglinear' and rl.max_staleness 0"),
    ({**ADAPTIVE, "max_staleness": 1}, "rl.staleness_control 'adaptive' with rl.max_staleness 1: the bound moves within"),
    # thresholds: out of range, or set where nothing reads them
    ({**ADAPTIVE, "staleness_idle_frac": 1.0}, "rl.staleness_idle_frac must be in \\(0, 1\\), got 1.0"),
    ({**ADAPTIVE, "staleness_max_iw": 1.0}, "rl.staleness_max_iw must be > 1, got 1.0"),
    ({**ADAPTIVE, "staleness_raise_iw": 2.5}, "rl.staleness_raise_iw must be in \\[1, rl.staleness_max_iw 2\\], got 2.5"),
    ({**ADAPTIVE, "staleness_raise_iw": 0.9}, "rl.staleness_raise_iw must be in \\[1"),
    ({**ADAPTIVE, "staleness_patience": 0}, "rl.staleness_patience must be >= 1, got 0"),
    ({"staleness_max_iw": 3.0, "staleness_patience": 4},
     "rl.staleness_control 'fixed' does not read rl.staleness_max_iw, rl.staleness_patience"),
])
def test_refused_naming_the_field(rl, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict({"rl": rl})


def test_rollout_workers_run_an_adaptive_bound_under_the_threaded_schedule_only():
    # The trainer pushes the bound with each version (a3po.placement.remote_rollouts); the deterministic
    # schedule fixes each batch's versions from the starting bound, workers or not.
    cfg = config_from_dict({"rl": ADAPTIVE, "distributed": {"rollout_workers": 1}})
    assert (cfg.rl.staleness_control, cfg.distributed.rollout_workers) == ("adaptive", 1)
    with pytest.raises(ConfigError, match="rl.staleness_control 'adaptive' with rl.schedule 'deterministic'"):
        config_from_dict({"rl": {**ADAPTIVE, "schedule": "deterministic"}, "distributed": {"rollout_workers": 1}})


def test_the_plan_starts_an_adaptive_bound_at_1_under_its_ceiling():
    fixed = RunPlan.of(config_from_dict({"rl": {"max_staleness": 4}}), cores=2)
    adaptive = RunPlan.of(config_from_dict({"rl": ADAPTIVE}), cores=2)
    sync = RunPlan.of(config_from_dict({"rl": {"variant": "sync"}}), cores=2)
    assert (fixed.staleness_control, fixed.start_bound, fixed.max_staleness) == ("fixed", 4, 4)
    assert (adaptive.staleness_control, adaptive.start_bound, adaptive.max_staleness) == ("adaptive", 1, 4)
    assert (sync.start_bound, sync.max_staleness) == (0, 0)


def test_null_thresholds_take_the_documented_defaults():
    s = staleness_settings(config_from_dict({"rl": {**ADAPTIVE, "staleness_patience": 5, "guard_max_err": 0.2}}).rl)
    assert (s.idle_frac, s.max_iw, s.raise_iw, s.max_err, s.patience) == (0.1, 2.0, 1.5, 0.2, 5)
