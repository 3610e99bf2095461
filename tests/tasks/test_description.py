"""What the MLflow UI shows of a comparison, as pure functions (fast tier; the browser checks are
tests/ui/test_browser.py): the parent run's Description (tasks.description), the child runs'
pictures (tasks.pictures) and the staleness count vector the training step records
(a3po.training.step.staleness_counts). Seconds."""

from __future__ import annotations

import pytest
import torch

from a3po.training.step import staleness_counts as step_staleness_counts
from tasks.description import comparison_description
from tasks.pictures import draw_run_pictures, staleness_counts
from tasks.tracking import DESCRIPTION_TAG, TrackingRef, client_for, create_run, ensure_experiment, set_description

# The pairs table as tasks.pairs writes it (its figures are tested in tests/tasks/test_pairs.py).
PAIRS_MD = ("| arm vs baseline | seeds | step-time ratio [lo, hi] | verdict |\n|---|---|---|---|\n"
            "| loglinear vs sync | 2 | 2.828 [0.035, 231.285] | not settled |\n\nRatios are baseline / arm.\n")
SUMMARY = {"table_md": "| variant | final reward |\n|---|---|\n| sync | 0.100 |\n| loglinear | 0.200 |", "rows": [],
           "target": 0.25, "notes": [], "pairs_md": PAIRS_MD}
CHILDREN = [{"arm": "sync", "seed": 0, "url": "http://ui/#/experiments/1/runs/c0?workflowType=machine_learning"},
            {"arm": "loglinear", "seed": 0, "url": "http://ui/#/experiments/1/runs/c1?workflowType=machine_learning"}]


def _iv(n, point=None, low=None, high=None):
    return {"n": n, "point": point, "low": low, "high": high}


# Pairs as tasks.pairs.summarise_pairs returns them (dataclasses.asdict of Pair).
PAIRS = [
    {"arm": "loglinear", "baseline": "sync", "seeds": [0, 1, 2], "step_time": _iv(3, 1.5, 1.3, 1.7), "ttt": _iv(3, 1.62, 1.21, 2.17),
     "reward": _iv(3, 0.01, -0.02, 0.04), "reward_verdict": "pass (calibrated shortfall vs recompute, sync pooled)", "pooled": (),
     "passed": True},
    {"arm": "loglinear", "baseline": "recompute", "seeds": [0, 1, 2], "step_time": _iv(3, 1.1, 1.02, 1.2), "ttt": _iv(2, 1.05, 0.8, 1.38),
     "reward": _iv(3, -0.01, -0.03, 0.01), "reward_verdict": "pass (calibrated shortfall vs recompute, sync pooled)", "pooled": (),
     "passed": True},
    {"arm": "loglinear", "baseline": "pooled", "seeds": [0, 1, 2], "step_time": _iv(0), "ttt": _iv(0), "reward": _iv(3, 0.0, -0.02, 0.02),
     "reward_verdict": "pass (calibrated shortfall)", "pooled": ("recompute", "sync"), "passed": True},
]
ROWS = [{"variant": "sync", "seeds": 3, "final_reward": 0.5, "final_acc": 0.6, "time_to_target_s": 100.0, "mean_step_time_s": 2.0,
         "behav_iw_max": 1.0},
        {"variant": "loglinear", "seeds": 3, "final_reward": 0.51, "final_acc": 0.62, "time_to_target_s": 61.7, "mean_step_time_s": 1.33,
         "behav_iw_max": 3.0}]


def test_the_description_opens_with_the_verdict_then_which_arm_is_faster_by_how_much_then_a_narrow_table():
    summary = {**SUMMARY, "rows": ROWS, "pairs": PAIRS}
    md = comparison_description(summary, CHILDREN, verdict_md="# Nightly parity: PASS\n\nthe rule's details",
                                full_table_url="http://ui/#/experiments/1/runs/p/artifactPath/comparison.md")
    lines = md.splitlines()
    assert lines[0] == "# Nightly parity: PASS"
    # Per arm: each baseline with its ratio, interval and the verdict the interval allows; time to
    # target where both reached it on some seeds (2 of 3 against recompute), the seeds counted.
    assert lines[2] == ("**loglinear**: faster than sync to the target, 1.62x [1.21, 2.17] (3 seeds); "
                        "not settled against recompute to the target, 1.05x [0.80, 1.38] (2 of 3 seeds).")
    assert lines[4] == "**Reward**: passed the calibrated shortfall test, loglinear - recompute, sync pooled +0.000 [-0.020, +0.020]."
    table = md[md.index("| arm |"):].split("\n\n")[0].splitlines()
    assert table[0] == "| arm | seeds | final reward | held-out acc | time to target (s) | step (s) |"
    assert table[3] == "| loglinear | 3 | 0.510 | 0.620 | 61.700 | 1.330 |"
    assert "behaviour IW" not in md.split("## ")[0]  # the wide columns are in the linked full table
    assert "[Full comparison table](http://ui/#/experiments/1/runs/p/artifactPath/comparison.md)" in md
    # The verdict's body, the pairs with their intervals and the child runs follow, in that order.
    assert md.index("| arm |") < md.index("## Verdict\n\nthe rule's details") < md.index("## Pairs over seeds") < md.index("## Child runs")
    for c in CHILDREN:
        assert f"- [{c['arm']} seed {c['seed']}]({c['url']})" in md
    assert "[Compare the child runs]" not in md  # no links given


