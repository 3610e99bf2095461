"""Real DeepSpeed ZeRO-2 trainer ranks launched by the comparison flow, and the fan-out's pieces.

Slow tier (DeepSpeed ranks on CPU: tens of seconds of start-up each):
1. Two loopback "nodes" (node ranks 0 and 1, one rank each, two torchrun processes on
   127.0.0.1) and one node with two ranks train the same run alike (one world of 2 either way)
   through ``compare_variants``; the ranks report world size 2 and ZeRO stage 2 in the flow's
   logs, and the parent and child MLflow runs carry the topology read from the config.
2. A rank SIGKILLed mid-run inside the flow fails it naming the rank and the signal, leaves no
   process behind, and the flow's re-run (same output dir) resumes from the last checkpoint and
   ends equal to an uninterrupted run: per-step metrics (timings aside) and final weights.
Fast: the launch spec takes the ZeRO stage from the config; bad combinations fail before
anything starts; the fan-out's record files refuse a stale record.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from a3po.config.preflight import deepspeed_available
from infra.launch import LaunchSpec, launch_spec
from tests.support.cli_runs import descendants, flow_logs, without_timing

REPO_ROOT = Path(__file__).resolve().parents[2]
ZERO2 = "infra/deepspeed_zero2.json"
ZERO1 = "infra/deepspeed_zero1.json"
needs_deepspeed = pytest.mark.skipif(not deepspeed_available(), reason="DeepSpeed is not installed (pip install -e '.[distributed]')")


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO_ROOT)  # the DeepSpeed JSON paths are relative to the checkout, as on the CLI


def _cfg(deepspeed_config: str | None):
    from a3po.config import preset, with_overrides

    return with_overrides(preset("micro"), distributed={"deepspeed_config": deepspeed_config})


# --- fast ------------------------------------------------------------------------------------


@needs_deepspeed
def test_launch_spec_takes_the_zero_stage_from_the_deepspeed_config():
    from tasks.launched import launch_for_config

    two = LaunchSpec(mode="torchrun", nproc_per_node=2)
    assert launch_for_config(two, _cfg(ZERO2)).topology()["zero_stage"] == 2
    assert launch_for_config(two, _cfg(ZERO1)).topology()["zero_stage"] == 1
    assert launch_for_config(LaunchSpec(), _cfg(None)).zero_stage is None  # in-process, no DeepSpeed
    with pytest.raises(ValueError, match=re.escape(f"launch.zero_stage = 1 but distributed.deepspeed_config {ZERO2} is ZeRO stage 2")):
        launch_for_config(LaunchSpec(mode="torchrun", nproc_per_node=2, zero_stage=1), _cfg(ZERO2))
    with pytest.raises(ValueError, match=re.escape("launch: 2 ranks need distributed.deepspeed_config")):
        launch_for_config(LaunchSpec(mode="torchrun", nnodes=2, nodes=(0, 1)), _cfg(None))


@needs_deepspeed
def test_pinned_cores_that_do_not_fit_the_launch_are_refused_before_it_starts(monkeypatch):
    from a3po.config import preset, with_overrides
    from tasks.arms import Arm
    from tasks.launched import launch_for_config

    monkeypatch.setattr("a3po.placement.cores.usable_cores", lambda: 2)
    monkeypatch.setattr("tasks.arms.usable_cores", lambda: 2)
    three = LaunchSpec(mode="torchrun", nproc_per_node=3)  # 2 ZeRO-2 trainer ranks + 1 rollout worker
    pinned = with_overrides(preset("micro"), distributed={"deepspeed_config": ZERO2, "rollout_workers": 1, "rollout_cores": 1})
    with pytest.raises(ValueError, match=re.escape("2 trainer rank(s) need 3 cores, this machine has 2; lower distributed.rollout_cores")):
        launch_for_config(three, pinned)
    unpinned = with_overrides(pinned, distributed={"rollout_cores": 0})
    assert launch_for_config(three, unpinned).topology()["zero_stage"] == 2
    # The disaggregated placement pins by default only beside one trainer: with DeepSpeed ranks
    # the launch decides how many trainers share the node.
    ds = with_overrides(preset("micro"), distributed={"deepspeed_config": ZERO2})
    assert Arm.parse("sync@disaggregated").config(ds, 0).distributed.rollout_cores == 0
    assert Arm.parse("sync@disaggregated").config(preset("micro"), 0).distributed.rollout_cores == 1


def test_ranks_without_a_deepspeed_config_fail_on_the_command_line_before_any_server(capsys):
    from flows.compare_variants import main

    rc = main(["--preset", "micro", "--variants", "loglinear", "--launch", "torchrun", "--nproc-per-node", "2"])
    assert rc == 2
    assert "launch: 2 ranks need distributed.deepspeed_config" in capsys.readouterr().err


def test_fanout_needs_a_prefect_server(monkeypatch, capsys):
    from flows.compare_variants import main

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    assert main(["--preset", "micro", "--variants", "loglinear", "--fanout-deployment", "train-one/train-one"]) == 2
    assert "--fanout-deployment needs a Prefect server" in capsys.readouterr().err


def test_launch_spec_travels_as_flow_parameters():
    from flows.train_one import spec_to_dict

    spec = LaunchSpec(mode="torchrun", nnodes=2, nodes=(0, 1), nproc_per_node=4, devices="cuda", zero_stage=2)
    params = json.loads(json.dumps(spec_to_dict(spec)))  # what a deployment run's parameters hold
    assert launch_spec(params) == spec


def test_fanout_record_from_another_flow_run_is_refused(tmp_path):
    from flows.train_one import RECORD_FILE, read_record

    with pytest.raises(FileNotFoundError, match=re.escape(f"{tmp_path / RECORD_FILE}: flow run abc completed but wrote no record")):
        read_record(tmp_path, "abc")
    (tmp_path / RECORD_FILE).write_text(json.dumps({"final_acc": 0.5, "prefect_flow_run_id": "old"}))
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / RECORD_FILE}: written by flow run old, not by new")):
        read_record(tmp_path, "new")
    assert read_record(tmp_path, "old")["final_acc"] == 0.5


# --- slow: DeepSpeed ranks through the flow ---------------------------------------------------


def _final_weights(run: dict) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(run["final_dir"]) / "model.safetensors"))


def _same_weights(a: dict, b: dict) -> bool:
    import torch

    wa, wb = _final_weights(a), _final_weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _common(tmp_path, experiment: str, steps: int = 4) -> dict:
    return dict(preset="micro", variants=["loglinear"], seeds=[0], steps=steps, benchmarks=[], experiment=experiment,
                tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", cache_dir=str(tmp_path / "cache"),
                overrides={"distributed": {"deepspeed_config": ZERO2}}, system_metrics_interval_s=60.0)


@needs_deepspeed
@pytest.mark.slow
def test_two_loopback_nodes_and_one_node_of_two_zero2_ranks_train_alike_and_record_the_topology(prefect_server, tmp_path):
    import mlflow
    from mlflow.tracking import MlflowClient

    from flows.compare_variants import CompareSpec, compare_variants

    common = _common(tmp_path, "topology")
    one_node = compare_variants(CompareSpec(**common, output_dir=str(tmp_path / "one-node"), launch={"mode": "torchrun", "nproc_per_node": 2}))
    two_nodes = compare_variants(CompareSpec(**common, output_dir=str(tmp_path / "two-nodes"),
                                 launch={"mode": "torchrun", "nnodes": 2, "nodes": [0, 1], "nproc_per_node": 1, "master_addr": "127.0.0.1"}))
    (a,), (b,) = one_node["runs"], two_nodes["runs"]
    # One world of 2 ranks either way: the same shards, the same all-reduces, the same run.
    assert len(without_timing(a["history_path"])) == 4
    assert without_timing(a["history_path"]) == without_timing(b["history_path"])
    assert a["final_acc"] == b["final_acc"] and _same_weights(a, b)

    mlflow.set_tracking_uri(common["tracking_uri"])
    runs = mlflow.search_runs(experiment_names=["topology"])
    for result, (nodes, per_node) in ((one_node, ("1", "2")), (two_nodes, ("2", "1"))):
        (run,) = result["runs"]
        child = runs[runs["run_id"] == run["mlflow_run_id"]].iloc[0]
        parent = runs[runs["run_id"] == result["parent_run_id"]].iloc[0]
        assert child["tags.mlflow.parentRunId"] == result["parent_run_id"] and child["status"] == "FINISHED"
        for row in (child, parent):
            assert (row["params.launch.mode"], row["params.launch.nodes"], row["params.launch.ranks_per_node"]) == ("torchrun", nodes, per_node)
            assert (row["params.launch.world_size"], row["params.launch.devices"], row["params.launch.zero_stage"]) == ("2", "cpu", "2")
            assert (row["tags.a3po.launch.world_size"], row["tags.a3po.launch.zero_stage"]) == ("2", "2")
            assert row["params.distributed.deepspeed_config"] == ZERO2
        assert [m.step for m in MlflowClient(common["tracking_uri"]).get_metric_history(run["mlflow_run_id"], "reward/mean")] == [1, 2, 3, 4]
        # What the ranks themselves found (a3po train's last line, printed by rank 0), and rank 1 ran too.
        flow_run_id = parent["tags.prefect.flow_run_id"]
        logs = flow_logs(flow_run_id)
        reported = [json.loads(m[len("[rank 0] "):]) for m in logs if m.startswith('[rank 0] {"variant"')]
        assert [(r["world_size"], r["zero_stage"]) for r in reported] == [(2, 2)], reported
        assert any(m.startswith("[rank 1] ") for m in logs)


@needs_deepspeed
@pytest.mark.slow
def test_comparison_launched_on_zero_ranks_and_a_rollout_worker_records_the_roles(prefect_server, tmp_path):
    """The production topology through the flow: 3 processes, 2 ZeRO-2 trainer ranks + 1 rollout
    worker, every variant; each child run says what its ranks were."""
    import mlflow

    from flows.compare_variants import CompareSpec, compare_variants

    common = {**_common(tmp_path, "production", steps=3), "variants": ["sync", "loglinear"],
              "overrides": {"distributed": {"deepspeed_config": ZERO2, "rollout_workers": 1}}}
    res = compare_variants(CompareSpec(**common, output_dir=str(tmp_path / "out"), launch={"mode": "torchrun", "nproc_per_node": 3}))
    assert sorted(r["variant"] for r in res["runs"]) == ["loglinear", "sync"]
    mlflow.set_tracking_uri(common["tracking_uri"])
    runs = mlflow.search_runs(experiment_names=["production"])
    for run in res["runs"]:
        child = runs[runs["run_id"] == run["mlflow_run_id"]].iloc[0]
        assert child["status"] == "FINISHED" and len(without_timing(run["history_path"])) == 3
        assert (child["params.launch.world_size"], child["params.launch.trainer_ranks"], child["params.launch.rollout_workers"]) == ("3", "2", "1")
        assert (child["params.launch.engine"], child["params.launch.zero_stage"]) == ("torch", "2")
        tags = [child[f"tags.a3po.launch.{k}"] for k in ("trainer_ranks", "rollout_workers", "zero_stage")]
        assert tags == ["2", "1", "2"]
    parent = runs[runs["run_id"] == res["parent_run_id"]].iloc[0]
    logs = flow_logs(parent["tags.prefect.flow_run_id"])
    reported = [json.loads(m[len("[rank 0] "):]) for m in logs if m.startswith('[rank 0] {"variant"')]
    assert sorted((r["variant"], r["world_size"], r["rollout_workers"], r["zero_stage"]) for r in reported) == \
        [("loglinear", 2, 1, 2), ("sync", 2, 1, 2)], reported


def _processes_naming(text: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and text in " ".join(p.info["cmdline"] or []):
                found.append(p)
        except psutil.Error:
            pass
    return found


@needs_deepspeed
@pytest.mark.slow
def test_sigkilled_rank_fails_the_flow_naming_it_and_the_rerun_resumes_to_the_uninterrupted_result(prefect_server, tmp_path):
    import mlflow
    from mlflow.tracking import MlflowClient

    from flows.compare_variants import CompareSpec, compare_variants
    from infra.launch import RankFailure

    steps = 10  # micro: a checkpoint every 2 steps
    common = _common(tmp_path, "killed", steps=steps)
    launch = {"mode": "torchrun", "nproc_per_node": 2, "grace_s": 5}
    uninterrupted = compare_variants(CompareSpec(**common, output_dir=str(tmp_path / "uninterrupted"), launch=launch))

    out = tmp_path / "killed-run"
    before = descendants()
    killed: dict = {}

    def kill_rank1_after_the_first_checkpoint() -> None:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and not killed:
            if list(out.glob("*/loglinear-seed0/checkpoints/latest")):
                for p in _processes_naming(str(out)):
                    try:
                        if "a3po.training.command" in " ".join(p.cmdline()) and p.environ().get("RANK") == "1":
                            killed.update(pid=p.pid, step=json.loads(next(out.glob("*/loglinear-seed0/checkpoints/latest")).read_text())["step"])
                            p.send_signal(signal.SIGKILL)
                            return
                    except psutil.Error:
                        pass
            time.sleep(0.02)

    killer = threading.Thread(target=kill_rank1_after_the_first_checkpoint, daemon=True)
    killer.start()
    state = compare_variants(CompareSpec(**common, output_dir=str(out), launch=launch), return_state=True)
    killer.join(timeout=10)
    assert killed, "rank 1 was never found to kill"
    assert state.is_failed(), f"the flow survived the SIGKILL of rank 1: {state}"
    err = state.result(raise_on_failure=False)
    assert isinstance(err, RankFailure), repr(err)
    assert str(err).startswith("rank 1 (node 0, local rank 1) failed with exit signal 9 (SIGKILL)"), str(err)
    assert killed["step"] < steps, "the run had finished before the kill"
    time.sleep(1)
    assert not _processes_naming(str(out)), [p.cmdline() for p in _processes_naming(str(out))]
    assert not (descendants() - before)

    rerun = compare_variants(CompareSpec(**common, output_dir=str(out), launch=launch))
    (r,), (u,) = rerun["runs"], uninterrupted["runs"]
    assert r["resumed_from"] is not None and 2 <= r["resumed_from"] < steps, r["resumed_from"]
    assert len(without_timing(r["history_path"])) == steps
    assert without_timing(r["history_path"]) == without_timing(u["history_path"])
    assert r["final_acc"] == u["final_acc"] and _same_weights(r, u)

    # MLflow: the killed attempt's child FAILED, the re-run's child FINISHED with every step.
    mlflow.set_tracking_uri(common["tracking_uri"])
    children = mlflow.search_runs(experiment_names=["killed"], filter_string=f"tags.`a3po.run_dir` = '{r['run_dir']}'")
    assert sorted(children["status"]) == ["FAILED", "FINISHED"], children[["run_id", "status"]]
    steps_logged = [m.step for m in MlflowClient(common["tracking_uri"]).get_metric_history(r["mlflow_run_id"], "reward/mean")]
    assert steps_logged == list(range(1, steps + 1))
