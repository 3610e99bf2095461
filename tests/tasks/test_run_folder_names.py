"""A run folder's name hashes the config that determines the run; fields added later, left at their
defaults, leave it unchanged, so a comparison started before them resumes into its folders."""

from __future__ import annotations

from a3po.config import preset, with_overrides
from tasks.child_run import config_hash


def test_fields_added_later_at_their_defaults_keep_the_names_of_earlier_run_folders():
    # Hashes written by the version before rl.filter_groups existed (the folders of runs made then).
    assert config_hash(preset("micro")) == "a8661663"
    assert config_hash(preset("tiny")) == "7e66f128"


def test_a_field_that_changes_the_run_changes_the_name():
    base = config_hash(preset("micro"))
    assert config_hash(with_overrides(preset("micro"), rl={"filter_groups": True})) != base
    assert config_hash(with_overrides(preset("micro"), rl={"filter_groups": True, "filter_max_prompts": 8})) not in (
        base, config_hash(with_overrides(preset("micro"), rl={"filter_groups": True})))
