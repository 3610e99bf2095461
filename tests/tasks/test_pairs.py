"""Each arm against each baseline with 95% intervals over paired seeds (tasks.pairs): per-seed ratios,
their geometric mean and Student's t interval on the log ratios, the reward difference's t interval, the
verdict words, the calibrated reward rule and the table. Pure functions on hand-made rows; milliseconds."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from a3po.training.metrics import valid_metric_key
from tasks.arms import Arm
from tasks.pairs import (
    SETS_DIFFER,
    Interval,
    Setting,
    agree,
    calibrated_shortfall,
    pair_metrics,
    pairs,
    pairs_markdown,
    speed_verdict,
    summarise_pairs,
    summarise_replicated_pairs,
)
from tasks.summary import ArmRun, compare

UNCALIBRATED = Setting("smol", 40)


def _row(name: str, seeds: dict[int, tuple[float, float | None, float]]) -> dict:
    """A row of tasks.summary.compare as tasks.pairs reads it: seed -> (mean step time, time to target, final reward)."""
    return {"variant": name, "per_seed": [{"seed": s, "mean_step_time_s": t, "time_to_target_s": d, "final_reward": r}
                                          for s, (t, d, r) in seeds.items()]}


def _pair(found, arm: str, baseline: str):
    (p,) = [p for p in found if (p.arm, p.baseline) == (arm, baseline)]
    return p


# Three paired seeds. loglinear's step time is 1 s and its times to target 10, 20, 30 s; sync's are
# exp(l) times those, so the per-seed ratios sync / loglinear are exp(l) with the log ratios below.
E = math.exp
THREE = [
    _row("loglinear", {0: (1.0, 10.0, 0.51), 1: (1.0, 20.0, 0.43), 2: (1.0, 30.0, 0.35)}),
    _row("sync", {0: (E(0.1), 10 * E(0.5), 0.50), 1: (E(0.2), 20 * E(0.6), 0.40), 2: (E(0.3), 30 * E(0.7), 0.30)}),
]


def test_three_seeds_by_hand():
    p = _pair(pairs(THREE, UNCALIBRATED), "loglinear", "sync")
    assert p.seeds == [0, 1, 2]
    # Step time: l = 0.1, 0.2, 0.3 -> mean 0.2, sd = sqrt((0.01 + 0 + 0.01) / 2) = 0.1,
    # h = t_{0.975,2} * sd / sqrt(3) = 4.303 * 0.1 / 1.7321 = 0.24841;
    # geometric mean exp(0.2) = 1.22140, interval [exp(-0.04841), exp(0.44841)] = [0.95274, 1.56583]: holds 1.
    assert (p.step_time.n, p.step_time.point, p.step_time.low, p.step_time.high) == (
        3, pytest.approx(1.22140, abs=1e-4), pytest.approx(0.95274, abs=1e-4), pytest.approx(1.56583, abs=1e-4))
    assert speed_verdict(p.step_time) == "not settled"
    # Time to target: l = 0.5, 0.6, 0.7 -> mean 0.6, the same sd and h: exp(0.6) = 1.82212,
    # [exp(0.35159), exp(0.84841)] = [1.42132, 2.33594]: the low end is above 1.
    assert (p.ttt.n, p.ttt.point, p.ttt.low, p.ttt.high) == (
        3, pytest.approx(1.82212, abs=1e-4), pytest.approx(1.42132, abs=1e-4), pytest.approx(2.33594, abs=1e-4))
    assert speed_verdict(p.ttt) == "faster"
    # Reward: d = 0.51 - 0.50, 0.43 - 0.40, 0.35 - 0.30 = 0.01, 0.03, 0.05 -> mean 0.03, sd 0.02,
    # h = 4.303 * 0.02 / 1.7321 = 0.04969: [-0.01969, 0.07969].
    assert (p.reward.n, p.reward.point, p.reward.low, p.reward.high) == (
        3, pytest.approx(0.03, abs=1e-9), pytest.approx(-0.01969, abs=1e-4), pytest.approx(0.07969, abs=1e-4))
    assert p.reward_verdict == "no calibration for smol at 40 steps"  # an interval, never a pass
    m = pair_metrics([p])
    assert m["pairs/loglinear_vs_sync/step_time_ratio_lo"] == pytest.approx(0.95274, abs=1e-4)
    assert m["pairs/loglinear_vs_sync/ttt_ratio_hi"] == pytest.approx(2.33594, abs=1e-4)
    assert m["pairs/loglinear_vs_sync/reward_diff"] == pytest.approx(0.03)
    assert m["pairs/loglinear_vs_sync/seeds"] == m["pairs/loglinear_vs_sync/ttt_seeds"] == 3
    assert all(valid_metric_key(k) for k in m)
    # The table's row, as printed.
    assert ("| loglinear vs sync | 3 | 1.221 [0.953, 1.566] | not settled | 1.822 [1.421, 2.336] (3 of 3 seeds) | faster | "
            "+0.030 [-0.020, +0.080] | no calibration for smol at 40 steps |") in pairs_markdown([p])


def test_one_seed_gives_the_figure_and_no_interval():
    # loglinear 2 s a step, recompute 3 s: ratio 1.5; time to target 40 / 20 = 2; reward 0.3 - 0.2.
    found = pairs([_row("loglinear", {7: (2.0, 20.0, 0.3)}), _row("recompute", {7: (3.0, 40.0, 0.2)})], UNCALIBRATED)
    p = _pair(found, "loglinear", "recompute")
    assert p.step_time == Interval(1, pytest.approx(1.5))
    assert p.ttt == Interval(1, pytest.approx(2.0)) and p.reward == Interval(1, pytest.approx(0.1))
    assert speed_verdict(p.step_time) == speed_verdict(p.ttt) == "not settled (1 seed)"
    m = pair_metrics([p])
    assert m["pairs/loglinear_vs_recompute/step_time_ratio"] == pytest.approx(1.5)
    assert not any(k.endswith(("_lo", "_hi")) for k in m)  # never an interval of width 0
    assert "| 1.500 (1 seed: no interval) | not settled (1 seed) | 2.000 (1 seed: no interval) (1 of 1 seeds) |" in pairs_markdown([p])


def test_a_seed_without_time_to_target_leaves_the_ratio_and_is_counted():
    # Seed 1 of sync never reached the target: its time-to-target ratio is left out, the step time
    # and reward keep all three seeds. l = 0.5, 0.7 -> mean 0.6, sd = sqrt(0.01 + 0.01) = 0.14142,
    # h = t_{0.975,1} * sd / sqrt(2) = 12.706 * 0.1 = 1.2706: [exp(-0.6706), exp(1.8706)] = [0.51140, 6.4922].
    rows = [THREE[0], _row("sync", {0: (E(0.1), 10 * E(0.5), 0.50), 1: (E(0.2), None, 0.40), 2: (E(0.3), 30 * E(0.7), 0.30)})]
    p = _pair(pairs(rows, UNCALIBRATED), "loglinear", "sync")
    assert (p.step_time.n, p.ttt.n, p.reward.n) == (3, 2, 3)
    assert (p.ttt.point, p.ttt.low, p.ttt.high) == (pytest.approx(E(0.6)), pytest.approx(0.51140, abs=1e-4), pytest.approx(6.4922, abs=1e-3))
    assert speed_verdict(p.ttt) == "not settled"
    assert "(2 of 3 seeds)" in pairs_markdown([p])
    assert pair_metrics([p])["pairs/loglinear_vs_sync/ttt_seeds"] == 2
    # No seed reached it: no figure, no verdict, and no metric.
    none = _pair(pairs([THREE[0], _row("sync", {0: (1.0, None, 0.5)})], UNCALIBRATED), "loglinear", "sync")
    assert none.ttt == Interval(0) and speed_verdict(none.ttt) == "-"
    assert "pairs/loglinear_vs_sync/ttt_ratio" not in pair_metrics([none])


@pytest.mark.parametrize("low, high, word", [
    (1.0, 1.3, "not settled"),  # the low end must be above 1, not at it
    (1.0001, 1.3, "faster"),
    (0.7, 1.0, "not settled"),
    (0.7, 0.9999, "slower"),
    (0.9, 1.1, "not settled"),
])
def test_speed_verdict_at_the_edges_reads_the_interval(low, high, word):
    assert speed_verdict(Interval(3, 1.0, low, high)) == word
    assert speed_verdict(Interval(1, 5.0)) == "not settled (1 seed)"  # however far from 1 the point


def _records(diffs: list[float]) -> list[dict]:
    """Runs of loglinear, recompute and sync on seeds 0..K-1 whose final rewards (one-step histories)
    put loglinear ``diffs[s]`` from the references' mean (both at 0.5)."""
    return [{"arm": arm, "seed": s, "history": [{"reward/mean": 0.5 + (d if arm == "loglinear" else 0.0)}]}
            for arm in ("loglinear", "recompute", "sync") for s, d in enumerate(diffs)]


