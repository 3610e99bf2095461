"""The grader: task semantics, the fast path, and timeouts that hold off the main thread.

Timing: a hung comparison must run until ``timeout_s`` (a lower bound, which load cannot break)
and then return flagged ``timed_out``. Its upper bound only separates "returned" from "hung" (the
comparison itself would run for hours), so it is loose enough for a loaded machine; a comparison
that must be quick is checked by the grader's own clock: it did not time out. Per-call costs are
figures of ``python -m bench.grading``, not assertions.
"""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest

from a3po import grading
from a3po.grading import GradeResult, GradingConfig, grade, score

HANG = "so the answer is \\boxed{10^{10^{10^{10}}}}."  # sympy tries to build a 10-billion-digit integer
TIMEOUT_S = 1.0
HANG_GUARD_S = 30.0  # returned at all (vs. hours for the hung comparison), whatever the load


@pytest.fixture(scope="module", autouse=True)
def _warm_worker():
    grading.warmup()  # start-up (about a second) is not part of a call's bound
    yield


@pytest.mark.parametrize(
    "task, completion, gold, expected",
    [
        ("arith", "23 + 45 = 68\n#### 68", "68", 1.0),
        ("arith", "23 + 45 = 69\n#### 69", "68", 0.0),
        ("arith", "23 + 45 = 68", "68", 1.0),  # fallback: last number
        ("arith", "Mia Mia ? ?", "68", 0.0),  # no answer
        ("arith", "\\boxed{\\frac{136}{2}}", "68", 0.0),  # arith is integers only, never math-verify
        ("gsm8k", "He pays 5 * 4 = 20\n#### 1,234", "1234", 1.0),
        ("gsm8k", "#### 1234", "Step one.\n#### 1,234", 1.0),  # gold given as the raw GSM8K answer field
        ("gsm8k", "#### 18.00", "18", 1.0),
        ("gsm8k", "so the answer is \\boxed{\\$18}.", "18", 1.0),
        ("gsm8k", "#### 19", "18", 0.0),
        ("aime24", "so the answer is \\boxed{25}.", "025", 1.0),
        ("aime24", "so the answer is \\boxed{025}.", "025", 1.0),
        ("aime24", "so the answer is \\boxed{25.5}.", "025", 0.0),
        ("aime24", "so the answer is \\boxed{\\frac{50}{2}}.", "025", 1.0),  # math-verify path
        ("math500", "so the answer is \\boxed{\\dfrac{28}{6}}.", "\\frac{14}{3}", 1.0),
        ("math500", "so the answer is \\boxed{(3, \\pi/2)}.", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
        ("math500", "so the answer is \\boxed{90}.", "90^\\circ", 1.0),
        ("math500", "so the answer is \\boxed{\\text{Evelyn}}.", "\\text{Evelyn}", 1.0),
        ("math500", "so the answer is \\boxed{\\text{Navin}}.", "\\text{Evelyn}", 0.0),
        ("math500", "so the answer is \\boxed{0.5}.", "\\frac{1}{2}", 1.0),
        ("math500", "so the answer is \\boxed{\\frac{15}{3}}.", "\\frac{14}{3}", 0.0),
    ],
)
def test_task_semantics(task: str, completion: str, gold: str, expected: float) -> None:
    assert score(task, completion, gold) == expected


def test_grade_result_records_what_was_compared() -> None:
    r = grade("math500", "so the answer is \\boxed{\\frac{28}{6}}.", "\\frac{14}{3}")
    assert r == GradeResult(1.0, "\\frac{28}{6}", "boxed", "math_verify", "\\frac{14}{3}")
    r = grade("gsm8k", "#### 7", "Step.\n#### 1,007")
    assert (r.score, r.extracted, r.method, r.path, r.gold) == (0.0, "7", "hash", "fast", "1007")


def test_unknown_task_lists_valid_ones() -> None:
    with pytest.raises(KeyError, match="aime24, arith, gsm8k, math500"):
        score("mmlu", "#### 1", "1")


def test_arith_fast_path_never_uses_the_worker() -> None:
    # The cost per call (~5-10 us on 2 shared cores) is a bench figure (python -m bench.grading).
    before = grading.stats()
    completions = [f"{a} + {b} = {a + b}\n#### {a + b}" for a in range(50) for b in range(40)]  # 2000
    scores = [score("arith", c, c.rsplit(" ", 1)[1]) for _ in range(10) for c in completions]
    after = grading.stats()
    assert scores == [1.0] * (10 * len(completions))
    assert after["math_verify"] == before["math_verify"]
    assert after["fast"] - before["fast"] == 10 * len(completions)


def _timed(fn, *args, **kw):
    t = time.perf_counter()
    out = fn(*args, **kw)
    return out, time.perf_counter() - t


def test_hanging_comparison_times_out_is_counted_and_the_next_call_works() -> None:
    before = grading.stats()["timeouts"]
    r, dt = _timed(grade, "math500", HANG, "5", timeout_s=TIMEOUT_S)
    assert r.timed_out and r.score == 0.0 and r.path == "math_verify"
    assert TIMEOUT_S * 0.9 <= dt < HANG_GUARD_S, dt
    assert grading.stats()["timeouts"] == before + 1
    # the evaluator was replaced: the next symbolic comparison is correct and within the timeout
    r = grade("math500", "\\boxed{\\frac{28}{6}}", "\\frac{14}{3}", timeout_s=TIMEOUT_S)
    assert r.score == 1.0 and not r.timed_out and r.path == "math_verify"


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("x" * 100_000 + " so the answer is \\boxed{5}", 1.0),  # 100k characters, then the right answer
        ("\\boxed{" + "\\frac{1}{" * 11_000 + "2" + "}" * 11_000 + "}", 0.0),  # deeply nested LaTeX, 100k+ characters
        ("\\boxed{" + "\\frac{1}{" * 90 + "2" + "}" * 90 + "}", 0.0),  # parseable nesting: 1/(1/(...2)) = 2, not 5
        ("\\boxed{" + "{[(" * 30_000, 0.0),  # unclosed \boxed{ with 90k unbalanced brackets
        ("so the answer is \\boxed{" + "1+" * 50_000, 0.0),  # unclosed, long arithmetic
        ("$" + "\\sqrt{" * 300 + "2" + "}" * 300 + "$ the answer is " + "\\sqrt{" * 150 + "2" + "}" * 150, 0.0),  # nested roots of 2, below 2
    ],
)
def test_hostile_completions_return_within_the_timeout(completion: str, expected: float) -> None:
    r, dt = _timed(grade, "math500", completion, "5", timeout_s=TIMEOUT_S)
    assert dt < HANG_GUARD_S, (dt, r)
    assert r.score == expected, r


