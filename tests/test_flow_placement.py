"""Placement as a comparison axis (tasks.arms.PLACEMENTS): arm names, the configs they build,
baselines within a placement, the table's placement and time-breakdown columns, and the launch a
disaggregated arm gets."""

from __future__ import annotations

import pytest

from a3po.config import preset
from a3po.training.metrics import valid_metric_key
from infra.launch import LaunchMode, LaunchSpec
from tasks.arms import arm_config, arm_name, expand_arms, metric_key_part, parse_arm, split_placement
from tasks.summary import ArmRun, baselines_of, compare, table
from tasks.training import arm_launch, launch_for_config


def test_placements_expand_every_arm_and_name_the_config():
    assert expand_arms(["sync", "loglinear"], None, ["colocated", "disaggregated"]) == [
        "sync@colocated", "loglinear@colocated", "sync@disaggregated", "loglinear@disaggregated"]
    base = preset("micro")
    dis = arm_config(base, "loglinear@disaggregated", seed=2)
    assert dis.distributed.rollout_workers == 1 and dis.distributed.rollout_cores >= 1 and dis.rl.seed == 2
    assert arm_name(dis) == "loglinear@disaggregated"
    col = arm_config(base, "sync@colocated", seed=0)
    assert col.distributed.rollout_workers == 0 and arm_name(col) == "sync"  # colocated is the bare name
    # The config's own worker count and cores are kept.
    own = arm_config(arm_config(base, "sync@disaggregated", 0), "sync@disaggregated", 0)
    assert own.distributed == dis.distributed
    assert parse_arm("loglinear+oppo-inter@disaggregated") == ("loglinear", "inter")
    assert split_placement("loglinear+oppo-inter@disaggregated") == ("loglinear+oppo-inter", "disaggregated")


def test_unknown_placements_and_refused_combinations_name_the_field():
    with pytest.raises(ValueError, match="unknown placement 'gpu'; valid: colocated, disaggregated"):
        expand_arms(["sync"], None, ["gpu"])
    with pytest.raises(ValueError, match="arm 'sync@gpu': unknown placement"):
        parse_arm("sync@gpu")
    # OPPO's carry-over runs in the rollout workers (a3po.placement.rollout_workers): the arm builds.
    inter = arm_config(preset("micro"), "loglinear+oppo-inter@disaggregated", 0)
    assert inter.oppo.inter and inter.distributed.rollout_workers >= 1


def test_baselines_are_taken_within_a_placement():
    assert baselines_of("loglinear@disaggregated") == ["sync@disaggregated", "recompute@disaggregated"]
    assert baselines_of("loglinear") == ["sync", "recompute"]
    assert metric_key_part("loglinear@disaggregated") == "loglinear_on_disaggregated"


def _record(arm: str, rewards: list[float], generate_s: float, train_s: float, idle_s: float) -> dict:
    step_s = train_s + idle_s  # the trainer's period: waiting for the batch, then the update
    history = [{"reward/mean": r, "perf/step_time_s": train_s, "perf/wait_time_s": idle_s, "time/train_wall_s": step_s * (i + 1),
                "perf/generate_s": generate_s, "perf/train_s": train_s, "perf/idle_s": idle_s} for i, r in enumerate(rewards)]
    return {"variant": parse_arm(arm)[0], "arm": arm, "seed": 0, "history": history, "final_acc": 0.5, "warmstart_acc": 0.2}


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
    cfg = arm_config(preset("micro"), "loglinear@disaggregated", 0)
    spec = arm_launch(LaunchSpec(), cfg)
    assert spec.mode is LaunchMode.TORCHRUN and spec.nproc_per_node == 2
    assert launch_for_config(spec, cfg).zero_stage is None  # one trainer rank: no DeepSpeed needed
    colocated = arm_config(preset("micro"), "loglinear", 0)
    assert arm_launch(LaunchSpec(), colocated) == LaunchSpec()
    with pytest.raises(ValueError, match="3 ranks need distributed.deepspeed_config"):
        launch_for_config(LaunchSpec(mode="torchrun", nproc_per_node=3), colocated)
