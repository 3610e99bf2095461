"""The pieces under the flows, without a Prefect server: the batched MLflow logger on a real
SQLite store, the comparison arithmetic (target, time to target, speedups), the parity rule,
the benchmark skip and the ``--set`` parser. Seconds in total."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.cli import parse_sets
from tasks.arms import Arm
from tasks.evaluation import available_benchmarks
from tasks.parity import decide, paired_bootstrap_ci, shortfall_test
from tasks.summary import ArmRun, compare, smooth, table, time_to_target, window
from tasks.tracking import MlflowMetricLogger, client_for, create_run, ensure_experiment, flatten


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One SQLite store for the module (creating one runs MLflow's migrations: seconds)."""
    tmp_path = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = client_for(uri)
    exp = ensure_experiment(client, "test", uri)
    return client, exp, uri, tmp_path


def test_logger_batches_and_backfills(store):
    client, exp, _, _ = store
    run_id = create_run(client, exp, "r", {"a3po.role": "child"})
    logger = MlflowMetricLogger(client, run_id, flush_every_s=3600)
    history = [{"reward/mean": 0.1 * s, "stability/trust_ratio_max": 1.0 + s} for s in range(1, 21)]
    for step in (1, 2, 3):  # a run that logs live only from step 1 to 3 ...
        logger.log_metrics(history[step - 1], step)
    assert logger.n_calls == 0  # buffered: no round trip per step
    assert logger.ensure_history(history) == 17  # ... and back-fills the rest (a resumed run's restored steps)
    assert logger.n_calls == 1  # 40 values in one log_batch
    rewards = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "reward/mean"))
    assert rewards == [(s, pytest.approx(0.1 * s)) for s in range(1, 21)]


def test_logger_skips_logged_steps_and_rejects_bad_keys(store):
    client, exp, _, _ = store
    run_id = create_run(client, exp, "r", {})
    logger = MlflowMetricLogger(client, run_id, skip_through_step=5)  # a retry: steps 1-5 are in the run
    logger.log_metrics({"reward/mean": 1.0}, 5)
    logger.log_metrics({"reward/mean": 2.0}, 6)
    logger.flush()
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "reward/mean")] == [(6, 2.0)]
    with pytest.raises(ValueError, match="invalid MLflow metric key"):
        logger.log_metrics({"eval/pass@1": 0.5}, 7)


def test_a_retry_still_logs_an_evaluation_that_arrives_after_its_step(store):
    """A retried task (steps 1-6 in the run, the held-out figures of step 2 too but not those of step 4,
    evaluated beside training when the task died) logs step 4's late figures, nothing else at or
    below 6, and back-fills step 4's figures from the history."""
    client, exp, _, _ = store
    run_id = create_run(client, exp, "r", {})
    logger = MlflowMetricLogger(client, run_id, skip_through_step=6, late_steps_logged=frozenset({2}))
    logger.log_metrics({"reward/mean": 1.0, "eval/heldout_acc": 0.4}, 2)  # all in the run already
    logger.log_metrics({"reward/mean": 1.0, "eval/heldout_acc": 0.5}, 4)  # the late figure only
    logger.flush()
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "eval/heldout_acc")] == [(4, 0.5)]
    assert client.get_metric_history(run_id, "reward/mean") == []
    other = create_run(client, exp, "r2", {})
    logger = MlflowMetricLogger(client, other, skip_through_step=6, late_steps_logged=frozenset({2}))
    history = [{"reward/mean": 0.1 * s} | ({"eval/heldout_acc": 0.1 * s} if s % 2 == 0 else {}) for s in range(1, 9)]
    assert logger.ensure_history(history) == 4  # step 4 and 6's late figures, steps 7 and 8 whole
    assert [m.step for m in client.get_metric_history(other, "eval/heldout_acc")] == [4, 6, 8]
    assert [m.step for m in client.get_metric_history(other, "reward/mean")] == [7, 8]


