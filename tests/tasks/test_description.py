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


def test_description_holds_the_table_the_pairs_and_links_to_every_child_run():
    md = comparison_description(SUMMARY, CHILDREN, {"compare_runs": "http://ui/#/compare-runs?runs=x"})
    assert md.startswith("## Comparison\n\n| variant | final reward |")
    # The pairs with their intervals follow the table, before the child runs; no bare ratio of means.
    assert "## Pairs over seeds\n\n" + PAIRS_MD.strip() in md
    assert md.index("## Comparison") < md.index("## Pairs over seeds") < md.index("## Child runs")
    assert "Speedups" not in md
    assert "Target reward 0.250" in md
    assert "[Compare the child runs](http://ui/#/compare-runs?runs=x)" in md
    for c in CHILDREN:
        assert f"- [{c['arm']} seed {c['seed']}]({c['url']})" in md


def test_a_verdict_comes_first_and_what_does_not_fit_is_left_out_from_the_end():
    verdict = "# Nightly parity: FAIL\n\nloglinear fell short"
    md = comparison_description(SUMMARY, CHILDREN, verdict_md=verdict)
    assert md.startswith(verdict + "\n\n## Comparison")
    full = len(md)
    short = comparison_description(SUMMARY, CHILDREN, verdict_md=verdict, limit=full - 10)
    assert len(short) <= full - 10
    assert short.startswith(verdict) and "| sync | 0.100 |" in short
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