def _rows(records: list[dict]) -> list[dict]:
    by_arm: dict[str, dict] = {}
    for r in records:
        by_arm.setdefault(r["arm"], {})[r["seed"]] = (1.0, None, r["history"][-1]["reward/mean"])
    return [_row(arm, seeds) for arm, seeds in by_arm.items()]


# A recorded setting (preset, steps): the calibrated rule applies there, to loglinear against recompute and sync pooled.
CALIBRATED = Setting("tiny", 75)  # measured on seeds 10-19 (tasks.parity.CALIBRATIONS)


@pytest.mark.parametrize("diff, word", [(0.0, "pass"), (-0.3, "FAIL")])
def test_the_reward_is_judged_by_the_calibrated_shortfall_rule_where_there_is_one(diff, word):
    # Any recorded sd is a few hundredths: level with the references passes, 0.3 below fails.
    records = _records([diff, diff, diff])
    shortfall, note = calibrated_shortfall(records, CALIBRATED)
    assert shortfall is not None and shortfall.passed == (word == "pass") and shortfall.mean_diff == pytest.approx(diff)
    assert note.endswith("; out of sample")  # seeds 0-2 are none of the calibration's 10-19
    # At 150 steps the recorded calibration is of seeds 0-9: the same seeds are judged in sample.
    assert "IN SAMPLE: seeds [0, 1, 2] are calibration seeds" in calibrated_shortfall(records, Setting("tiny", 150))[1]
    found = pairs(_rows(records), CALIBRATED, shortfall)
    assert _pair(found, "loglinear", "sync").reward_verdict == f"{word} (calibrated shortfall vs recompute, sync pooled)"
    assert _pair(found, "loglinear", "recompute").reward_verdict.startswith(word)
    assert _pair(found, "loglinear", "sync").passed == (word == "pass") and _pair(found, "sync", "recompute").passed is None
    assert _pair(found, "sync", "recompute").reward_verdict == "no calibration for this pair (interval only)"
    pooled = _pair(found, "loglinear", "pooled")
    assert pooled.pooled == ("recompute", "sync") and pooled.reward.low < diff < pooled.reward.high
    assert pair_metrics(found)["pairs/loglinear_vs_pooled/reward_pass"] == float(word == "pass")
    assert f"| loglinear vs pooled (recompute, sync) | 3 | - | - | - | - | {diff:+.3f} [" in pairs_markdown(found)