def test_experiment_artifacts_live_next_to_the_sqlite_store(store):
    client, exp, _, tmp_path = store
    assert client.get_experiment(exp).artifact_location == (tmp_path / "mlartifacts" / "test").as_uri()
    assert flatten({"rl": {"lr": 0.001, "variant": "sync"}, "a": None}) == {"rl.lr": "0.001", "rl.variant": "sync", "a": "None"}


def _hist(rewards, step_time):
    return [{"reward/mean": r, "perf/step_time_s": step_time, "time/train_wall_s": step_time * (i + 1)} for i, r in enumerate(rewards)]


def test_comparison_target_and_speedups():
    # 8 steps -> window W = ceil(0.25 * 8) = 2. Rewards climb; "fast" climbs at the same rate per
    # step but each step takes half the time.
    ramp = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]
    recs = [
        {"variant": "recompute", "seed": 0, "history": _hist(ramp, 1.0), "final_acc": 0.5, "warmstart_acc": 0.2},
        {"variant": "loglinear", "seed": 0, "history": _hist(ramp, 0.5), "final_acc": 0.6, "warmstart_acc": 0.2},
    ]
    assert window(8) == 2 and smooth([0, 1, 2, 3], 2) == [0, 0.5, 1.5, 2.5]
    comp = compare([ArmRun.of(r) for r in recs])
    # r0 = 0 (first step), final = mean(0.6, 0.7) = 0.65, target = 0 + 0.8 * 0.65 = 0.52;
    # smoothed reward first >= 0.52 at step 7 (mean(0.5, 0.6) = 0.55): wall 7 s vs 3.5 s.
    assert comp.target == pytest.approx(0.52)
    assert time_to_target(recs[0]["history"], comp.target) == pytest.approx(7.0)
    m = comp.metrics
    assert m["speedup/loglinear_vs_recompute/time_to_target"] == pytest.approx(2.0)
    assert m["speedup/loglinear_vs_recompute/step_time"] == pytest.approx(2.0)
    assert m["delta/loglinear_vs_recompute/final_acc"] == pytest.approx(0.1)
    assert m["delta/loglinear_vs_recompute/final_reward"] == pytest.approx(0.0)
    from a3po.training.metrics import valid_metric_key

    assert all(valid_metric_key(k) for k in m)


def test_comparison_without_learning_reports_no_target():
    flat = _hist([0.0] * 4, 1.0)
    comp = compare([ArmRun(Arm.parse(v), 0, flat, warmstart_acc=0.0, final_acc=0.0) for v in ("sync", "loglinear")])
    assert comp.target is None and comp.notes
    assert not any(k.endswith("time_to_target") for k in comp.metrics)


def test_a_run_that_never_reaches_the_target_is_named_and_keeps_its_arm_out_of_the_mean():
    # Window 2 of 8 steps. sync climbs to 0.65 (target 0.8 x 0.65 = 0.52 from a first reward of 0);
    # loglinear seed 1 stays at 0.1: never reached. Its arm has no mean time to target (seed 0's
    # alone would read as the arm's), and the note names the run.
    ramp = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]
    runs = [ArmRun(Arm.parse("sync"), 0, _hist(ramp, 1.0), warmstart_acc=0.0, final_acc=0.0),
            ArmRun(Arm.parse("loglinear"), 0, _hist(ramp, 0.5), warmstart_acc=0.0, final_acc=0.0),
            ArmRun(Arm.parse("loglinear"), 1, _hist([0.0] + [0.1] * 7, 0.5), warmstart_acc=0.0, final_acc=0.0)]
    comp = compare(runs)
    assert comp.target == pytest.approx(0.52)
    assert comp.notes == ["the target reward 0.520 was reached by 2 of 3 runs; not reached: loglinear seed 1"]
    assert [r["time_to_target_s"] for r in comp.rows] == [pytest.approx(7.0), None]


