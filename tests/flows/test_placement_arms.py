"""Placement as a comparison axis (a3po.config.axes.PLACEMENTS, tasks.arms.Arm): arm names, the configs they build,
baselines within a placement, the table's placement and time-breakdown columns, and the launch a
disaggregated arm gets."""

from __future__ import annotations

import pytest

from a3po.config import preset
from a3po.training.metrics import valid_metric_key
from infra.launch import LaunchMode, LaunchSpec
from tasks.arms import Arm, expand_arms, metric_key_part
from tasks.launched import arm_launch, launch_for_config
from tasks.summary import ArmRun, baselines_of, compare, table


def test_placements_expand_every_arm_and_name_the_config():
    arms = expand_arms(["sync", "loglinear"], None, ["colocated", "disaggregated"])
    assert [(a.variant.value, a.placement) for a in arms] == [
        ("sync", "colocated"), ("loglinear", "colocated"), ("sync", "disaggregated"), ("loglinear", "disaggregated")]
    assert [a.name for a in arms] == ["sync", "loglinear", "sync@disaggregated", "loglinear@disaggregated"]  # colocated: bare
    base = preset("micro")
    dis = Arm.parse("loglinear@disaggregated").config(base, seed=2)
    assert dis.distributed.rollout_workers == 1 and dis.distributed.rollout_cores >= 1 and dis.rl.seed == 2
    assert Arm.of(dis) == Arm(variant="loglinear", oppo="off", staleness_control="fixed", max_staleness=2, placement="disaggregated")
    assert Arm.of(dis).name == "loglinear@disaggregated"
    col = Arm.parse("sync@colocated").config(base, seed=0)
    assert col.distributed.rollout_workers == 0 and Arm.of(col).name == "sync"  # colocated is the bare name
    # The config's own worker count and cores are kept.
    own = Arm.parse("sync@disaggregated").config(Arm.parse("sync@disaggregated").config(base, 0), 0)
    assert own.distributed == dis.distributed
    assert Arm.parse("loglinear+oppo-inter@disaggregated") == Arm(variant="loglinear", oppo="inter", placement="disaggregated")
    assert Arm(variant="loglinear", oppo="inter", placement="disaggregated").name == "loglinear+oppo-inter@disaggregated"


def test_unknown_placements_and_refused_combinations_name_the_field():
    with pytest.raises(ValueError, match="unknown placement 'gpu'; valid: colocated, disaggregated"):
        expand_arms(["sync"], None, ["gpu"])
    with pytest.raises(ValueError, match="arm 'sync@gpu': unknown placement"):
        Arm.parse("sync@gpu")
    # OPPO's carry-over runs in the rollout workers (a3po.placement.worker_loop): the arm builds.
    inter = Arm.parse("loglinear+oppo-inter@disaggregated").config(preset("micro"), 0)
    assert inter.oppo.inter and inter.distributed.rollout_workers >= 1


def test_baselines_are_taken_within_a_placement():
    assert [b.name for b in baselines_of(Arm.parse("loglinear+s1@disaggregated"))] == ["sync@disaggregated", "recompute+s1@disaggregated"]
    assert [b.name for b in baselines_of(Arm.parse("loglinear+s1"))] == ["sync", "recompute+s1"]
    assert [b.name for b in baselines_of(Arm.parse("loglinear+oppo-inter@disaggregated"))] == [
        "sync@disaggregated", "recompute@disaggregated", "loglinear@disaggregated", "loglinear+oppo-inter+s1@disaggregated"]
    assert metric_key_part("loglinear@disaggregated") == "loglinear_on_disaggregated"


def _record(arm: str, rewards: list[float], generate_s: float, train_s: float, idle_s: float) -> dict:
    step_s = train_s + idle_s  # the trainer's period: waiting for the batch, then the update
    history = [{"reward/mean": r, "perf/step_time_s": train_s, "perf/wait_time_s": idle_s, "time/train_wall_s": step_s * (i + 1),
                "perf/generate_s": generate_s, "perf/train_s": train_s, "perf/idle_s": idle_s} for i, r in enumerate(rewards)]
    return {"variant": arm.partition("@")[0], "arm": arm, "seed": 0, "history": history, "final_acc": 0.5, "warmstart_acc": 0.2}


def test_speedups_per_placement_and_the_time_breakdown():
    # 4 steps, smooth_frac 0.25 -> final reward = last step's; the target 0.8 is reached at step 4 by all.
    curve = [0.0, 0.2, 0.5, 1.0]
    recs = [
        _record("sync", curve, generate_s=1.0, train_s=1.0, idle_s=1.0),  # colocated sync: 2 s a step
        _record("loglinear", curve, generate_s=1.0, train_s=1.5, idle_s=0.0),  # 1.5 s
        _record("sync@disaggregated", curve, generate_s=2.0, train_s=2.0, idle_s=2.0),  # 4 s
        _record("loglinear@disaggregated", curve, generate_s=2.0, train_s=2.0, idle_s=0.5),  # 2.5 s
    ]
    comp = compare([ArmRun.of(r) for r in recs])
    rows = {r["variant"]: r for r in comp.rows}
    assert rows["loglinear"]["speedup_ttt_vs_sync"] == pytest.approx(8.0 / 6.0)  # 4 x 2 s / 4 x 1.5 s
    assert rows["loglinear@disaggregated"]["speedup_ttt_vs_sync"] == pytest.approx(16.0 / 10.0)  # against sync@disaggregated
    assert rows["loglinear@disaggregated"]["placement"] == "disaggregated" and rows["loglinear"]["placement"] == "colocated"
    assert rows["sync@disaggregated"]["mean_idle_s"] == 2.0 and rows["loglinear@disaggregated"]["mean_generate_s"] == 2.0
    assert "speedup_ttt_vs_sync" not in rows["sync@disaggregated"]
    m = comp.metrics
    assert m["speedup/loglinear_on_disaggregated_vs_sync_on_disaggregated/step_time"] == pytest.approx(4.0 / 2.5)
    assert all(valid_metric_key(k) for k in m)
    df = table(comp)
    assert df["placement"].tolist() == ["colocated", "colocated", "disaggregated", "disaggregated"]
    assert df["trainer idle (s/step)"].tolist() == [1.0, 0.0, 2.0, 0.5]


def test_a_disaggregated_arm_runs_as_a_trainer_and_its_workers():
    cfg = Arm.parse("loglinear@disaggregated").config(preset("micro"), 0)
    spec = arm_launch(LaunchSpec(), cfg)
    assert spec.mode is LaunchMode.TORCHRUN and spec.nproc_per_node == 2
    assert launch_for_config(spec, cfg).zero_stage is None  # one trainer rank: no DeepSpeed needed
    colocated = Arm.parse("loglinear").config(preset("micro"), 0)
    assert arm_launch(LaunchSpec(), colocated) == LaunchSpec()
    with pytest.raises(ValueError, match="3 ranks need distributed.deepspeed_config"):
        launch_for_config(LaunchSpec(mode="torchrun", nproc_per_node=3), colocated)
