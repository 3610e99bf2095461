"""OPPO as an axis of the comparison flow (tasks.arms), through a real Prefect
run and a real MLflow store (SQLite in tmp_path), micro preset on the PPO path.

1. Arms: names, modes and refusals (pure, no flow).
2. The summary and the parity rule key their rows by arm; metric keys stay valid MLflow keys.
3. ``compare_variants(CompareSpec(variants=["loglinear"], oppo=["off", "intra", "inter"]))``: one child run per
   arm, named and tagged by it, with the oppo section as params; the comparison table and parent
   metrics have a row per arm and a speedup against OPPO off; every OPPO child run holds the
   per-step latency breakdown, busy fractions and oppo/* figures, one value per RL step, equal
   to what the trainer logged locally (history.jsonl).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from a3po.config import ConfigError, preset, with_overrides
from a3po.training.metrics import valid_metric_key

# Prefect sets up its console log handler on import: here, not under a test's captured stderr
# (capsys closes that stream, and the flow test would log into it).
from flows.cli import parse_sets
from flows.common import variant_config
from flows.compare_variants import CompareSpec, compare_variants
from tasks.arms import Arm, expand_arms, metric_key_part

PPO_MICRO = {"rl": {"advantage": "gae"}, "ppo": {"critic": "policy_copy", "critic_lr": 1e-3, "kl_coef": 0.05, "kl_estimator": "k3"}}


# --- 1. arms ----------------------------------------------------------------------------------


def test_arm_names_round_trip_through_configs():
    base = preset("micro")
    names = [a.name for a in expand_arms(["loglinear", "recompute"], ["off", "inter"])]
    assert names == ["loglinear", "loglinear+oppo-inter", "recompute", "recompute+oppo-inter"]
    assert expand_arms(["sync", "sync"], None) == [Arm(variant="sync")]
    cfg = Arm.parse("loglinear+oppo-inter").config(base, seed=3)
    assert (cfg.rl.variant.value, cfg.rl.seed, cfg.oppo.inter, cfg.oppo.intra) == ("loglinear", 3, True, False)
    assert Arm.of(cfg).name == "loglinear+oppo-inter" and Arm.of(Arm.parse("loglinear").config(base, 0)).name == "loglinear"
    # A bare variant keeps the config's OPPO section, so its name says what runs; "off" turns it off.
    inter_base = with_overrides(base, oppo={"inter": True})
    assert Arm.of(Arm.parse("recompute").config(inter_base, 0)).name == "recompute+oppo-inter"
    assert Arm.of(expand_arms(["recompute"], ["off"])[0].config(inter_base, 0)).name == "recompute"
    assert Arm.of(Arm.parse("loglinear+oppo-intra").config(with_overrides(base, **PPO_MICRO), 0)).name == "loglinear+oppo-intra"
    assert Arm.parse("loglinear+oppo-both") == Arm(variant="loglinear", oppo="both")
    # A name is read into the arm wherever an Arm is expected (a spec's candidate, a deployment's parameter).
    assert Arm.model_validate("sync+oppo-inter") == Arm(variant="sync", oppo="inter") and str(Arm(variant="sync")) == "sync"
    assert metric_key_part("loglinear+oppo-inter") == "loglinear_oppo-inter" and valid_metric_key("summary/loglinear_oppo-inter/x")


@pytest.mark.parametrize("arm, error, match", [
    ("fast", ValueError, "rl.variant: expected one of 'sync', 'recompute', 'loglinear', got 'fast'"),
    ("loglinear+oppo-sideways", ValueError, "unknown OPPO mode 'sideways'; valid: both, inter, intra, off"),
    ("loglinear+oppo-intra", ConfigError, "oppo.intra needs scoring models"),  # the GRPO path has nothing to overlap
    ("sync+oppo-inter", ConfigError, "staleness-aware"),
])
def test_arms_the_config_cannot_run_are_refused_naming_why(arm, error, match):
    with pytest.raises(error, match=match):
        Arm.parse(arm).config(preset("micro"), 0)


def test_both_arm_turns_both_overlaps_on_and_intra_stays_refused_on_grpo():
    cfg = Arm.parse("loglinear+oppo-both").config(with_overrides(preset("micro"), **PPO_MICRO), 0)
    assert (cfg.oppo.intra, cfg.oppo.inter, cfg.rl.variant) == (True, True, "loglinear")
    with pytest.raises(ConfigError, match="oppo.intra"):  # the GRPO path has no scoring model to stream to
        Arm.parse("loglinear+oppo-both").config(preset("micro"), 0)


def test_per_arm_overrides_from_set_and_the_flow_parameter(capsys):
    _, per = parse_sets(["loglinear:rl.lr=1e-3", "loglinear+oppo-inter:rl.lr=2e-3"])
    assert per == {"loglinear": {"lr": 1e-3}, "loglinear+oppo-inter": {"lr": 2e-3}}
    base = preset("micro")
    # The variant's overrides reach all its arms; an arm's own win for that arm.
    assert variant_config(base, Arm.parse("loglinear"), 0, per).rl.lr == 1e-3
    assert variant_config(base, Arm.parse("loglinear+oppo-inter"), 0, per).rl.lr == 2e-3
    with pytest.raises(SystemExit):
        parse_sets(["fast:rl.lr=1"])
    assert "got 'fast'" in capsys.readouterr().err


# --- 2. summary and parity by arm ---------------------------------------------------------------


def _record(arm: str, seed: int, rewards: list[float], step_s: float) -> dict:
    variant = Arm.parse(arm).variant.value
    history = [{"reward/mean": r, "perf/step_time_s": step_s, "time/train_wall_s": step_s * (i + 1)} for i, r in enumerate(rewards)]
    return {"variant": variant, "arm": arm, "seed": seed, "history": history, "final_acc": 0.5, "warmstart_acc": 0.2}


def test_summary_rows_are_arms_with_a_speedup_against_oppo_off():
    from tasks.summary import ArmRun, compare, table

    # 4 steps, smooth_frac 0.25 -> W = 1: final reward = last step's. Both reach the target
    # 0 + 0.8 * (1 - 0) = 0.8 at step 4: loglinear at 4 x 0.2 = 0.8 s, OPPO at 4 x 0.1 = 0.4 s.
    recs = [_record("loglinear", 0, [0.0, 0.2, 0.5, 1.0], 0.2), _record("loglinear+oppo-inter", 0, [0.0, 0.2, 0.5, 1.0], 0.1)]
    comp = compare([ArmRun.of(r) for r in recs])
    rows = {r["variant"]: r for r in comp.rows}
    assert list(rows) == ["loglinear", "loglinear+oppo-inter"]
    assert rows["loglinear+oppo-inter"]["speedup_ttt_vs_oppo_off"] == pytest.approx(2.0)  # 0.8 s / 0.4 s
    assert rows["loglinear+oppo-inter"]["speedup_step_vs_oppo_off"] == pytest.approx(2.0)  # 0.2 s / 0.1 s
    assert "speedup_ttt_vs_oppo_off" not in rows["loglinear"]
    assert comp.metrics["speedup/loglinear_oppo-inter_vs_loglinear/time_to_target"] == pytest.approx(2.0)
    assert comp.metrics["summary/loglinear_oppo-inter/final_reward"] == 1.0
    assert all(valid_metric_key(k) for k in comp.metrics)
    df = table(comp)
    assert df["variant"].tolist() == ["loglinear", "loglinear+oppo-inter"] and "speedup vs OPPO off (target)" in df.columns
    # Without an OPPO arm the table keeps its columns.
    assert "speedup vs OPPO off (target)" not in table(compare([ArmRun.of(recs[0])])).columns


def test_parity_rule_pairs_oppo_on_with_off_by_seed():
    from tasks.parity import decide, parity_metrics

    off = [_record("loglinear", s, [0.0, 0.0, 0.0, r], 0.2) for s, r in enumerate([0.50, 0.60, 0.55])]
    on = [_record("loglinear+oppo-inter", s, [0.0, 0.0, 0.0, r], 0.1) for s, r in enumerate([0.52, 0.45, 0.56])]
    (res,) = decide(off + on, "loglinear+oppo-inter", ["loglinear"], tolerance=0.1)
    assert res.diffs == pytest.approx([0.02, -0.15, 0.01])  # final reward = last step (W = 1), on - off per seed
    assert res.ci_low == pytest.approx(-0.15) and not res.passed  # K = 3: the lower bound is the worst seed
    m = parity_metrics([res])
    assert m["parity/loglinear_oppo-inter_vs_loglinear/pass"] == 0.0 and all(valid_metric_key(k) for k in m)


# --- 3. the flow: one child run per arm, per-step OPPO records in MLflow --------------------------

# Per-step figures every OPPO run must send to its child run (docs/oppo.md, "Metrics").
PER_STEP = ("perf/generate_s", "perf/score_s", "perf/train_s", "perf/idle_s", "perf/trainer_busy_frac", "perf/generator_busy_frac")
PER_STEP_ARM = {
    "loglinear+oppo-inter": ("oppo/delta", "oppo/carried", "oppo/carried_age_max", "oppo/trained_age_max"),
    "loglinear+oppo-intra": ("oppo/chunk_size", "oppo/chunks"),
}


def test_compare_flow_runs_oppo_arms_and_ships_their_per_step_records(prefect_server, tmp_path):
    import mlflow
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    steps = 4
    res = compare_variants(CompareSpec(
        preset="micro", variants=["loglinear"], oppo=["off", "intra", "inter"], seeds=[0], steps=steps,
        overrides={**PPO_MICRO, "oppo": {"chunk_min": 2, "chunk_max": 4}}, benchmarks=[], tracking_uri=uri,
        experiment="oppo", output_dir=str(tmp_path / "out"), system_metrics_interval_s=60.0))

    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=["oppo"])
    children = runs[runs["tags.a3po.role"] == "child"].set_index("tags.a3po.arm")
    assert sorted(children.index) == ["loglinear", "loglinear+oppo-inter", "loglinear+oppo-intra"]
    for arm, child in children.iterrows():
        assert child["tags.mlflow.runName"].startswith(f"{arm}-seed0-") and child["status"] == "FINISHED"
        assert child["tags.a3po.variant"] == "loglinear" and child["tags.a3po.oppo"] == (Arm.parse(arm).oppo or "off")
        assert (child["params.oppo.intra"], child["params.oppo.inter"]) == (str(arm.endswith("intra")), str(arm.endswith("inter")))
        assert child["params.oppo.chunk_max"] == "4"  # the whole oppo section is recorded

    # The comparison: a row per arm, OPPO rows against OPPO off, on the parent run too.
    rows = {r["variant"]: r for r in res["summary"]["rows"]}
    assert list(rows) == ["loglinear", "loglinear+oppo-intra", "loglinear+oppo-inter"]
    assert rows["loglinear+oppo-inter"]["speedup_step_vs_oppo_off"] > 0 and "loglinear+oppo-inter" in res["summary"]["table_md"]
    parent = runs[runs["tags.a3po.role"] == "parent"].iloc[0]
    assert parent["tags.a3po.variants"] == "loglinear,loglinear+oppo-intra,loglinear+oppo-inter"
    speedup = rows["loglinear+oppo-inter"]["speedup_step_vs_oppo_off"]
    assert parent["metrics.speedup/loglinear_oppo-inter_vs_loglinear/step_time"] == pytest.approx(speedup)

    # Per-step records: one value per RL step, equal to the trainer's own (history.jsonl).
    client = MlflowClient(uri)
    for rec in res["runs"]:
        local = [json.loads(line) for line in Path(rec["history_path"]).read_text().splitlines()]
        assert [h["step"] for h in local] == list(range(1, steps + 1))
        run_id = children.loc[rec["arm"], "run_id"]
        for key in (*PER_STEP, *PER_STEP_ARM.get(rec["arm"], ())):
            shipped = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
            assert shipped == [(h["step"], pytest.approx(h[key], rel=1e-12)) for h in local], (rec["arm"], key)
    inter_run = next(r for r in res["runs"] if r["arm"] == "loglinear+oppo-inter")
    inter = [json.loads(line) for line in Path(inter_run["history_path"]).read_text().splitlines()]
    assert inter[0]["oppo/delta"] == 2.0  # oppo.delta_init: the first batch admitted B + 2 groups
