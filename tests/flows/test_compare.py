"""The comparison flow through a real Prefect run (``prefect_test_harness``: a temporary server
on SQLite) and a real MLflow store (SQLite in tmp_path), micro preset.

1. End to end: parent / child runs, per-step and evaluation metrics, artifacts, read back with
   ``mlflow.search_runs``; a second run of the same output dir hits the caches and resumes
   finished runs instead of retraining.
2. ``kill -9`` mid-training: the flow runs in a subprocess (own process group, pointed at this
   session's Prefect server), is SIGKILLed once a checkpoint exists, and run again: it resumes
   from that checkpoint and its per-step history and final accuracy equal an uninterrupted
   run's exactly (the 'deterministic' schedule; timing metrics aside).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import parse_qs

import pytest

from tests.support.cli_runs import without_timing  # timing metrics: the only ones allowed to differ

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "eval" / "fixtures"


def _search(uri: str, experiment: str):
    import mlflow

    mlflow.set_tracking_uri(uri)
    return mlflow.search_runs(experiment_names=[experiment], order_by=["attributes.start_time ASC"])


def test_compare_flow_end_to_end(prefect_server, tmp_path):
    from mlflow.tracking import MlflowClient

    from a3po.grading import score
    from eval.data import BENCHMARKS
    from flows.compare_variants import CompareSpec, compare_variants, printed_summary

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    kw = dict(preset="micro", seeds=[0], steps=6, tracking_uri=uri, experiment="e2e", output_dir=str(tmp_path / "out"),
              benchmarks=["gsm8k", "math500", "aime24"], data_dir=str(FIXTURES), bench_limit=2, bench_max_new_tokens=8,
              system_metrics_interval_s=0.05)
    res = compare_variants(CompareSpec(**kw))

    runs = _search(uri, "e2e")
    parents = runs[runs["tags.a3po.role"] == "parent"]
    children = runs[runs["tags.a3po.role"] == "child"]
    assert len(parents) == 1 and len(children) == 3
    parent = parents.iloc[0]
    assert parent["run_id"] == res["parent_run_id"] and parent["status"] == "FINISHED"
    assert parent["tags.prefect.flow_run_id"]  # the Prefect flow run it belongs to
    assert set(children["tags.mlflow.parentRunId"]) == {parent["run_id"]}
    assert sorted(children["tags.a3po.variant"]) == ["loglinear", "recompute", "sync"]
    assert set(children["status"]) == {"FINISHED"}
    assert children["params.rl.variant"].tolist() == children["tags.a3po.variant"].tolist()  # flattened config as params
    # Direct links into the UI, tagged on the parent: its own page and the comparison of exactly its child runs.
    exp = parent["experiment_id"]
    assert parent["tags.a3po.link.parent_run"] == res["links"]["parent_run"] == (
        f"http://127.0.0.1:5000/#/experiments/{exp}/runs/{parent['run_id']}?workflowType=machine_learning")  # the training workspace
    query = parse_qs(parent["tags.a3po.link.compare_runs"].partition("#/compare-runs?")[2])
    assert sorted(json.loads(query["runs"][0])) == sorted(children["run_id"]) and json.loads(query["experiments"][0]) == [exp]

    client = MlflowClient(uri)
    evaluation_of = {r["variant"]: r["evaluation"] for r in res["runs"]}
    for _, child in children.iterrows():
        steps = [m.step for m in client.get_metric_history(child["run_id"], "reward/mean")]
        assert steps == list(range(1, 7))  # every training step
        for key in (
            "stability/trust_ratio_max",
            "stability/trust_ratio_clipped_frac",
            "staleness/mean",
            "perf/step_time_s",
            "perf/tokens_per_s",
            "time/train_wall_s",
        ):
            assert len(client.get_metric_history(child["run_id"], key)) == 6, key
        acc = [(m.step, m.value) for m in client.get_metric_history(child["run_id"], "eval/heldout_acc")]
        assert [s for s, _ in acc] == [0, 2, 4, 6]  # warm start, then every eval_every=2 steps
        # The data it trained and was evaluated on, as MLflow dataset inputs: the prepared files, by content.
        inputs = {i.dataset.name: i for i in client.get_run(child["run_id"]).inputs.dataset_inputs}
        benches = sorted(n for n in inputs if ":" in n)
        assert sorted(set(inputs) - set(benches)) == ["heldout.jsonl", "train.jsonl"]
        assert [n.split(":")[0] for n in benches] == ["aime24", "gsm8k", "math500"]  # and each benchmark file
        for name in inputs:
            context = "training" if name == "train.jsonl" else "evaluation"
            ds = inputs[name].dataset
            path = Path(json.loads(ds.source)["uri"])
            assert path.name == name.split(":")[-1] and path.is_file()
            assert ds.digest == hashlib.sha256(path.read_bytes()).hexdigest()[:36]
            assert json.loads(ds.profile)["num_rows"] == len(path.read_text().splitlines())
            assert {t.key: t.value for t in inputs[name].tags}["mlflow.data.context"] == context
        # The independent evaluation of the exported checkpoint equals the trainer's last evaluation
        # (same weights, same fixed sampling seed).
        assert child["metrics.eval/final/heldout_acc"] == acc[-1][1] == child["metrics.final/heldout_acc"]
        assert child["metrics.eval/final/heldout_greedy_acc"] == child["metrics.eval/heldout_greedy_acc"]
        # pass@1 in MLflow is the fraction of this checkpoint's greedy completions (records.jsonl
        # beside the evaluation's results.json) that the grader, called here, scores 1.
        records_path = Path(evaluation_of[child["tags.a3po.variant"]]["results_path"]).with_name("records.jsonl")
        records = [json.loads(line) for line in records_path.read_text().splitlines()]
        for bench in ("gsm8k", "math500", "aime24"):
            assert child[f"metrics.eval/final/{bench}/n_problems"] == 2
            greedy = [x for x in records if x["benchmark"] == bench and x["sample"] == "greedy"]
            assert len(greedy) == 2
            regraded = [score(BENCHMARKS.get(bench).task, x["completion"], x["gold"]) for x in greedy]
            assert regraded == [x["score"] for x in greedy]
            assert child[f"metrics.eval/final/{bench}/pass_at_1"] == sum(regraded) / 2
        assert any(k.startswith("system/") for k in client.get_run(child["run_id"]).data.metrics)
    assert children["tags.a3po.run_dir"].map(lambda d: (Path(d) / "checkpoints" / "latest").exists()).all()

    assert {"comparison.md", "comparison.csv", "reward_curves.png", "stability.png", "summary.json", "pairs.md"} <= {
        a.path for a in client.list_artifacts(parent["run_id"])
    }
    # Each arm's final policy is a logged model of its child run (the Models tab), weights left in the run folder.
    models = {m.source_run_id: m for m in client.search_logged_models(experiment_ids=[exp])}
    assert set(models) == set(children["run_id"])
    for _, child in children.iterrows():
        m = models[child["run_id"]]
        assert m.name == f"{child['tags.a3po.variant']}-seed-0" and m.tags["a3po.final_dir"] == str(Path(child["tags.a3po.run_dir"]) / "final")
        assert {x.key: x.value for x in m.metrics}["final/reward"] == child["metrics.final/reward"]
        assert m.params["rl.variant"] == child["params.rl.variant"]
    # The Description opens with the headline (one seed: nothing settled), then the narrow table linking the full one.
    description = parent["tags.mlflow.note.content"]
    assert description.startswith("**sync**: not settled (1 seed) against recompute per step")
    assert "| arm | seeds | final reward |" in description and f"/runs/{parent['run_id']}/artifactPath/comparison.md" in description
    # The Prefect flow run's artifacts: the comparison, the pairs, the links, each arm's progress.
    from tests.tasks.test_artifacts import _artifacts

    found = _artifacts(parent["tags.prefect.flow_run_id"])
    assert {"compare-micro-e2e-verdict", "compare-micro-e2e-pairs", "compare-micro-e2e-mlflow-parent", "compare-micro-e2e-mlflow-compare",
            *(f"progress-{v}-seed-0-exp-{exp}" for v in ("sync", "recompute", "loglinear"))} == set(found)
    assert found["compare-micro-e2e-verdict"].data.startswith("# compare-micro: 3 arms x seeds 0\n\n**sync**")
    assert float(found[f"progress-loglinear-seed-0-exp-{exp}"].data) == 100.0
    for key in (
        "speedup/loglinear_vs_sync/step_time",
        "speedup/loglinear_vs_recompute/step_time",
        "delta/loglinear_vs_recompute/final_reward",
        "summary/loglinear/final_acc",
        "pairs/loglinear_vs_sync/step_time_ratio",
        "pairs/loglinear_vs_recompute/reward_diff",
    ):
        assert key in client.get_run(parent["run_id"]).data.metrics, key
    assert "pairs/loglinear_vs_sync/step_time_ratio_lo" not in client.get_run(parent["run_id"]).data.metrics  # one seed: no interval
    assert "| loglinear |" in res["summary"]["table_md"]
    # Printed after the comparison table: the pairs, one seed each, so nothing settled and no reward verdict.
    printed = printed_summary(res["summary"])
    assert printed.index("| loglinear |") < printed.index("| arm vs baseline | seeds |")
    row = next(line for line in printed.splitlines() if line.startswith("| loglinear vs sync | 1 |"))
    assert "(1 seed: no interval) | not settled (1 seed) |" in row and row.endswith("| no calibration for micro at 6 steps |")

    # Run again on the same output dir: dataset / warm start / evaluation come from Prefect's
    # cache and the finished runs' records are reused instead of retraining.
    again = compare_variants(CompareSpec(**kw))
    assert [r["resumed_from"] for r in again["runs"]] == [6, 6, 6]
    for r1, r2 in zip(res["runs"], again["runs"], strict=True):
        assert Path(r1["history_path"]).read_text() == Path(r2["history_path"]).read_text()
    runs = _search(uri, "e2e")
    second = runs[runs["tags.mlflow.parentRunId"] == again["parent_run_id"]]
    assert len(second) == 3 and set(second["tags.a3po.backfilled_steps"]) == {"6"}  # full record in the new child runs
    assert sorted(second["tags.a3po.reused_record"]) == sorted(str(Path(r["run_dir"]) / "result.json") for r in res["runs"])
    flow_run_id = runs[runs["run_id"] == again["parent_run_id"]].iloc[0]["tags.prefect.flow_run_id"]
    # parent open + links + log + close, dataset, warm start, 3x (train, evaluate, log), summary, pairs, artifacts
    states = _task_states(flow_run_id, expect=18)
    assert states["prepare_dataset"] == states["warm_start"] == {"Cached"}
    assert states["evaluate_checkpoint"] == {"Cached"} and states["train_arm"] == {"Completed"}

    # Cache folders deleted by hand: the cached records are refreshed, never returned stale.
    import shutil

    for d in (tmp_path / "out" / "cache").iterdir():
        shutil.rmtree(d)
    third = compare_variants(CompareSpec(**kw))
    fr = _search(uri, "e2e").set_index("run_id").loc[third["parent_run_id"], "tags.prefect.flow_run_id"]
    states = _task_states(fr, expect=18)
    assert states["prepare_dataset"] == states["warm_start"] == {"Completed"}
    assert Path(third["runs"][0]["warmstart"]["dir"]).is_dir()
    assert [r["final_acc"] for r in third["runs"]] == [r["final_acc"] for r in res["runs"]]


def _task_states(flow_run_id: str, expect: int, timeout_s: float = 30) -> dict[str, set[str]]:
    """Task-run states of a flow run by task name, read from the Prefect server (task runs are
    recorded from events, asynchronously: poll until all are there)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            if len(runs) >= expect or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    states: dict[str, set[str]] = {}
    for tr in runs:
        states.setdefault(tr.name.rsplit("-", 1)[0], set()).add(tr.state.name)
    return states


