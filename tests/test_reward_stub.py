"""The grader stand-in (conftest ``core_stub_rewards``, :mod:`tests.support.rewards`) replaces
``score_completions`` where the training loop looks it up, for the requesting test only: a test
after it grades for real, whatever the order the tests run in."""

from __future__ import annotations

import a3po.grading.rewards
import a3po.training.heldout
import a3po.training.loop
from tests.support.rewards import digit_reward


def _graders() -> set:
    return {a3po.grading.rewards.score_completions, a3po.training.loop.score_completions, a3po.training.heldout.score_completions}


def test_the_stand_in_replaces_the_grader_where_the_loop_looks_it_up(core_stub_rewards):
    assert _graders() == {digit_reward}
    # 3 digits of 6 characters; none of 4.
    assert core_stub_rewards("arithmetic", ["12 + 3", "four"], ["15", "4"]) == [0.5, 0.0]


def test_a_test_that_does_not_request_it_grades_for_real():
    assert digit_reward not in _graders()
    assert {f.__module__ for f in _graders()} == {"a3po.grading.rewards"}
