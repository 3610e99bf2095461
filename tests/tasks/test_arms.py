"""The staleness axis of an arm (tasks.arms): ``+s<N>`` (a fixed bound) and ``+adaptive[-s<N>]``
(rl.staleness_control adaptive), their names written and read in one place, the configs they build,
their refusals, and the baselines a row is compared with."""

from __future__ import annotations

import pytest

from a3po.config import ConfigError, preset, with_overrides
from tasks.arms import DEFAULT_BOUND, Arm, expand_arms
from tasks.summary import baselines_of

NAMES = ["loglinear+s4", "recompute+s0", "loglinear+adaptive", "loglinear+adaptive-s8", "loglinear+oppo-inter+s1",
         "loglinear+oppo-inter+adaptive@disaggregated", "recompute+s16@disaggregated"]


@pytest.mark.parametrize("name", NAMES)
def test_a_name_round_trips(name):
    assert Arm.parse(name).name == name
    assert Arm.model_validate(name) == Arm.parse(name)  # wherever an Arm is expected, a name is read


def test_the_fields_a_name_gives_and_the_default_bound_left_out():
    assert DEFAULT_BOUND == 2  # rl.max_staleness's default, the presets' bound
    assert Arm.parse("loglinear+s4") == Arm(variant="loglinear", max_staleness=4)
    assert Arm.parse("loglinear+adaptive") == Arm(variant="loglinear", staleness_control="adaptive")
    assert Arm.parse("loglinear+oppo-inter+adaptive-s8@disaggregated") == Arm(
        variant="loglinear", oppo="inter", staleness_control="adaptive", max_staleness=8, placement="disaggregated")
    assert Arm.parse("loglinear+s4+oppo-inter").name == "loglinear+oppo-inter+s4"  # read in any order, written in one
    assert Arm.parse("loglinear+s2").name == "loglinear" and Arm.parse("loglinear+adaptive-s2").name == "loglinear+adaptive"
    assert Arm(variant="loglinear", staleness_control="fixed", max_staleness=2).name == "loglinear"


@pytest.mark.parametrize("name, match", [
    ("sync+s4", "'sync' with a staleness bound: sync trains on-policy"),
    ("sync+adaptive", "'sync' with a staleness bound"),
    ("loglinear+s4+s8", "two parts name its staleness bound"),
    ("loglinear+s4+adaptive", "two parts name its staleness bound"),
    ("loglinear+oppo-inter+oppo-off", "two parts name its OPPO mode"),
    ("loglinear+fast", "'fast' is neither an OPPO mode"),
    ("loglinear+s04", "'s04' is neither"),
    ("loglinear+adaptive-4", "'adaptive-4' is neither"),
    ("loglinear+oppo-sideways+s4", "unknown OPPO mode 'sideways'"),
])
def test_names_that_are_no_arm_are_refused_naming_why(name, match):
    with pytest.raises(ValueError, match=match):
        Arm.parse(name)


def test_the_configs_the_staleness_arms_build():
    base = preset("micro")
    s4 = Arm.parse("loglinear+s4").config(base, seed=1)
    assert (s4.rl.max_staleness, s4.rl.staleness_control, s4.rl.schedule) == (4, "fixed", "deterministic")
    adaptive = Arm.parse("loglinear+adaptive").config(base, seed=1)
    # The bound moves under the threaded schedule only: the adaptive arm runs it, under the config's ceiling.
    assert (adaptive.rl.max_staleness, adaptive.rl.staleness_control, adaptive.rl.schedule) == (2, "adaptive", "threaded")
    assert Arm.parse("loglinear+adaptive-s8").config(base, 0).rl.max_staleness == 8
    for name in NAMES[:5]:  # colocated: every one builds, and its config runs the arm of its name
        assert Arm.of(Arm.parse(name).config(base, 0)).name == name
    # A bare variant runs the config's bound, and its name says so where it is not the default.
    base4 = with_overrides(base, rl={"max_staleness": 4})
    assert Arm.of(Arm.parse("loglinear").config(base4, 0)).name == "loglinear+s4"
    assert Arm.of(Arm.parse("loglinear+s2").config(base4, 0)).name == "loglinear"
    assert Arm.of(Arm.parse("sync").config(base4, 0)) == Arm(variant="sync", oppo="off", placement="colocated")