@pytest.mark.e2e
def test_kill_9_resumes_from_checkpoint_and_matches_uninterrupted(prefect_server, tmp_path):
    from mlflow.tracking import MlflowClient

    from flows.compare_variants import CompareSpec, compare_variants

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    steps, every = 40, 4
    common = dict(preset="micro", variants=["loglinear"], seeds=[0], steps=steps, checkpoint_every=every, tracking_uri=uri,
                  experiment="resume", cache_dir=str(tmp_path / "cache"), benchmarks=["gsm8k"], data_dir=str(tmp_path / "no-data"),
                  overrides={"rl": {"eval_every": 10}})
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "flows.compare_variants", "--preset", "micro", "--variants", "loglinear", "--seeds", "0",
           "--steps", str(steps), "--checkpoint-every", str(every), "--set", "rl.eval_every=10", "--tracking-uri", uri,
           "--experiment", "resume", "--cache-dir", str(tmp_path / "cache"), "--output-dir", str(out),
           "--benchmarks", "gsm8k", "--data-dir", str(tmp_path / "no-data")]
    env = {**os.environ, "PREFECT_API_URL": prefect_server}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not list(out.glob("loglinear-seed0-*/checkpoints/latest")):
            assert proc.poll() is None, "the flow ended before writing a checkpoint"
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the flow process and anything it started (its group)
        proc.wait()
    (ckpt_dir,) = out.glob("loglinear-seed0-*/checkpoints")
    killed_at = json.loads((ckpt_dir / "latest").read_text())["step"]
    assert every <= killed_at < steps, f"killed at step {killed_at}: not mid-training"
    assert not (ckpt_dir.parent / "final").exists()

    resumed = compare_variants(CompareSpec(**common, output_dir=str(out)))
    fresh = compare_variants(CompareSpec(**common, output_dir=str(tmp_path / "uninterrupted")))
    (r_run,), (f_run,) = resumed["runs"], fresh["runs"]
    assert r_run["resumed_from"] >= killed_at and f_run["resumed_from"] is None
    assert r_run["final_acc"] == f_run["final_acc"]
    assert without_timing(Path(r_run["history_path"])) == without_timing(Path(f_run["history_path"]))

    # MLflow: the killed flow's runs are marked KILLED; the resumed child holds all steps
    # (restored ones back-filled) with the same rewards as the uninterrupted child.
    client = MlflowClient(uri)
    runs = _search(uri, "resume")
    killed = runs[(runs["tags.a3po.run_dir"] == r_run["run_dir"]) & (runs["status"] == "KILLED")]
    assert len(killed) == 1
    assert (runs[runs["tags.a3po.role"] == "parent"]["status"] == "KILLED").sum() == 1
    r_hist = [(m.step, m.value) for m in client.get_metric_history(r_run["mlflow_run_id"], "reward/mean")]
    f_hist = [(m.step, m.value) for m in client.get_metric_history(f_run["mlflow_run_id"], "reward/mean")]
    assert sorted(r_hist) == sorted(f_hist) and len(f_hist) == steps
    assert client.get_run(r_run["mlflow_run_id"]).data.tags["eval.skipped.gsm8k"].startswith("benchmark data folder")
