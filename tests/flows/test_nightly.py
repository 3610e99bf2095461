"""The nightly parity flow decides: healthy variants pass, a planted regression fails.

The regression is a test-only advantage estimator registered in a3po's registry,
``planted_negated`` (GRPO advantages with the sign flipped: the update pushes probability away
from correct answers), given to the candidate (loglinear) only through ``variant_overrides``.

A parity decision needs learning, which the micro preset alone does not do. So the runs use the
micro model on a small, learnable task written here: "+" word problems with operands 1..3
whose worked solution is just the number. 60 warm-start steps reach ~0.3 held-out accuracy;
40 RL steps of 32 prompts x 4 samples lift the training reward from ~0.43 (after a dip to ~0.32 in
the first steps) to ~0.5-0.65 for every healthy variant, while the negated candidate falls to ~0.
Measured (seeds 0, 1, 2; smooth_frac 0.5): the references' (recompute) reward moved +0.066, +0.048,
+0.071 (the night needs a mean >= tasks.parity.MIN_REFERENCE_GAIN; at 24 steps it was +0.043 for
seeds 0 and 1, and the healthy night was "not measurable"); healthy per-seed differences +0.097,
+0.059, +0.002, planted ones -0.48 to -0.53; the tolerances (0.15 fast, 0.1 slow) sit between.

Fast test (default): K = 2 seeds, one reference (recompute); the planted run shares the
output dir, so the reference runs are resumed (already finished), not retrained.
Slow test (``-m slow``): K = 3 seeds, both references, tolerance 0.1.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from a3po.algorithms.advantages import ADVANTAGE_ESTIMATORS, SequenceLevel, grpo_advantages
from a3po.data.arithmetic import ITEMS, NAMES, PROMPT_FORMAT, PRONOUN, TEMPLATES

PLANTED = "planted_negated"
if PLANTED not in ADVANTAGE_ESTIMATORS:

    def planted_negated(rewards, group_ids):
        """A deliberately broken estimator: the negated GRPO advantage."""
        return -grpo_advantages(rewards, group_ids)

    ADVANTAGE_ESTIMATORS.register(PLANTED)(SequenceLevel(planted_negated))


SETTING = {
    "warm_start": {"steps": 60, "batch_size": 32, "lr": 2e-2},
    # Pinned rather than taken from RLConfig's defaults, which are tuned for the tiny preset.
    "rl": {"steps": 40, "batch_prompts": 32, "group_size": 4, "minibatches": 2, "lr": 3e-3, "lr_warmup_steps": 0,
           "lr_schedule": "constant",
           "temperature": 1.0, "eval_samples": 1, "max_new_tokens": 4, "eval_every": 40, "checkpoint_every": 40},
}


def easy_rows(n: int, seed: int, max_operand: int = 3) -> list[dict]:
    rng = random.Random(seed)
    adds = [t for t, op in TEMPLATES if op == "+"]
    rows = []
    for i in range(n):
        a, b, name = rng.randint(1, max_operand), rng.randint(1, max_operand), rng.choice(NAMES)
        q = rng.choice(adds).format(name=name, pronoun=PRONOUN[name], item=rng.choice(ITEMS), a=a, b=b)
        rows.append({"id": f"easy-{seed}-{i}", "prompt": PROMPT_FORMAT.format(question=q), "solution": str(a + b), "gold": str(a + b)})
    return rows


@pytest.fixture(scope="module")
def easy_dataset(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("easy")
    for name, n, seed in (("train.jsonl", 400, 1), ("heldout.jsonl", 32, 2)):
        (d / name).write_text("".join(json.dumps(r) + "\n" for r in easy_rows(n, seed)))
    return str(d)


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory) -> str:
    """One warm-start cache for the module: every night here starts from the same warm start."""
    return str(tmp_path_factory.mktemp("warm-cache"))


def _nightly(tmp, dataset, seeds, references, tolerance, planted: bool, cache: str, output="out"):
    from flows.nightly_parity import NightlySpec, nightly_parity

    return nightly_parity(NightlySpec(
        preset="micro", seeds=seeds, references=references, tolerance=tolerance, smooth_frac=0.5,
        overrides={**SETTING, "data": {"train_path": f"{dataset}/train.jsonl", "heldout_path": f"{dataset}/heldout.jsonl"}},
        variant_overrides={"loglinear": {"advantage": PLANTED}} if planted else None,
        tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}", experiment="nightly", output_dir=str(tmp / output),
        cache_dir=cache,
    ))


def _check(res, verdict: str, uri: str):
    import mlflow

    print(res["report_md"])  # shown with -s or on failure
    assert res["verdict"] == verdict, res["report_md"]
    mlflow.set_tracking_uri(uri)
    parent = mlflow.get_run(res["parent_run_id"])
    assert parent.data.tags["parity"] == verdict and parent.data.tags["a3po.kind"] == "nightly"
    assert parent.data.metrics["parity/pass"] == float(verdict == "pass")
    # The verdict opens the Description and the flow run's verdict artifact (tasks.artifacts).
    assert parent.data.tags["mlflow.note.content"].startswith(f"# Nightly parity: {verdict.upper()}\n")
    from tests.tasks.test_artifacts import _artifacts

    found = _artifacts(parent.data.tags["prefect.flow_run_id"])
    assert found["nightly-micro-nightly-verdict"].data.startswith(f"# Nightly parity: {verdict.upper()}\n")
    assert {"nightly-micro-nightly-pairs", "nightly-micro-nightly-mlflow-parent"} <= set(found)


@pytest.mark.e2e
def test_nightly_passes_healthy_and_fails_planted_regression(prefect_server, tmp_path, easy_dataset, warm_cache):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    healthy = _nightly(tmp_path, easy_dataset, [0, 1], ["recompute"], 0.15, planted=False, cache=warm_cache)
    _check(healthy, "pass", uri)
    (h,) = healthy["results"]
    assert all(abs(d) < 0.15 for d in h["diffs"]), h

    planted = _nightly(tmp_path, easy_dataset, [0, 1], ["recompute"], 0.15, planted=True, cache=warm_cache)
    _check(planted, "fail", uri)
    # The candidate's final models are registered each night; only the night that passed holds the alias.
    from mlflow.tracking import MlflowClient

    from tasks.models import PASS_ALIAS

    good, bad = healthy["registered"], planted["registered"]
    assert good["name"] == bad["name"] == "a3po-nightly-micro-loglinear" and sorted(good["versions"]) == [0, 1]
    assert good["alias"] == good["versions"][0] and bad["alias"] is None
    assert set(bad["versions"].values()).isdisjoint(good["versions"].values())  # other weights: new versions
    by_alias = MlflowClient(uri).get_model_version_by_alias(good["name"], PASS_ALIAS)
    assert str(by_alias.version) == good["alias"] and by_alias.tags["nightly.verdict"] == "pass"
    (p,) = planted["results"]
    assert p["ci_high"] < -0.15 and all(d < -0.15 for d in p["diffs"]), p
    # The reference runs were finished by the healthy night and resumed, not retrained.
    assert {r["variant"]: r["resumed_from"] for r in planted["runs"]} == {"loglinear": None, "recompute": 40}
    # The trend compares with the earlier (healthy) night found in MLflow.
    assert [t["parity"] for t in planted["trend"]] == ["pass"]
    assert "1 earlier night" in planted["trend_line"]
    assert Path(planted["output_dir"], "summary", "parity.md").read_text().startswith("# Nightly parity: fail")


@pytest.mark.e2e
def test_nightly_command_exits_non_zero_on_failure(prefect_server, tmp_path, easy_dataset, warm_cache, capsys):
    """The __main__ path: exit status 1 and the JSON line last. Same runs as the planted night
    of the test above, computed afresh here in its own directory (K = 1 to keep it short)."""
    from flows.nightly_parity import main

    sets = [f"{sec}.{k}={v}" for sec, kv in SETTING.items() for k, v in kv.items()]
    sets += [f"data.train_path={easy_dataset}/train.jsonl", f"data.heldout_path={easy_dataset}/heldout.jsonl", f"loglinear:rl.advantage={PLANTED}"]
    argv = ["--preset", "micro", "--seeds", "0", "--references", "recompute", "--tolerance", "0.15", "--smooth-frac", "0.5",
            "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}", "--output-dir", str(tmp_path / "out"), "--cache-dir", warm_cache]
    for item in sets:
        argv += ["--set", item]
    assert main(argv) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    figures = json.loads(last)
    assert figures["verdict"] == "fail" and figures["loglinear_vs_recompute/pass"] is False


def test_the_nightly_budget_applies_only_where_nothing_else_sets_the_steps(tmp_path):
    """tiny as shipped: 6 seeds x 75 steps (the calibrated budget, docs/pipeline.md); given steps, a
    config or an rl.steps override win; a preset without a budget keeps its own steps."""
    from flows.nightly_parity import NightlySpec

    spec = NightlySpec(preset="tiny")
    assert (spec.seeds, spec.steps, spec.train_config().rl.steps) == ([0, 1, 2, 3, 4, 5], 75, 75)
    assert NightlySpec(preset="tiny", steps=150).train_config().rl.steps == 150
    assert NightlySpec(preset="tiny", overrides={"rl": {"steps": 40}}).train_config().rl.steps == 40
    (tmp_path / "c.yaml").write_text("rl: {steps: 30}\n")
    assert NightlySpec(preset="tiny", config=str(tmp_path / "c.yaml")).train_config().rl.steps == 30
    assert NightlySpec(preset="micro").steps is None


def test_the_deployed_nightly_decides_with_the_shortfall_rule_and_its_recorded_calibration():
    """``rule: auto`` as deployed (infra/prefect.yaml's nightly-parity spec) must take the shortfall
    rule with the tiny preset's calibration at 75 steps, not fall back to the noninferiority
    bootstrap, which cannot see a 0.04 regression (docs/pipeline.md). The calibration is written out
    by hand (tasks.parity.CALIBRATIONS, measured by ``bench.nightly_power --steps 75 --seeds 10-19``):
    healthy mean -0.0083, seed sd 0.0104, 10 seeds, none of them the nightly's; re-measuring it means
    changing it here too."""
    import yaml

    from flows.nightly_parity import NightlySpec, check_arms, resolve_rule

    root = Path(__file__).resolve().parents[2]
    deployed = {d["name"]: d for d in yaml.safe_load((root / "infra/prefect.yaml").read_text())["deployments"]}

    def rule_of(spec: NightlySpec) -> tuple:
        cand, refs = check_arms(spec)  # as the flow does: the arms' names as built
        return resolve_rule(spec, spec.train_config().rl.steps, cand.name, [r.name for r in refs])

    for spec in (NightlySpec(**deployed["nightly-parity"]["parameters"]["spec"]), NightlySpec()):
        rule, noise_sd, healthy_mean, seeds, note = rule_of(spec)
        assert (rule, noise_sd, healthy_mean, seeds) == ("shortfall", 0.0104, -0.0083, 10), note
        assert note.startswith("shortfall, calibrated on 10 seeds"), note
        assert note.endswith("out of sample: no seed of tonight's is a calibration seed"), note
    # The pretrained preset at its own steps: calibrated on seeds 10-14, none of the nightly's 0-5.
    rule, noise_sd, healthy_mean, seeds, note = rule_of(NightlySpec(preset="smol"))
    assert (rule, noise_sd, healthy_mean, seeds) == ("shortfall", 0.0558, -0.0333, 5), note
    assert note.endswith("out of sample: no seed of tonight's is a calibration seed"), note
    # A night on calibration seeds is said to be judged in sample.
    in_sample = rule_of(NightlySpec(seeds=[3, 12, 15]))[4]
    assert in_sample.endswith("IN SAMPLE: tonight's seeds [12, 15] are calibration seeds"), in_sample
    # Controls: a setting without a calibration falls back (auto), or is refused (shortfall).
    assert rule_of(NightlySpec(steps=40))[0] == "noninferiority"
    assert rule_of(NightlySpec(overrides={"rl": {"lr": 1e-3}}))[0] == "noninferiority"
    with pytest.raises(ValueError, match="no recorded calibration"):
        rule_of(NightlySpec(steps=40, rule="shortfall"))


@pytest.mark.slow
def test_nightly_parity_three_seeds_both_references(prefect_server, tmp_path, easy_dataset, warm_cache):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    healthy = _nightly(tmp_path, easy_dataset, [0, 1, 2], ["recompute", "sync"], 0.1, planted=False, cache=warm_cache)
    _check(healthy, "pass", uri)
    planted = _nightly(tmp_path, easy_dataset, [0, 1, 2], ["recompute", "sync"], 0.1, planted=True, cache=warm_cache)
    _check(planted, "fail", uri)
    assert all(not r["passed"] and r["ci_low"] < -0.2 for r in planted["results"]), planted["report_md"]


@pytest.mark.slow
def test_the_nightly_as_deployed_fails_planted_regressions_and_passes_the_unchanged_candidate(prefect_server, tmp_path):
    """The nightly with its defaults (tiny preset, its seeds and steps, rule auto: the shortfall
    rule with the recorded calibration, docs/pipeline.md): the unchanged candidate passes, the
    learning rate halved and the biased advantage (bench._planted) fail. The planted nights share
    the output folder, so the references are reused, not retrained."""
    from a3po.config import preset
    from bench._planted import plant_overrides
    from flows.nightly_parity import NightlySpec, nightly_parity

    common = dict(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", output_dir=str(tmp_path / "night"), cache_dir=str(tmp_path / "cache"))
    healthy = nightly_parity(NightlySpec(**common))
    print(healthy["report_md"])
    (res,) = healthy["results"]
    assert (res["rule"], res["reference"], healthy["verdict"]) == ("shortfall", "pooled", "pass"), healthy["report_md"]
    for plant in ("lr_half", "biased_advantage"):
        night = nightly_parity(NightlySpec(**common, variant_overrides={"loglinear": plant_overrides(plant, preset("tiny"))}))
        print(plant, night["report_md"])
        assert night["verdict"] == "fail", (plant, night["report_md"])
        assert {r["variant"] for r in night["runs"] if r["resumed_from"] is None} == {"loglinear"}  # only the candidate trained
