"""Prefect artifacts of the comparison flows (tasks.artifacts): keys Prefect accepts and that one
deployment keeps in one history, the pairs as a table, and what a flow run publishes, read back
from a real Prefect server (``prefect_server``). The flows publishing them end to end:
tests/flows/test_compare.py and tests/flows/test_nightly.py."""

from __future__ import annotations

import re

import pytest

from tasks.artifacts import TrainingProgress, flow_key, pairs_table, progress_key, publish_failure, publish_flow_artifacts, slug
from tests.tasks.test_description import PAIRS, PAIRS_MD, ROWS

KEY = re.compile(r"[a-z0-9-]+")  # Prefect's rule for an artifact key
LINKS = {"parent_run": "http://ui/#/experiments/1/runs/p?workflowType=machine_learning",
         "compare_runs": "http://ui/#/compare-runs?runs=x", "ui_command": "mlflow ui --backend-store-uri sqlite:///m.db"}
RECORDS = [{"arm": "sync", "variant": "sync", "seed": 0, "mlflow_run_id": "c0"},
           {"arm": "loglinear", "variant": "loglinear", "seed": 0, "mlflow_run_id": "c1"}]


def test_keys_are_prefect_keys_and_the_same_flow_and_experiment_give_the_same_key():
    assert flow_key("nightly-tiny", "a3po-nightly") == "nightly-tiny-a3po-nightly"
    assert flow_key("compare-micro", "My Experiment_2") == "compare-micro-my-experiment-2"
    assert progress_key("loglinear+oppo-inter", 3, "12") == "progress-loglinear-oppo-inter-seed-3-exp-12"
    assert slug("--A+B  c--") == "a-b-c"
    assert KEY.fullmatch(slug("x" * 300)) and len(slug("x" * 300)) <= 120


def test_the_pairs_table_has_each_figure_with_its_interval_and_verdict():
    rows = pairs_table(PAIRS)
    assert [r["pair"] for r in rows] == ["loglinear vs sync", "loglinear vs recompute", "loglinear vs pooled (recompute, sync)"]
    first = rows[0]
    assert (first["time-to-target ratio"], first["time-to-target ratio lo"], first["time-to-target ratio hi"]) == (1.62, 1.21, 2.17)
    assert first["time-to-target ratio verdict"] == "faster" and first["step-time ratio verdict"] == "faster"
    assert rows[1]["time-to-target ratio verdict"] == "not settled"  # 0.80 .. 1.38 straddles 1
    pooled = rows[2]
    assert pooled["step-time ratio"] is None and pooled["step-time ratio verdict"] == "-"
    assert (pooled["reward diff"], pooled["reward diff lo"], pooled["reward diff hi"]) == (0.0, -0.02, 0.02)
    assert pooled["reward verdict"] == "pass (calibrated shortfall)"


def _artifacts(flow_run_id: str) -> dict[str, object]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    return {a.key: a for a in found}


def test_a_flow_run_publishes_the_verdict_the_pairs_and_the_links_and_a_failure_says_fail(prefect_server):
    from prefect import flow
    from prefect.runtime import flow_run

    summary = {"table_md": "| variant | final reward |\n|---|---|\n| sync | 0.100 |", "rows": ROWS, "target": 0.25, "notes": [],
               "pairs_md": PAIRS_MD, "pairs": PAIRS}

    @flow
    def night():
        publish_flow_artifacts("nightly-micro-e", summary, RECORDS, "http://ui", "1", LINKS, "# Nightly parity: PASS\n\ndetails")
        progress = TrainingProgress("progress-loglinear-seed-0-exp-1", steps=10)
        for step in (5, 10):
            progress.report(step, f"loglinear seed 0: step {step}/10")
        return flow_run.id

    found = _artifacts(night())
    assert set(found) == {"nightly-micro-e-verdict", "nightly-micro-e-pairs", "nightly-micro-e-mlflow-parent",
                          "nightly-micro-e-mlflow-compare", "progress-loglinear-seed-0-exp-1"}
    verdict = found["nightly-micro-e-verdict"]
    assert verdict.type == "markdown" and verdict.data.startswith("# Nightly parity: PASS\n\n**loglinear**: faster than sync")
    assert "| variant | final reward |" in verdict.data  # the full table, not the narrow one
    assert found["nightly-micro-e-pairs"].type == "table" and "loglinear vs recompute" in str(found["nightly-micro-e-pairs"].data)
    assert LINKS["parent_run"] in str(found["nightly-micro-e-mlflow-parent"].data)
    assert "mlflow ui --backend-store-uri" in found["nightly-micro-e-mlflow-parent"].description  # where a UI must be started
    progress = found["progress-loglinear-seed-0-exp-1"]
    assert progress.type == "progress" and float(progress.data) == 100.0 and progress.description == "loglinear seed 0: step 10/10"

    @flow
    def broken():
        publish_failure("nightly-micro-e", "nightly-micro", RuntimeError("the tracking store is down"), "p1")
        return flow_run.id

    failed = _artifacts(broken())["nightly-micro-e-verdict"]
    assert failed.data.startswith("# nightly-micro: FAIL\n\nThe flow run did not finish: RuntimeError: the tracking store is down")
    assert "(p1) is marked FAILED" in failed.data and failed.description.startswith("FAIL")


def test_an_api_that_refuses_an_artifact_costs_a_warning_not_the_flow(prefect_server, monkeypatch, caplog):
    import prefect.artifacts
    from prefect import flow

    def refuse(*a, **k):
        raise RuntimeError("422 Unprocessable Entity")

    for name in ("create_markdown_artifact", "create_table_artifact", "create_link_artifact", "create_progress_artifact"):
        monkeypatch.setattr(prefect.artifacts, name, refuse)
    summary = {"table_md": "| a |\n|---|", "rows": ROWS, "target": None, "notes": [], "pairs_md": PAIRS_MD, "pairs": PAIRS}

    @flow
    def night():
        ids = publish_flow_artifacts("k", summary, RECORDS, "http://ui", "1", LINKS)
        progress = TrainingProgress("p", steps=2)
        progress.report(1, "step 1"), progress.report(2, "step 2")  # refused once: not asked again
        return ids

    assert night() == {"k-verdict": None, "k-pairs": None, "k-mlflow-parent": None, "k-mlflow-compare": None}
    warned = [r.getMessage() for r in caplog.records if "not recorded" in r.getMessage()]
    assert len(warned) == 5 and all("422 Unprocessable Entity" in w for w in warned)
    assert any(w.startswith("Prefect artifact p not recorded") for w in warned)


@pytest.mark.parametrize("error, why", [(KeyboardInterrupt(), "interrupted (Ctrl-C or a stop signal)"),
                                        (ValueError("bad"), "ValueError: bad")])
def test_a_failure_names_why(prefect_server, error, why):
    from prefect import flow
    from prefect.runtime import flow_run

    @flow
    def broken():
        publish_failure("f", "compare-micro", error)
        return flow_run.id

    assert _artifacts(broken())["f-verdict"].data == f"# compare-micro: FAIL\n\nThe flow run did not finish: {why}\n"