def _stab(behav_max, behav_p99, trust_max, clipped):
    return {"stability/behav_iw_max": behav_max, "stability/behav_iw_p99": behav_p99, "stability/trust_ratio_max": trust_max,
            "stability/trust_ratio_clipped_frac": clipped}


def test_comparison_stability_columns():
    # Two steps per run, two seeds of "loglinear", one of "recompute" (numbers chosen by hand):
    #   behaviour IW max = max over steps and seeds; p99 and clipped = mean over steps, then over seeds.
    def rec(variant, seed, steps):
        h = _hist([0.0, 0.1], 1.0)
        history = [{**x, **_stab(*st)} for x, st in zip(h, steps, strict=True)]
        return {"variant": variant, "seed": seed, "history": history, "final_acc": 0.0, "warmstart_acc": 0.0}

    recs = [
        rec("loglinear", 0, [(2.0, 1.5, 3.0, 0.01), (4.0, 2.5, 1.0, 0.03)]),  # p99 mean 2.0, clipped mean 0.02
        rec("loglinear", 1, [(6.0, 1.0, 2.0, 0.00), (1.0, 1.0, 2.0, 0.00)]),  # p99 mean 1.0, clipped mean 0.0
        rec("recompute", 0, [(9.0, 3.0, 1.5, 0.10), (8.0, 5.0, 1.2, 0.20)]),
    ]
    comp = compare([ArmRun.of(r) for r in recs])
    ll, rc = comp.rows
    assert (ll["behav_iw_max"], ll["behav_iw_p99"], ll["trust_ratio_max"], ll["clipped_frac"]) == pytest.approx((6.0, 1.5, 3.0, 0.01))
    assert (rc["behav_iw_max"], rc["behav_iw_p99"], rc["trust_ratio_max"], rc["clipped_frac"]) == pytest.approx((9.0, 4.0, 1.5, 0.15))
    assert [f["behav_iw_max"] for f in ll["per_seed"]] == [4.0, 6.0] and [f["seed"] for f in ll["per_seed"]] == [0, 1]
    assert comp.metrics["summary/recompute/behav_iw_max"] == 9.0
    df = table(comp)
    for col in ("behaviour IW max", "behaviour IW p99", "trust-region ratio max", "clipped tokens"):
        assert col in df.columns
    assert "IW max" not in df.columns  # the old, mislabelled trust-ratio column is gone
    assert df["behaviour IW max"].tolist() == [6.0, 9.0]


def test_bootstrap_ci_brackets_the_mean_and_is_reproducible():
    mean, low, high = paired_bootstrap_ci([0.1, -0.05, 0.02])
    assert low <= mean <= high and -0.05 - 1e-9 <= low and high <= 0.1 + 1e-9  # within [min, max] of the diffs
    assert paired_bootstrap_ci([0.1, -0.05, 0.02]) == (mean, low, high)
    assert paired_bootstrap_ci([0.3]) == (0.3, 0.3, 0.3)  # one seed: the interval is the difference


def _rec(variant, seed, final_reward):
    # W = ceil(0.25 * 4) = 1: the final reward is the last step's reward.
    return {"variant": variant, "seed": seed, "history": _hist([0.0, 0.0, 0.0, final_reward], 1.0), "final_acc": 0.0}


def test_parity_rule_passes_noise_and_fails_a_regression():
    healthy = [_rec("recompute", s, 0.40) for s in range(3)] + [_rec("loglinear", s, r) for s, r in enumerate((0.42, 0.37, 0.41))]
    (res,) = decide(healthy, "loglinear", ["recompute"], tolerance=0.1)
    assert res.passed and res.diffs == pytest.approx([0.02, -0.03, 0.01]) and res.ci_low == pytest.approx(-0.03)  # K=3: low = the worst seed
    broken = [_rec("recompute", s, 0.40) for s in range(3)] + [_rec("loglinear", s, r) for s, r in enumerate((0.10, 0.05, 0.38))]
    (res,) = decide(broken, "loglinear", ["recompute"], tolerance=0.1)
    assert not res.passed and res.ci_low < -0.1


