"""The comparison flows' typed parameters: each flow takes one spec (a pydantic model the Prefect UI
renders as its run form), the deployments of infra/prefect.yaml fit it, ``infra/deploy.py --param
KEY=VALUE`` sets its fields, and an arm is one value whose name is written and read in one place."""

from __future__ import annotations

import inspect
import itertools
import re
import sys
from pathlib import Path

import jsonschema
import pytest

from a3po.config import preset, with_overrides
from a3po.config.axes import OPPO_MODE_NAMES, PLACEMENTS
from flows.compare_variants import CompareSpec, compare_variants
from flows.nightly_parity import NightlySpec, nightly_parity
from flows.paper_claims import ClaimsSpec, paper_claims
from tasks.arms import Arm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "infra"))
from deploy import deployments, flow_parameters, parameter_problems  # noqa: E402  (infra/ is not a package)

PPO_MICRO = {"rl": {"advantage": "gae"}, "ppo": {"critic": "policy_copy", "critic_lr": 1e-3, "kl_coef": 0.05, "kl_estimator": "k3"}}


@pytest.mark.parametrize("flow, spec_type", [(compare_variants, CompareSpec), (nightly_parity, NightlySpec), (paper_claims, ClaimsSpec)])
def test_each_comparison_flow_takes_one_typed_spec(flow, spec_type):
    params = inspect.signature(flow.fn).parameters
    assert list(params) == ["spec"] and params["spec"].default == spec_type()
    # The form Prefect renders: one object parameter whose fields are the spec's, described.
    schema = flow.parameters.model_dump()
    assert list(schema["properties"]) == ["spec"]
    fields = schema["definitions"][spec_type.__name__]["properties"]
    assert set(fields) == set(spec_type.model_fields)
    assert fields["seeds"]["description"].startswith("RL seeds")


def test_deployments_fit_their_flows_and_param_flags_set_spec_fields():
    from prefect.flows import load_flow_from_entrypoint

    deps = deployments()
    for name in ("nightly-parity", "compare-variants"):
        flow = load_flow_from_entrypoint(str(ROOT / deps[name]["entrypoint"]))
        assert set(deps[name]["parameters"]) == {"spec"}
        flow.validate_parameters(deps[name]["parameters"])  # raises naming the field when the YAML drifts
        # What a Prefect server checks when the deployment is applied: its JSON schema (arms given by name).
        jsonschema.validate(deps[name]["parameters"], flow.parameters.model_dump_for_openapi())
    # The flags CI passes (infra/ci_team_mode.sh) land in the spec, over the YAML's values.
    params = flow_parameters(deps["nightly-parity"]["parameters"], ["preset=micro", "seeds=[0]", "steps=4", 'references=["recompute"]'])
    assert params["spec"]["preset"] == "micro" and params["spec"]["references"] == ["recompute"]
    assert params["spec"]["fail_on_regression"] is True  # the YAML's own value stays
    spec = NightlySpec(**params["spec"])
    assert (spec.steps, spec.references, spec.candidate) == (4, [Arm(variant="recompute")], Arm(variant="loglinear"))
    assert deps["nightly-parity"]["parameters"]["spec"]["preset"] == "tiny"  # the YAML's dict is not changed
    with pytest.raises(Exception, match="unknown OPPO mode 'sideways'"):
        load_flow_from_entrypoint(str(ROOT / deps["nightly-parity"]["entrypoint"])).validate_parameters(
            flow_parameters(deps["nightly-parity"]["parameters"], ["candidate=loglinear+oppo-sideways"]))


# A deployment's parameters, set with --param as a user would, and the line its registration prints
# instead of a run that fails when it starts (or, coerced, runs what was not asked).
DEPLOY_REFUSALS = [
    ("compare-variants", ["steps=true"], "spec.steps: Input should be a valid integer, got True"),
    ("compare-variants", ["seeds=[true,false]"], "spec.seeds.0: Input should be a valid integer, got True"),
    ("nightly-parity", ['fail_on_regression="yes"'], "spec.fail_on_regression: Input should be a valid boolean, got 'yes'"),
    ("compare-variants", ["preset=tinyy"], "unknown preset 'tinyy'"),
    ("compare-variants", ['overrides={"rl":{"stepz":3}}'], r"overrides.rl: unknown field\(s\) \['stepz'\]"),
    ("compare-variants", ['overrides={"rl":{"lr":"abc"}}'], "rl.lr: expected a float, got 'abc'"),
    ("compare-variants", ["config=/nonexistent/my.yaml"], "/nonexistent/my.yaml: cannot read the config"),
    ("compare-variants", ['variant_overrides={"loglinear":{"lrr":1}}'], r"unknown field\(s\) \['lrr'\]"),
    # what the night builds before it trains: a calibrated rule the setting has no calibration for
    ("nightly-parity", ['rule="shortfall"', 'overrides={"rl":{"lr":0.001}}'], "the recorded calibrations are for the presets as shipped"),
    # a launch the config cannot run: two ranks and no DeepSpeed config
    ("compare-variants", ['launch={"mode":"torchrun","nproc_per_node":2}'], "deepspeed"),
]


@pytest.mark.parametrize("name,flags,words", DEPLOY_REFUSALS, ids=[" ".join(f) for _, f, _ in DEPLOY_REFUSALS])
def test_a_deployment_is_checked_as_its_run_builds_and_never_coerced(name, flags, words):
    dep = deployments()[name]
    problems = parameter_problems(dep["entrypoint"], flow_parameters(dep["parameters"], flags))
    assert problems and re.search(words, problems[0], re.IGNORECASE), problems


@pytest.mark.parametrize("name", ["compare-variants", "nightly-parity"])
def test_a_deployment_as_shipped_and_with_good_flags_passes_the_check(name):
    dep = deployments()[name]
    assert parameter_problems(dep["entrypoint"], dep["parameters"]) == []
    assert parameter_problems(dep["entrypoint"], flow_parameters(dep["parameters"], ["preset=micro", "steps=2", "seeds=[0,1]"])) == []


def test_every_arm_name_round_trips_through_its_config():
    # 3 variants x 4 OPPO modes x 2 placements = 24 arms, on the PPO path (intra needs a scoring model).
    base = with_overrides(preset("micro"), **PPO_MICRO)
    names = set()
    for variant, mode, placement in itertools.product(("sync", "recompute", "loglinear"), OPPO_MODE_NAMES, PLACEMENTS):
        arm = Arm(variant=variant, oppo=mode, placement=placement)
        if variant == "sync" and mode in ("inter", "both"):
            continue  # sync has no staleness to carry groups over with (refused by the config)
        assert Arm.parse(arm.name) == Arm(variant=variant, oppo=None if mode == "off" else mode,
                                          placement=None if placement == "colocated" else placement)
        # The config runs the arm it was built from (an asynchronous one at the config's fixed bound).
        bound = {"staleness_control": "fixed", "max_staleness": 2} if variant != "sync" else {}
        assert Arm.of(arm.config(base, seed=1)) == arm.model_copy(update=bound)
        names.add(arm.name)
    assert len(names) == 20 and "loglinear+oppo-both@disaggregated" in names and "sync" in names