def test_adaptive_arms_where_the_bound_cannot_move_are_refused_naming_the_field():
    with pytest.raises(ConfigError, match="rl.staleness_control 'adaptive' with rl.max_staleness 1"):
        Arm.parse("loglinear+adaptive-s1").config(preset("micro"), 0)
    assert Arm.parse("loglinear+oppo-inter+adaptive").config(preset("micro"), 0).oppo.inter  # colocated: it runs
    disaggregated = Arm.parse("loglinear+adaptive-s8@disaggregated").config(preset("micro"), 0)  # workers take the bound
    assert (disaggregated.rl.staleness_control, disaggregated.rl.max_staleness) == ("adaptive", 8)
    assert disaggregated.distributed.rollout_workers == 1


def test_arms_expand_and_compare_with_sync_and_recompute_at_their_bound():
    names = ["loglinear+s1", "loglinear+s2", "loglinear+s4", "loglinear+s8", "loglinear+adaptive"]
    assert [a.name for a in expand_arms(names, None)] == ["loglinear+s1", "loglinear", "loglinear+s4", "loglinear+s8",
                                                          "loglinear+adaptive"]
    # A name's own OPPO mode or placement is kept; --oppo / --placements fill in the others.
    assert [a.name for a in expand_arms(["loglinear+oppo-inter+s4", "loglinear+s4"], ["off"], ["disaggregated"])] == [
        "loglinear+oppo-inter+s4@disaggregated", "loglinear+s4@disaggregated"]
    # A looser or adaptive bound is also weighed against the same arm at bound 1; bound 1 only against sync and recompute.
    assert [b.name for b in baselines_of(Arm.parse("loglinear+s4"))] == ["sync", "recompute+s4", "loglinear+s1"]
    assert [b.name for b in baselines_of(Arm.parse("loglinear+s1"))] == ["sync", "recompute+s1"]
    assert [b.name for b in baselines_of(Arm.parse("loglinear+oppo-inter+adaptive"))] == [
        "sync", "recompute+adaptive", "loglinear+adaptive", "loglinear+oppo-inter+s1"]
    assert [b.name for b in baselines_of(Arm.parse("loglinear@disaggregated"))] == ["sync@disaggregated",
                                                                                     "recompute@disaggregated",
                                                                                     "loglinear+s1@disaggregated"]


def test_bounds_are_paired_with_bound_1_by_seed():
    """Fixed bounds and the adaptive one against ``+s1``, paired by seed: the table's speedup
    column and the pairs with their intervals; never as if the bound-1 arm were OPPO off."""
    from tasks.pairs import Setting, pairs
    from tasks.summary import ArmRun, compare

    def record(arm: str, seed: int, step_s: float, rewards: list[float]) -> dict:
        history = [{"reward/mean": r, "perf/step_time_s": step_s, "perf/wait_time_s": 0.0, "time/train_wall_s": step_s * (i + 1)}
                   for i, r in enumerate(rewards)]
        return {"variant": "loglinear", "arm": arm, "seed": seed, "history": history, "final_acc": 0.5, "warmstart_acc": 0.2}

    curve = [0.0, 0.2, 0.5, 1.0]
    step = {("loglinear+s1", 0): 2.0, ("loglinear+s1", 1): 3.0, ("loglinear+s8", 0): 1.0, ("loglinear+s8", 1): 2.0,
            ("loglinear+adaptive-s8", 0): 2.0, ("loglinear+adaptive-s8", 1): 2.0}
    comp = compare([ArmRun.of(record(arm, seed, s, curve)) for (arm, seed), s in step.items()])
    rows = {r["variant"]: r for r in comp.rows}
    assert rows["loglinear+s8"]["speedup_step_vs_s1"] == pytest.approx(2.5 / 1.5)  # means over the seeds
    assert "speedup_step_vs_s1" not in rows["loglinear+s1"]
    assert not any(k.endswith("vs_oppo_off") or k.endswith("vs_loglinear") for row in rows.values() for k in row)
    assert comp.metrics["speedup/loglinear_s8_vs_loglinear_s1/step_time"] == pytest.approx(2.5 / 1.5)
    from tasks.summary import table

    assert table(comp)["step speedup vs bound 1"].tolist()[1:] == [pytest.approx(2.5 / 1.5), pytest.approx(1.25)]
    found = {p.label: p for p in pairs(comp.rows, Setting("micro", 4))}
    assert set(found) == {"loglinear+s8 vs loglinear+s1", "loglinear+adaptive-s8 vs loglinear+s1"}
    s8 = found["loglinear+s8 vs loglinear+s1"]
    assert s8.seeds == [0, 1] and s8.step_time.n == 2
    assert s8.step_time.point == pytest.approx((2.0 * 1.5) ** 0.5)  # geometric mean of the per-seed ratios 2/1, 3/2
