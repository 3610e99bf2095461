"""Hostile answers: the grader turns any text into a score or a counted error, in bounded time.

Every task of the grader's registry gets each hostile text as the completion (against an ordinary
gold) and as the gold (against an ordinary completion), through the real grader and its real
math-verify worker. For each call:

- nothing escapes, and the last-resort guard is not what saved it (``path != "error"``): the
  inputs below are handled by the grader's own bounds, so a regression in them shows here
  instead of hiding behind the guard;
- it took exactly one counted route (fast, math_verify, no_answer, too_long), and a failure is
  counted where it belongs (timeout -> timeouts, worker error -> errors, too long -> too_long);
- its time is bounded. In-process routes: CPU time of this process, under ``IN_PROCESS_CPU_S``
  (0.5 s). The slowest such input costs about 30 ms here (the brace pass over a completion at
  the length cap); CPU time is not stretched by the other processes of a loaded 2-core machine,
  and 15x headroom covers cache and frequency effects, while a quadratic scan of a 200,000-
  character completion would take minutes. Worker route: wall time under ``WORKER_WALL_S``, the
  caller's structural bound (timeout + the verifier's grace + 2 s of scheduling), since the
  comparison itself runs in another process and a loaded machine makes it time out (counted),
  not overrun.

Run with ``-s`` to see the table: case, task, role -> route / score or error kind -> time.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from a3po import grading
from a3po.grading import GradingConfig
from a3po.grading.answers import MAX_NUMBER_CHARS, extract_answer, hash_answer, plain_number
from a3po.grading.rewards import score_completions

TIMEOUT_S = 0.3  # the hung comparisons below cost one timeout each; one that times out under load is counted too
GRACE_S = 5.0  # a3po.grading.verifier.Verifier's default grace_s
IN_PROCESS_CPU_S = 0.5
WORKER_WALL_S = TIMEOUT_S + GRACE_S + 2.0
CAP = GradingConfig().max_completion_chars
ROUTES = ("fast", "math_verify", "no_answer", "too_long")

HOSTILE = {
    "int 4301 digits": "1" * 4301,
    "int 10**5 digits": "7" * 10**5,
    "#### int 4301 digits": "#### " + "1" * 4301,
    "boxed int 700 digits": "\\boxed{" + "9" * 700 + "}",
    "answer is 10**5 digits": "so the answer is " + "5" * 10**5,
    "decimal 4301 digits": "0." + "3" * 4301,
    "0*5000 + 1": "0" * 5000 + "1",
    "1e999999": "1e999999",
    "boxed 1e999999": "\\boxed{1e999999}",
    "boxed 10^10^10^10": "\\boxed{10^{10^{10^{10}}}}",
    "frac nested 10**4": "\\boxed{" + "\\frac{1}{" * 10**4 + "2" + "}" * 10**4 + "}",
    "frac nested 60": "\\boxed{" + "\\frac{1}{" * 60 + "2" + "}" * 60 + "}",
    "braces nested 10**4": "\\boxed{" + "{" * 10**4 + "1" + "}" * 10**4 + "}",
    "parens nested 10**4": "(" * 10**4 + "1" + ")" * 10**4,
    "boxed parens 450 deep": "\\boxed{" + "(" * 450 + "1" + ")" * 450 + "}",
    "garbage 1 MB": "#{\\boxed{ x9," * (2**20 // 13),
    "braces at the cap": "\\boxed{" * 8 + "{" * (CAP - 56),
    "digits at the cap": "1 " * (CAP // 2),
    "unicode": "答案是 \\boxed{٣٤} 🙂 \u202e\u0301",
    "fullwidth digits": "#### １２３",
    "lone surrogate": "\\boxed{\ud800}",
    "NUL bytes": "\x00#### 5\x00",
    "boxed NUL": "\\boxed{\x00}",
    "empty": "",
    "whitespace only": " \n\t\r \u3000",
    "empty boxed": "\\boxed{ }",
    "unknown latex": "\\boxed{\\foo{1}\\bar[2]{x}\\begin{weird}1\\end{weird}}",
    "minus signs": "-" * 10**4 + "1",
    "comma groups": "#### " + ",".join(["123"] * 1500),
}
# What the length caps must decide, whatever else the grader would make of these.
CAPPED = {
    ("garbage 1 MB", "completion"): "completion too long",
    ("garbage 1 MB", "gold"): "gold too long",
    ("int 10**5 digits", "completion"): "answer too long",
    ("int 4301 digits", "gold"): "gold too long",
}
ORDINARY_COMPLETION = "so the answer is \\boxed{5}."
ORDINARY_GOLD = "5"


@pytest.fixture(scope="module", autouse=True)
def _grader():
    grading.set_config(GradingConfig(timeout_s=TIMEOUT_S))
    grading.warmup()  # start-up (about a second) is not part of a call's bound
    yield
    grading.set_config(GradingConfig())
    grading.shutdown()


def _graded(task: str, completion: str, gold: str):
    with grading.counting() as counted:
        cpu, wall = time.process_time(), time.perf_counter()
        r = grading.grade(task, completion, gold)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return r, counted, cpu, wall


def _kind(r, counted) -> str:
    """What the call was counted as; asserts that it was counted exactly once, in the right place."""
    assert r.path != "error", r  # the grader's bounds handled it, not the last-resort guard
    assert counted["calls"] == 1, counted
    routes = [k for k in ROUTES if counted[k]]
    assert len(routes) == 1 and counted[routes[0]] == 1, counted
    assert r.score in (0.0, 1.0), r
    if r.timed_out:
        assert counted["timeouts"] == 1 and routes == ["math_verify"], counted
        return "timeout"
    if r.worker_error:
        assert counted["errors"] == 1 and routes == ["math_verify"], counted
        return f"worker error ({(r.error or '')[:40]})"
    assert counted["errors"] == counted["timeouts"] == 0, counted
    if r.error is not None and r.error.endswith(" too long"):
        assert routes == ["too_long"], counted
        return r.error
    if r.error is not None:
        assert (r.error, routes) == ("not a plain number", ["fast"]), r  # a decision: arith answers are integers
    return f"{routes[0]} score {r.score:g}"


@pytest.mark.parametrize("task", grading.TASKS.names())
def test_hostile_answers_and_golds_are_scored_or_counted_in_bounded_time(task: str) -> None:
    rows = []
    for name, text in HOSTILE.items():
        for role, completion, gold in (("completion", text, ORDINARY_GOLD), ("gold", ORDINARY_COMPLETION, text)):
            r, counted, cpu, wall = _graded(task, completion, gold)
            kind = _kind(r, counted)
            assert kind == CAPPED.get((name, role), kind), (name, role, task, kind)
            rows.append(f"{name:24} {task:8} {role:10} -> {kind:55} cpu {cpu * 1e3:7.1f} ms  wall {wall * 1e3:7.1f} ms")
            if r.path == "math_verify":
                assert wall < WORKER_WALL_S, (name, role, wall, r)
            else:
                assert cpu < IN_PROCESS_CPU_S, (name, role, cpu, r)
    print("\n" + "\n".join(rows))


def test_the_same_hostile_text_on_both_sides_still_grades() -> None:
    # Long numbers are compared, not only refused: 700 digits (over the plain-number bound, under
    # the answer cap) go to math-verify, which finds them equal; one digit more is not equal.
    big = "9" * 700
    assert grading.grade("math500", f"\\boxed{{{big}}}", big).score == 1.0
    assert grading.grade("math500", f"\\boxed{{{big}8}}", big).score == 0.0


def test_the_guard_scores_and_counts_what_is_not_text() -> None:
    # Not text at all (a caller's row with a missing completion, a gold list): the last-resort
    # guard scores 0 and counts an error, the run goes on.
    for completion, gold in ((None, "5"), ("#### 5", ["5"]), (b"#### 5", "5")):
        with grading.counting() as counted:
            r = grading.grade("gsm8k", completion, gold)
        assert (r.score, r.path) == (0.0, "error"), r
        assert r.error.startswith("grader error: TypeError"), r.error
        assert counted["calls"] == counted["errors"] == 1 and not any(counted[k] for k in ROUTES), counted
    with pytest.raises(KeyError, match="gsm8k"):  # an unknown task is the caller's bug: it names the known ones
        grading.grade("no-such-task", "#### 5", "5")


def test_rl_rewards_go_on_past_golds_that_math_verify_cannot_read() -> None:
    # Two rows of a batch whose golds are empty or an empty box: every math-verify comparison of
    # the batch fails on the gold, which used to read as "the grader is broken" and stop the run.
    # The evaluator still reads 1/2 = 0.5, so these are bad rows: scored 0, counted, no raise.
    golds = ["", "", "\\boxed{ }", "\\boxed{ }"]
    with grading.counting() as counted:
        scores = score_completions("gsm8k", ["#### 3/4"] * 4, golds, ["a", "b", "c", "d"])
    assert scores == [0.0] * 4
    assert counted["math_verify"] == counted["errors"] == 4, counted


def test_numbers_past_the_int_digit_limit_are_not_plain_numbers() -> None:
    # int() of more than 4300 digits raises ValueError by default; plain_number must not.
    assert plain_number("1" * MAX_NUMBER_CHARS) == int("1" * MAX_NUMBER_CHARS)
    for s in ("1" * (MAX_NUMBER_CHARS + 1), "1" * 4301, "0" * 5000 + "1", "1." + "5" * 4301, "-" + "2" * 10**5):
        assert plain_number(s) is None
    assert hash_answer("#### " + "3" * 4301) == "3" * 4301  # located, not converted


PIECES = [
    "\\boxed{", "\\fbox{", "{", "}", "#### ", "The answer is ", "$", "\\$", "\\frac{", "\\(", "\\)", ",", ".", "-", "+",
    " ", "\n", "\x00", "e999999", "1" * 4301, "0" * 5000 + "1", "٣", "１", "\ud800", "∞", "\\text{", "\\unknowncmd",
]
HOSTILE_TEXT = st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=8)), max_size=24).map("".join)


@settings(max_examples=200, deadline=None)
@given(completion=HOSTILE_TEXT, gold=HOSTILE_TEXT)
def test_random_hostile_text_never_escapes_the_in_process_grader(completion: str, gold: str) -> None:
    # Every task's gold normalisation and the plain-number parse of its result, extraction, and
    # the whole grader for the tasks that never call the worker (the fixed cases above cover it).
    for task in grading.TASKS:
        plain_number(grading.TASKS.get(task).normalise_gold(gold))
    answer, _ = extract_answer(completion)
    if answer is not None:
        plain_number(answer)
    for task in (t for t in grading.TASKS if not grading.TASKS.get(t).symbolic):
        r, counted, cpu, _ = _graded(task, completion, gold)
        _kind(r, counted)
        assert cpu < IN_PROCESS_CPU_S, (cpu, r)