def test_shortfall_rule_pools_the_references_and_fails_below_the_calibrated_threshold():
    # sigma 0.04, K 4, 95%: threshold = 1.6448536 * 0.04 / 2 = 0.0328971.
    refs = [_rec("recompute", s, r) for s, r in enumerate((0.41, 0.40, 0.40, 0.40))] + \
           [_rec("sync", s, r) for s, r in enumerate((0.39, 0.40, 0.42, 0.38))]  # per-seed mean 0.40, 0.40, 0.41, 0.39
    healthy = refs + [_rec("loglinear", s, r) for s, r in enumerate((0.40, 0.38, 0.41, 0.37))]
    (res,) = decide(healthy, "loglinear", ["recompute", "sync"], rule="shortfall", noise_sd=0.04)
    assert (res.reference, res.pooled, res.rule) == ("pooled", ("recompute", "sync"), "shortfall")
    assert res.diffs == pytest.approx([0.0, -0.02, 0.0, -0.02]) and res.mean_diff == pytest.approx(-0.01)
    assert res.tolerance == pytest.approx(0.0328971, abs=1e-7) and res.ci_high == pytest.approx(0.0228971, abs=1e-7) and res.passed
    broken = refs + [_rec("loglinear", s, r) for s, r in enumerate((0.35, 0.36, 0.37, 0.33))]  # d = -0.05, -0.04, -0.04, -0.06
    (res,) = decide(broken, "loglinear", ["recompute", "sync"], rule="shortfall", noise_sd=0.04)
    assert res.mean_diff == pytest.approx(-0.0475) and not res.passed
    # Against a healthy candidate recorded 0.02 behind its references the same night passes:
    # tolerance = 0.0328971 + 0.02; recorded 0.01 behind, it still fails (-0.0475 < -0.0428971).
    (res,) = decide(broken, "loglinear", ["recompute", "sync"], rule="shortfall", noise_sd=0.04, healthy_mean=-0.02)
    assert res.passed and res.tolerance == pytest.approx(0.0528971, abs=1e-7) and res.healthy_mean == -0.02
    (res,) = decide(broken, "loglinear", ["recompute", "sync"], rule="shortfall", noise_sd=0.04, healthy_mean=-0.01)
    assert not res.passed
    # mu_h and sigma measured on N = 12 seeds: Student's t_11 at 0.95 is 1.7958848 (tables), so
    # h = 1.7958848 * 0.04 * sqrt(1/4 + 1/12) = 0.0414742, the threshold is -0.0514742 and the same
    # night passes; N = 2 seeds are allowed, N = 1 is refused.
    (res,) = decide(broken, "loglinear", ["recompute", "sync"], rule="shortfall", noise_sd=0.04, healthy_mean=-0.01, calibration_seeds=12)
    assert res.passed and res.tolerance == pytest.approx(0.0514742, abs=1e-7) and res.calibration_seeds == 12
    with pytest.raises(ValueError, match="calibration_seeds must be >= 2"):
        shortfall_test([0.0], 0.04, 0.95, 0.0, 1)
    # Exactly at the threshold passes; the threshold shrinks as 1/sqrt(K).
    assert shortfall_test([-0.03289], 0.02, 0.95)[4] is True and shortfall_test([-0.03291], 0.02, 0.95)[4] is False
    assert shortfall_test([0.0] * 16, 0.04, 0.95)[3] == pytest.approx(0.0164485, abs=1e-7)
    with pytest.raises(ValueError, match="noise_sd"):
        decide(healthy, "loglinear", ["recompute", "sync"], rule="shortfall")


def test_missing_benchmark_data_is_skipped_with_a_reason(tmp_path):
    ok, skipped = available_benchmarks(["gsm8k", "aime24"], str(tmp_path / "absent"))
    assert ok == [] and set(skipped) == {"gsm8k", "aime24"} and "not found" in skipped["gsm8k"]
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    ok, skipped = available_benchmarks(["gsm8k", "aime24"], str(tmp_path))
    assert ok == ["gsm8k"] and list(skipped) == ["aime24"]


