"""``rl.filter_groups``: refused when the config is built where a group with equal rewards is not one
without signal, or where the filter cannot refill; its cap and patience checked; the defaults."""

from __future__ import annotations

import pytest

from a3po.config import ConfigError, config_from_dict, filter_settings

ON = {"filter_groups": True}


@pytest.mark.parametrize("cfg, match", [
    ({"rl": {**ON, "filter_max_prompts": 0}}, r"rl.filter_max_prompts must be >= rl.batch_prompts 16 .*got 0"),
    ({"rl": {**ON, "filter_max_prompts": -3}}, r"rl.filter_max_prompts must be >= rl.batch_prompts 16 .*got -3"),
    ({"rl": {**ON, "filter_max_prompts": 15}}, r"rl.filter_max_prompts must be >= rl.batch_prompts 16"),
    ({"rl": {**ON, "filter_patience": 0}}, r"rl.filter_patience must be >= 1, got 0"),
    ({"rl": {"filter_max_prompts": 64}}, r"rl.filter_max_prompts set but rl.filter_groups is false"),
    ({"rl": {**ON, "advantage": "gae"}, "ppo": {"critic": "policy_copy"}},
     r"rl.filter_groups with rl.advantage 'gae': .*only under a group-relative estimator"),
    ({"rl": ON, "ppo": {"kl_coef": 0.05}}, r"rl.filter_groups with ppo.kl_coef > 0 or ppo.reward 'model'"),
    ({"rl": ON, "oppo": {"inter": True}}, r"rl.filter_groups with oppo.inter or oppo.intra is not supported"),
])
def test_refused_naming_the_field(cfg, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict(cfg)


def test_the_cap_defaults_to_four_batches_of_prompts_and_the_patience_to_five():
    cfg = config_from_dict({"rl": {**ON, "batch_prompts": 6}})
    assert filter_settings(cfg.rl) == (24, 5)
    cfg = config_from_dict({"rl": {**ON, "batch_prompts": 6, "filter_max_prompts": 6, "filter_patience": 1}})
    assert filter_settings(cfg.rl) == (6, 1)  # a cap of one batch: filter and fill up, never refill


@pytest.mark.parametrize("variant", ["sync", "recompute", "loglinear"])
def test_every_variant_runs_with_it(variant):
    assert config_from_dict({"rl": {**ON, "variant": variant}}).rl.filter_groups