def test_timeout_holds_in_threads() -> None:
    results: dict[int, tuple[GradeResult, float]] = {}

    def work(i: int) -> None:
        completion = HANG if i == 0 else "so the answer is \\boxed{\\frac{28}{6}}."
        results[i] = _timed(grade, "math500", completion, "5" if i == 0 else "\\frac{14}{3}", timeout_s=TIMEOUT_S)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=HANG_GUARD_S)
    assert not any(th.is_alive() for th in threads)
    assert results[0][0].timed_out and TIMEOUT_S * 0.9 <= results[0][1]
    # threads share one worker: the hang costs one timeout and the others still finish within theirs
    assert all(results[i][0].score == 1.0 and not results[i][0].timed_out for i in (1, 2, 3))


def test_timeout_holds_in_a_daemonic_worker_process() -> None:
    # Pool workers are daemonic (they may not start multiprocessing children): the grader's
    # worker is a subprocess, so it still works there.
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        warm = pool.apply(grading.grade, ("math500", "\\boxed{\\frac{28}{6}}", "\\frac{14}{3}"))
        t = time.perf_counter()
        hung = pool.apply(grading.grade, ("math500", HANG, "5"), {"timeout_s": TIMEOUT_S})
        dt = time.perf_counter() - t
    assert warm.score == 1.0
    assert hung.timed_out and TIMEOUT_S * 0.9 <= dt < HANG_GUARD_S, dt


def test_answers_longer_than_the_cap_are_not_parsed() -> None:
    before = grading.stats()["too_long"]
    r = grade("math500", "\\boxed{" + "x+" * 600 + "x}", "5")
    assert (r.score, r.path, r.error) == (0.0, "skipped", "answer too long")
    assert grading.stats()["too_long"] == before + 1


def test_config_is_validated() -> None:
    with pytest.raises(ValueError):
        GradingConfig(timeout_s=0)
    with pytest.raises(ValueError):
        GradingConfig(max_answer_chars=0)


def test_importing_the_grader_stays_light() -> None:
    # The trainer imports a3po.grading for its reward: no torch, sympy, math-verify or lm-eval in-process.
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys, a3po.grading; heavy = ('torch', 'sympy', 'math_verify', 'lm_eval', 'datasets', 'transformers');"
        "a3po.grading.score('arith', '#### 3', '3'); print([m for m in heavy if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