def test_set_overrides():
    overrides, per_variant = parse_sets(["rl.lr=1e-3", "data.n_train=50", "loglinear:rl.proximal=metrics", "torch_threads=2"])
    assert overrides == {"rl": {"lr": 1e-3}, "data": {"n_train": 50}, "torch_threads": 2}
    assert per_variant == {"loglinear": {"proximal": "metrics"}}
    with pytest.raises(SystemExit):
        parse_sets(["loglinear:data.n_train=5"])


def test_train_task_retry_reuses_its_child_run(store, core_stub_rewards):
    """A Prefect retry calls the task again in the same flow run: it must find its child run,
    resume from the checkpoint and log nothing twice (the task through ``.fn()``). The run's guard
    fires (lr far too high, bound 4, rewards that vary: tests/training/test_guard.py), so its actions
    reach the run too."""
    from a3po.config import preset, with_overrides
    from tasks.tracking import TrackingRef
    from tasks.training import run_dir_for, train_arm, warm_start

    client, exp, uri, tmp_path = store
    drift = {"guard_every": 1, "lr": 0.05, "lr_warmup_steps": 0, "lr_schedule": "constant", "max_staleness": 4}
    cfg = with_overrides(preset("micro"), rl={"steps": 4, **drift})
    ref = TrackingRef(uri, exp, create_run(client, exp, "parent", {"a3po.role": "parent"}))
    ws = warm_start.fn(cfg, str(tmp_path / "cache"))
    run_dir = str(run_dir_for(tmp_path / "out", cfg))
    first = train_arm.fn(cfg, run_dir, ws, ref)
    again = train_arm.fn(cfg, run_dir, ws, ref)
    assert again.mlflow_run_id == first.mlflow_run_id and again.resumed_from == 4
    assert [m.step for m in client.get_metric_history(first.mlflow_run_id, "reward/mean")] == [1, 2, 3, 4]
    assert client.get_run(first.mlflow_run_id).info.status == "FINISHED"
    # The completion tables (micro: eval_every 2), each logged once: 8 training + 8 held-out rows.
    assert [f.path for f in client.list_artifacts(first.mlflow_run_id, "completions")] == [
        "completions/step_000002.json", "completions/step_000004.json"]
    table = client.download_artifacts(first.mlflow_run_id, "completions/step_000004.json", str(tmp_path / "tables"))
    assert len(json.loads(Path(table).read_text())["data"]) == 16
    # The guard's actions (steps 2-4; step 1 is on-policy), as a table the run page shows, once.
    run = client.get_run(first.mlflow_run_id)
    assert {"path": "actions.json", "type": "table"} in json.loads(run.data.tags["mlflow.loggedArtifacts"])
    actions = json.loads(Path(client.download_artifacts(first.mlflow_run_id, "actions.json", str(tmp_path / "acts"))).read_text())
    assert actions["columns"] == ["step", "source", "setting", "action", "reason", "figures"]
    assert [r[:4] for r in actions["data"]] == [[s, "guard", "rl.guard_policy warn", "no change"] for s in (2, 3, 4)]
    assert all(r[4].startswith("guard/abs_err_p99 ") and "> rl.guard_max_err 1" in r[4] for r in actions["data"])
    figures = actions["data"][-1][5]  # as the reason writes them: guard/abs_err_p99=1.891, rl.guard_max_err=1, guard/bound=4
    assert figures.startswith("guard/abs_err_p99=") and "rl.guard_max_err=1, " in figures and figures.endswith("guard/bound=4")
    assert run.data.tags["a3po.actions"] == "3: guard 3"
    assert run.data.tags["a3po.last_action"].startswith("step 4, guard (rl.guard_policy warn): no change; guard/abs_err_p99 ")


