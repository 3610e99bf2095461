"""``--variants`` takes arms of the staleness axis (tasks.arms): the comparison flow's spec reads
``loglinear+s1,...,loglinear+adaptive`` from its command line or a deployment's JSON, checks the
configs before anything runs, and a name that is no arm fails naming the option."""

from __future__ import annotations

import jsonschema
import pytest
from pydantic import ValidationError

from flows.cli import comparison_kwargs, option_error
from flows.compare_variants import CompareSpec, build_parser, check_arms, compare_variants
from tasks.arms import Arm

VARIANTS = "loglinear+s1,loglinear+s2,loglinear+s4,loglinear+s8,loglinear+adaptive"


def _spec(argv: list[str]) -> CompareSpec:
    args = build_parser().parse_args(["--preset", "micro", *argv])
    return CompareSpec(**comparison_kwargs(args), variants=args.variants.split(","))


def test_variants_take_staleness_arms_from_the_command_line():
    spec = _spec(["--variants", VARIANTS])
    assert spec.variants[0] == Arm(variant="loglinear", max_staleness=1) and spec.variants[-1].adaptive
    arms = check_arms(spec, spec.train_config())
    assert [a.name for a in arms] == ["loglinear+s1", "loglinear", "loglinear+s4", "loglinear+s8", "loglinear+adaptive"]
    assert [(a.max_staleness, a.staleness_control) for a in arms] == [(1, "fixed"), (2, "fixed"), (4, "fixed"), (8, "fixed"),
                                                                      (2, "adaptive")]
    # A base bound of 8: the bare variant runs it, an arm's own bound stays its own.
    spec8 = _spec(["--variants", "loglinear,loglinear+s2,loglinear+adaptive", "--max-staleness", "8"])
    assert [a.name for a in check_arms(spec8, spec8.train_config())] == ["loglinear+s8", "loglinear", "loglinear+adaptive-s8"]


def test_a_name_that_is_no_arm_fails_naming_the_option():
    with pytest.raises(ValidationError) as e:
        _spec(["--variants", "loglinear+s4,sync+adaptive"])
    assert option_error(e.value.errors()[0]).startswith("--variants: arm 'sync' with a staleness bound")


def test_a_deployment_names_staleness_arms_in_its_json():
    params = {"spec": {"preset": "micro", "variants": ["loglinear+s4", "loglinear+adaptive"]}}
    jsonschema.validate(params, compare_variants.parameters.model_dump_for_openapi())  # what a Prefect server checks
    assert compare_variants.validate_parameters(params)["spec"].variants == [Arm.parse("loglinear+s4"),
                                                                             Arm.parse("loglinear+adaptive")]