def test_one_seed_is_never_a_verdict_and_an_uncalibrated_reward_is_not_judged():
    one = [{**PAIRS[0], "seeds": [0], "ttt": _iv(0), "step_time": _iv(1, 1.4), "reward": _iv(1, 0.02),
            "reward_verdict": "no calibration for micro at 6 steps", "passed": None}]
    md = comparison_description({**SUMMARY, "rows": ROWS, "pairs": one}, CHILDREN)
    lines = md.splitlines()
    assert lines[0] == "**loglinear**: not settled (1 seed) against sync per step, 1.40x (1 seed: no interval)."
    assert lines[2] == "**Reward**: not judged (no calibration for micro at 6 steps); final-reward differences loglinear - sync +0.020."


def test_without_a_full_table_link_the_full_table_is_shown_and_links_go_last():
    md = comparison_description(SUMMARY, CHILDREN, {"compare_runs": "http://ui/#/compare-runs?runs=x"})
    assert md.startswith("| variant | final reward |")  # no pairs, no verdict: the table opens it
    assert "## Pairs over seeds\n\n" + PAIRS_MD.strip() in md
    assert md.index("| variant |") < md.index("## Pairs over seeds") < md.index("## Child runs")
    assert "Target reward 0.250" in md
    assert "[Compare the child runs](http://ui/#/compare-runs?runs=x)" in md


def test_a_verdict_comes_first_and_what_does_not_fit_is_left_out_from_the_end():
    verdict = "# Nightly parity: FAIL\n\nloglinear fell short"
    md = comparison_description(SUMMARY, CHILDREN, verdict_md=verdict)
    assert md.startswith("# Nightly parity: FAIL\n\n| variant |")
    full = len(md)
    short = comparison_description(SUMMARY, CHILDREN, verdict_md=verdict, limit=full - 10)
    assert len(short) <= full - 10
    assert short.startswith("# Nightly parity: FAIL") and "| sync | 0.100 |" in short and "loglinear fell short" in short
    assert "## Child runs" not in short and "Left out here for length: child runs" in short


def test_a_summary_without_a_table_or_its_pairs_is_refused():
    with pytest.raises(ValueError, match="no comparison table"):
        comparison_description({"rows": [], "table_md": ""}, [])
    with pytest.raises(ValueError, match="no pairs"):  # figures without intervals are not shown
        comparison_description({**SUMMARY, "pairs_md": ""}, CHILDREN)


def test_the_description_is_the_runs_note_and_an_empty_one_is_refused(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = client_for(uri)
    exp = ensure_experiment(client, "describe", uri)
    run = create_run(client, exp, "compare-micro", {})
    with pytest.raises(ValueError, match="empty description"):
        set_description(client, run, "  \n")
    set_description(client, run, "## Comparison")
    assert client.get_run(run).data.tags[DESCRIPTION_TAG] == "## Comparison"
    assert TrackingRef(uri, exp, run)  # the ref the task takes


def test_the_step_counts_trained_tokens_by_versions_behind():
    # Two rows; the mask keeps 3 tokens at 0 behind, 1 at 2 behind; the masked-out 5 is not counted.
    staleness = torch.tensor([[0, 0, 2, 5], [0, 1, 1, 1]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert step_staleness_counts(staleness, mask) == {"staleness/tokens_0": 3.0, "staleness/tokens_1": 0.0,
                                                      "staleness/tokens_2": 1.0}


def test_run_pictures_sum_the_counts_over_steps_and_skip_what_was_not_measured(tmp_path):
    history = [{"step": 1, "staleness/tokens_0": 8.0, "stability/behav_iw_max": 1.0, "stability/trust_ratio_max": 1.1},
               {"step": 2, "staleness/tokens_0": 2.0, "staleness/tokens_1": 6.0, "stability/behav_iw_max": 1.3}]
    assert staleness_counts(history) == {0: 10.0, 1: 6.0}
    paths = draw_run_pictures(history, "loglinear seed 0", tmp_path)
    # No rollout/behav_logp_* or prox/approx_* key: no log-prob error picture.
    assert [p.name for p in paths] == ["staleness_histogram.png", "importance_weights.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)
    with_error = [{**h, "rollout/behav_logp_abs_err": 0.01} for h in history]
    assert "logprob_error.png" in [p.name for p in draw_run_pictures(with_error, "x", tmp_path / "e")]
