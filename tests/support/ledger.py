"""OPPO's carry-over ledger, as the tests of the over-commitment check it: every prompt group a
producer admitted is trained exactly once or is still in flight, none lost."""

from __future__ import annotations


def assert_every_group_trained_once(trained_groups: list[int], final_state: dict, groups_per_step: int, steps: int) -> None:
    """``trained_groups``: the group of each trained group, in training order; ``final_state``: the
    producer state delivered with the last trained batch (what a checkpoint then holds). Groups
    ``0 .. next_group - 1`` were admitted (one producer: consecutive numbers)."""
    admitted = set(range(final_state["next_group"]))
    in_flight = {g[0]["group"] for g in final_state["buffer"]["groups"]}
    assert len(trained_groups) == len(set(trained_groups)) == groups_per_step * steps  # none twice, B per step
    assert set(trained_groups) | in_flight == admitted and not set(trained_groups) & in_flight  # none lost