def test_no_calibration_reports_the_interval_and_says_so():
    records = _records([0.0, -0.3, 0.0])
    for setting, why in ((Setting("smol", 40), "recorded:"), (replace(CALIBRATED, changed=("overrides",)), "overrides"),
                         (replace(CALIBRATED, smooth_frac=0.5), "smooth_frac")):
        shortfall, note = calibrated_shortfall(records, setting)
        assert shortfall is None and note.startswith(setting.uncalibrated) and why in note
        found = pairs(_rows(records), setting, shortfall)
        assert {p.reward_verdict for p in found} == {f"no calibration for {setting.preset} at {setting.steps} steps"}
        assert not any(p.baseline == "pooled" for p in found)
    # The calibrated setting without the references it was measured against.
    shortfall, note = calibrated_shortfall([r for r in records if r["arm"] != "recompute"], CALIBRATED)
    assert shortfall is None and "recompute, sync" in note


def test_the_pairs_of_a_comparison_land_in_its_summary(tmp_path):
    # Through tasks.summary.compare: its rows' per-seed figures are what the pairs read. Two seeds, two
    # steps each; loglinear's step (perf/step_time_s + perf/wait_time_s) is 1 s, sync's 2 s and 3 s.
    def run(arm: str, seed: int, step: float, rewards: list[float]) -> ArmRun:
        history = [{"reward/mean": r, "perf/step_time_s": step, "time/train_wall_s": step * (i + 1)} for i, r in enumerate(rewards)]
        return ArmRun(arm=Arm.parse(arm), seed=seed, history=history, warmstart_acc=0.1, final_acc=0.2)

    runs = [run("loglinear", 0, 1.0, [0.1, 0.5]), run("loglinear", 1, 1.0, [0.1, 0.5]),
            run("sync", 0, 2.0, [0.1, 0.4]), run("sync", 1, 3.0, [0.1, 0.4])]
    comp = compare(runs)
    summary = {"rows": comp.rows, "metrics": dict(comp.metrics), "artifacts": ["comparison.md"]}
    records = [{"arm": r.arm.name, "seed": r.seed, "history": r.history} for r in runs]
    out = summarise_pairs.fn(summary, records, UNCALIBRATED, str(tmp_path))
    # Step ratios 2 and 3: geometric mean sqrt(6) = 2.449; final reward (window 1 of 2 steps): 0.5 - 0.4 = 0.1 on both seeds.
    assert out["metrics"]["pairs/loglinear_vs_sync/step_time_ratio"] == pytest.approx(math.sqrt(6))
    assert out["metrics"]["pairs/loglinear_vs_sync/reward_diff"] == pytest.approx(0.1)
    assert out["metrics"]["speedup/loglinear_vs_sync/step_time"] == summary["metrics"]["speedup/loglinear_vs_sync/step_time"]  # kept
    assert out["artifacts"] == ["comparison.md", str(tmp_path / "pairs.md"), str(tmp_path / "summary.json")]
    written = json.loads((tmp_path / "summary.json").read_text())  # the summary file holds the pairs too
    assert written["pairs"][0]["step_time"]["point"] == pytest.approx(math.sqrt(6)) and written["pairs_md"] == out["pairs_md"]
    assert (tmp_path / "pairs.md").read_text() == out["pairs_md"] and "| loglinear vs sync | 2 |" in out["pairs_md"]
    assert out["pairs"][0]["arm"] == "loglinear" and out["pairs"][0]["step_time"]["n"] == 2