def test_a_finished_arm_whose_checkpoints_are_gone_is_reused_by_a_new_flow_run(store, core_stub_rewards):
    """Checkpoints deleted to save disk, a new flow run over the same output folder takes the
    finished arm's record (result.json, history.jsonl) into a child run of its own, every step
    logged, and trains nothing (every file of the run folder unchanged). A run cut short between
    its result and its history is not reused: with no checkpoint it is refused, files unchanged."""
    import shutil

    from a3po.config import preset, with_overrides
    from a3po.training.run import FinishedRunError
    from tasks.tracking import TrackingRef
    from tasks.training import run_dir_for, train_arm, warm_start

    client, exp, uri, tmp_path = store
    cfg = with_overrides(preset("micro"), rl={"steps": 4, "seed": 3})
    ws = warm_start.fn(cfg, str(tmp_path / "cache"))
    run_dir = run_dir_for(tmp_path / "reused", cfg)
    first = train_arm.fn(cfg, str(run_dir), ws, TrackingRef(uri, exp, create_run(client, exp, "night 1", {"a3po.role": "parent"})))
    shutil.rmtree(run_dir / "checkpoints")
    files = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and ".lock" not in p.name}
    assert {"result.json", "history.jsonl", "metrics.jsonl"} <= {p.name for p in files}

    again = train_arm.fn(cfg, str(run_dir), ws, TrackingRef(uri, exp, create_run(client, exp, "night 2", {"a3po.role": "parent"})))
    assert again.mlflow_run_id != first.mlflow_run_id
    assert (again.final_acc, again.steps, again.wall_s, again.resumed_from) == (first.final_acc, 4, first.wall_s, 4)
    assert {p: p.read_bytes() for p in files} == files
    rewards = [[(m.step, m.value) for m in client.get_metric_history(r, "reward/mean")] for r in (first.mlflow_run_id, again.mlflow_run_id)]
    assert rewards[1] == rewards[0] and [s for s, _ in rewards[1]] == [1, 2, 3, 4]
    run = client.get_run(again.mlflow_run_id)
    assert run.info.status == "FINISHED" and run.data.tags["a3po.reused_record"] == str(run_dir / "result.json")
    assert run.data.metrics["final/heldout_acc"] == first.final_acc
    assert [f.path for f in client.list_artifacts(again.mlflow_run_id, "completions")] == [
        "completions/step_000002.json", "completions/step_000004.json"]

    (run_dir / "history.jsonl").unlink()  # as if killed after result.json, before its history
    del files[run_dir / "history.jsonl"]
    with pytest.raises(FinishedRunError, match="no checkpoint to resume from"):
        train_arm.fn(cfg, str(run_dir), ws, TrackingRef(uri, exp, create_run(client, exp, "night 3", {"a3po.role": "parent"})))
    assert {p: p.read_bytes() for p in files} == files


@pytest.mark.parametrize("flag,want", [("amx_bf16", "bf16-autocast"), (None, "float32")])
def test_a_child_run_records_what_dtype_auto_resolved_to(store, monkeypatch, flag, want):
    import a3po.devices
    from a3po.config import preset, with_overrides
    from tasks.child_run import open_child_run
    from tasks.tracking import TrackingRef

    client, exp, uri, tmp_path = store
    monkeypatch.setattr(a3po.devices, "cpu_native_bf16", lambda: flag)  # the CPU's flags, simulated
    ref = TrackingRef(uri, exp, create_run(client, exp, "parent", {"a3po.role": "parent"}))
    cfg = with_overrides(preset("micro"), device="cpu", dtype="auto")
    run_id, _ = open_child_run(ref, cfg, tmp_path / f"precision-{want}", 0.0)
    tags = client.get_run(run_id).data.tags
    assert tags["a3po.precision"] == want
    assert (flag or "neither amx_bf16 nor avx512_bf16") in tags["a3po.precision_reason"]
    assert client.get_run(run_id).data.params["dtype"] == "auto"  # the config as asked, beside what it resolved to