def _cells(md: str, label: str, figure: str) -> list[str]:
    (line,) = [x for x in md.splitlines() if x.startswith(f"| {label} | {figure} |")]
    return [c.strip() for c in line.strip("| ").split(" | ")]


def test_two_seed_sets_side_by_side_a_verdict_stands_only_when_both_give_it(tmp_path):
    # Step-time log ratios sync / loglinear: set A (seeds 0, 1) 0.50, 0.52 -> mean 0.51, sd 0.01414,
    # t_{0.975,1} = 12.706: h = 12.706 x 0.01414 / sqrt(2) = 0.1271 -> exp: 1.665 [1.467, 1.891], faster.
    # Set B (seeds 2, 3) 0.5, 0.7 -> mean 0.6, sd 0.1414, h = 1.2706 -> 1.822 [0.511, 6.49], not settled.
    # Time to target: loglinear 10 s, sync 20 s and 21 s on each set: log ratios ln 2, ln 2.1 -> mean 0.7175,
    # sd 0.0345, h = 0.310 -> [1.50, 2.79] on both sets: faster twice, so faster stands.
    def row(name: str, figures: dict[int, tuple[float, float]]) -> dict:
        return _row(name, {s: (t, d, 0.5) for s, (t, d) in figures.items()})

    a = [row("loglinear", {0: (1.0, 10.0), 1: (1.0, 10.0)}), row("sync", {0: (E(0.50), 20.0), 1: (E(0.52), 21.0)})]
    b = [row("loglinear", {2: (1.0, 10.0), 3: (1.0, 10.0)}), row("sync", {2: (E(0.5), 20.0), 3: (E(0.7), 21.0)}),
         row("recompute", {2: (1.0, 10.0), 3: (1.0, 10.0)})]  # on set B only: nothing to replicate
    records = [{"arm": r["variant"], "seed": f["seed"]} for r in a + b for f in r["per_seed"]]
    out = summarise_replicated_pairs.fn([("A", (0, 1), a), ("B", (2, 3), b)], records, UNCALIBRATED, str(tmp_path))
    md = out["markdown"]
    assert (tmp_path / "pairs_by_set.md").read_text() == md and out["artifacts"] == [str(tmp_path / "pairs_by_set.md")]
    assert "| arm vs baseline | figure | set A (seeds 0, 1) | verdict A | set B (seeds 2, 3) | verdict B | both sets |" in md
    step = _cells(md, "loglinear vs sync", "step-time ratio")
    assert step[3] == "faster" and step[5] == "not settled" and step[6] == SETS_DIFFER
    low, high = (float(x) for x in step[2].split("[")[1].rstrip("]").split(", "))
    assert (low, high) == (pytest.approx(1.467, abs=1e-3), pytest.approx(1.891, abs=1e-3))
    ttt = _cells(md, "loglinear vs sync", "time-to-target ratio")
    assert ttt[3] == ttt[5] == ttt[6] == "faster" and ttt[2].endswith("(2 of 2)")
    reward = _cells(md, "loglinear vs sync", "reward diff")
    assert reward[2] == reward[4] == "+0.000 [+0.000, +0.000]" and reward[6] == "no calibration"
    assert "recompute" not in md.split("\n\n")[0]  # a pair of one set is not shown as replicated
    assert out["metrics"]["pairs_set_A/loglinear_vs_sync/step_time_ratio"] == pytest.approx(E(0.51))
    assert out["metrics"]["pairs_set_B/loglinear_vs_sync/step_time_ratio"] == pytest.approx(E(0.6))
    assert all(valid_metric_key(k) for k in out["metrics"])


@pytest.mark.parametrize(("a", "b", "both"), [
    ("faster", "faster", "faster"), ("not settled", "not settled", "not settled"), ("pass", "pass", "pass"),
    ("faster", "not settled", SETS_DIFFER), ("not settled", "faster", SETS_DIFFER), ("faster", "slower", SETS_DIFFER),
    ("pass", "FAIL", SETS_DIFFER),
])
def test_two_verdicts_agree_only_when_equal(a, b, both):
    assert agree(a, b) == both


def test_replicated_pairs_need_two_sets(tmp_path):
    with pytest.raises(ValueError, match="two seed sets, got 1"):
        summarise_replicated_pairs.fn([("A", (0,), THREE)], [], UNCALIBRATED, str(tmp_path))