def test_time_to_target_reads_the_smoothed_curve_not_the_raw_one():
    # One lucky early step: the raw reward crosses 0.6 at step 2 (10 s), the trailing mean of 2 steps
    # (smooth_frac 0.2 of 10 steps) only at step 6: 0, .45, .45, .1, .4, .65 (60 s).
    rewards = [0.0, 0.9, 0.0, 0.2, 0.6, 0.7, 0.8, 0.9, 0.9, 0.9]
    history = [{"reward/mean": r, "time/train_wall_s": 10.0 * (i + 1)} for i, r in enumerate(rewards)]
    assert time_to_target(history, 0.6, smooth_frac=0.2) == 60.0
    assert time_to_target(history, 0.95, smooth_frac=0.2) is None  # never reached: None, not the last time


def test_the_bootstrap_interval_is_the_percentile_interval_of_resampled_means():
    # Diffs [0, 1, 1, 1]: a resample's mean is (4 - j) / 4 for j zeros drawn, j ~ Bin(4, 1/4):
    # P(mean 0) = 1/256, P(0.25) = 12/256 (cumulative 0.051), P(1) = (3/4)^4 = 0.316. So the 2.5%
    # quantile is 0.25 and the 97.5% one is 1.0. A normal interval (0.75 -+ 1.96 * 0.25) gives
    # 0.26..1.24; the quantiles of the diffs themselves give 0..1.
    mean, low, high = paired_bootstrap_ci([0.0, 1.0, 1.0, 1.0], n_boot=10_000, confidence=0.95)
    assert (mean, low, high) == (0.75, 0.25, 1.0)


def test_the_shortfall_rule_fails_a_shortfall_only_never_a_gain():
    # sigma 0.04, K 4 seeds, mu_h exact (no calibration seeds): h = 1.6449 * 0.04 / 2 = 0.0329.
    # One-sided: a candidate far better than healthy passes (a two-sided test would flag it), one
    # just past -h fails, one just inside passes.
    assert shortfall_test([0.3] * 4, 0.04, 0.95)[4] is True
    assert shortfall_test([-0.0330] * 4, 0.04, 0.95)[4] is False
    assert shortfall_test([-0.0328] * 4, 0.04, 0.95)[4] is True
    # Against a healthy mean of -0.02 the line moves down with it: -0.052 passes, -0.054 fails.
    assert shortfall_test([-0.052] * 4, 0.04, 0.95, healthy_mean=-0.02)[4] is True
    assert shortfall_test([-0.054] * 4, 0.04, 0.95, healthy_mean=-0.02)[4] is False


def test_a_store_that_refuses_dataset_inputs_costs_a_warning_never_the_run(tmp_path, caplog):
    import logging

    from a3po.config import preset, with_overrides
    from tasks.child_run import dataset_inputs, log_datasets

    (tmp_path / "train.jsonl").write_text('{"a": 1}\n{"a": 2}\n\n')
    (tmp_path / "heldout.jsonl").write_text('{"a": 3}\n')
    cfg = with_overrides(preset("micro"), data={"train_path": str(tmp_path / "train.jsonl"),
                                                 "heldout_path": str(tmp_path / "heldout.jsonl")})
    assert [(i.dataset.name, json.loads(i.dataset.profile)["num_rows"]) for i in dataset_inputs(cfg)] == [
        ("train.jsonl", 2), ("heldout.jsonl", 1)]
    assert dataset_inputs(preset("micro")) == []  # the embedded task: generated in memory, no file to name

    class Refusing:
        def log_inputs(self, run_id, datasets=None):
            raise RuntimeError("INVALID_PARAMETER_VALUE: datasets are not supported by this server")

    with caplog.at_level(logging.WARNING, logger="a3po.tasks"):
        log_datasets(Refusing(), "run-1", cfg)
    assert "MLflow run run-1: the dataset inputs (train.jsonl, heldout.jsonl) were not recorded: RuntimeError" in caplog.text
