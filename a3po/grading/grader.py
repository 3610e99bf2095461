"""The grader: one verifiable reward for RL and one scorer for the benchmarks.

``score(task, completion, gold) -> float`` is the RL reward (``arith``) and the benchmark
metric (``gsm8k``, ``math500``, ``aime24``); ``grade`` returns the same decision with what was
extracted and how, for per-item records. The steps:

1. the gold is normalised by the task (GSM8K: the number on its ``#### N`` line, commas allowed;
   AIME: an integer, so ``"025"`` is 25);
2. the answer is extracted from the completion (``a3po.grading.answers``: last ``\\boxed{}``, else
   ``#### N``, else "the answer is X", else the last number);
3. **fast path**: when both are plain numbers they compare exactly, in-process, in a few
   microseconds (the trainer scores hundreds of samples a second, almost all plain numbers);
4. otherwise math-verify decides, in a killable worker process (``a3po.grading.verifier``), bounded by
   ``GradingConfig.timeout_s`` from any thread or process; a timeout scores 0 and is counted.
   ``arith`` never takes this path: its answers are integers, and anything else scores 0.

Bounds on the input, so that the time of one call is bounded whatever the text: completions
(and raw golds) longer than ``max_completion_chars`` score 0 without extraction; extracted
answers (and normalised golds) longer than ``max_answer_chars`` score 0 without parsing, on the
fast path too (no benchmark answer is near that long; it keeps pathological completions from
occupying the worker). Both count as ``too_long``.

The grader never raises on its text: ``grade`` turns any completion and any gold into a score
or a counted error. Besides the bounds above, a last-resort guard catches whatever an answer
still makes fail in-process, scores it 0 with ``path="error"`` and counts it under ``errors``.
Only a task name that is not registered (a caller's bug) and ``GraderUnavailable`` with
``strict=True`` raise.

Counters (``stats()``) are per process: calls, fast-path decisions, math-verify calls, timeouts,
errors (worker errors, and in-process failures caught by the guard), answers not found, inputs
too long; ``counting()`` collects the same counters for one block of one thread (the RL trainer
logs them per step as ``grader/*``). Each call takes one route: calls = fast + math_verify +
no_answer + too_long + (errors on the ``error`` path).

A worker that cannot start (no math-verify for its interpreter, or an evaluator that fails its
self-check, e.g. under too small a ``memory_limit_mb``) scores 0 and counts as a worker error for
benchmark evaluation; with ``strict=True`` (RL rewards) it raises :class:`GraderUnavailable`.
An evaluator that runs short of memory during a comparison (a MemoryError, even one that
math-verify catches and would answer "not equal") gives a worker error, never a verdict
(``a3po.grading.verify_worker``), so a starved grader's zeros are always counted.
"""

from __future__ import annotations

import os
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Callable, Iterator, Literal

from a3po.grading.answers import extract_answer, hash_answer, plain_number
from a3po.grading.verifier import GraderUnavailable
from a3po.registry import Registry

Method = Literal["boxed", "hash", "answer_is", "last_number", "none"]
GradePath = Literal["fast", "math_verify", "skipped", "error"]


@dataclass(frozen=True)
class GradingConfig:
    """Bounds of the grader (process-wide; replace with ``set_config``)."""

    timeout_s: float = 5.0
    """Wall-clock limit of one math-verify comparison (parse both + verify), seconds, > 0."""
    max_answer_chars: int = 1000
    """Extracted answers (and normalised golds) longer than this score 0 without being parsed."""
    max_completion_chars: int = 200_000
    """Completions (and raw golds) longer than this score 0 without extraction, which bounds
    the time of a call (a 32k-token completion is about 100-130k characters)."""
    memory_limit_mb: int = 2048
    """Address-space limit of the math-verify evaluator process (0 = none). Too small a limit
    makes the worker fail its start-up self-check (:class:`GraderUnavailable`)."""
    worker_python: str = ""
    """Interpreter that runs the math-verify worker (it needs math-verify); empty = this one."""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.max_answer_chars < 1:
            raise ValueError(f"max_answer_chars must be >= 1, got {self.max_answer_chars}")
        if self.max_completion_chars < self.max_answer_chars:
            raise ValueError(f"max_completion_chars must be >= max_answer_chars ({self.max_answer_chars}), got "
                             f"{self.max_completion_chars}")
        if self.memory_limit_mb < 0:
            raise ValueError(f"memory_limit_mb must be >= 0, got {self.memory_limit_mb}")


@dataclass(frozen=True, slots=True)
class GradeResult:
    score: float  # 1.0 correct, 0.0 otherwise
    extracted: str | None  # the answer found in the completion (None: no answer)
    method: Method  # how it was found (see a3po.grading.answers)
    path: GradePath  # fast = exact plain-number compare; math_verify = worker; skipped = no comparison; error = guard
    gold: str  # the normalised gold it was compared with
    timed_out: bool = False
    error: str | None = None  # why a comparison failed (worker error, answer too long, ...)

    @property
    def worker_error(self) -> bool:
        """math-verify could not decide (worker unavailable, evaluator error), not a timeout."""
        return self.path == "math_verify" and self.error is not None and not self.timed_out

    @property
    def grader_error(self) -> bool:
        """The grader failed in-process on this input (caught by its last-resort guard)."""
        return self.path == "error"


@dataclass(frozen=True)
class TaskSpec:
    """How one task's golds read and whether non-numeric answers go to math-verify."""

    normalise_gold: Callable[[str], str]
    symbolic: bool  # False: only plain numbers can be correct (no worker round-trip ever)
    integer: bool = False  # True: answers are integers (AIME), so 25.5 never equals 25


TASKS: Registry[TaskSpec] = Registry("grading task")


def _strip(gold: str) -> str:
    return str(gold).strip()


def _gsm8k_gold(gold: str) -> str:
    """A GSM8K answer field ("...\\n#### 1,234") or a bare gold -> "1234"."""
    gold = str(gold)
    answer = (hash_answer(gold) if "####" in gold else gold.strip()) or ""
    return answer.replace(",", "") if plain_number(answer) is not None else answer


def _integer_gold(gold: str) -> str:
    """AIME golds are integers 0-999 written with leading zeros ("025") -> "25"."""
    value = plain_number(str(gold))
    return str(int(value)) if value is not None and value == int(value) else str(gold).strip()


TASKS.register("arith")(TaskSpec(normalise_gold=_gsm8k_gold, symbolic=False, integer=True))
TASKS.register("gsm8k")(TaskSpec(normalise_gold=_gsm8k_gold, symbolic=True))
TASKS.register("math500")(TaskSpec(normalise_gold=_strip, symbolic=True))
TASKS.register("aime24")(TaskSpec(normalise_gold=_integer_gold, symbolic=True, integer=True))


# ---------------------------------------------------------------- process-wide state

_config = GradingConfig()
_verifier = None  # a3po.grading.verifier.Verifier, created on the first symbolic comparison
_state_lock = threading.Lock()
_COUNTERS = ("calls", "fast", "math_verify", "timeouts", "errors", "no_answer", "too_long")
_counts = dict.fromkeys(_COUNTERS, 0)
_local = threading.local()  # .collectors: the counters of this thread's open ``counting()`` blocks


def _reset_lock_after_fork() -> None:
    # A thread of the parent may have held the lock at fork time; the child must not inherit that.
    global _state_lock
    _state_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_lock_after_fork)


def set_config(config: GradingConfig) -> None:
    """Replace the grader's bounds (a new memory limit applies from the next worker start)."""
    global _config
    _config = config


def stats() -> dict[str, int]:
    """Counters since the process started (or ``reset_stats``): calls, fast, math_verify,
    timeouts, errors, no_answer, too_long, worker_starts."""
    with _state_lock:
        out = dict(_counts)
    out["worker_starts"] = _verifier.starts if _verifier is not None else 0
    return out


def reset_stats() -> None:
    with _state_lock:
        for k in _COUNTERS:
            _counts[k] = 0


@contextmanager
def counting() -> Iterator[dict[str, int]]:
    """The counters of ``stats()`` for the grading done by this thread inside the block (other
    threads grading at the same time, e.g. a held-out evaluation, are not in it). Nests."""
    counts = dict.fromkeys(_COUNTERS, 0)
    stack = _local.__dict__.setdefault("collectors", [])
    stack.append(counts)
    try:
        yield counts
    finally:
        stack.remove(counts)


def _count(key: str) -> None:
    with _state_lock:
        _counts[key] += 1
    for counts in getattr(_local, "collectors", ()):
        counts[key] += 1


def _get_verifier():
    global _verifier
    if _verifier is None:
        with _state_lock:
            if _verifier is None:
                from a3po.grading.verifier import Verifier

                _verifier = Verifier(memory_limit_mb=_config.memory_limit_mb, python=_config.worker_python)
    elif (_verifier.memory_limit_mb, _verifier.python) != (_config.memory_limit_mb,
                                                           _config.worker_python or sys.executable):
        _verifier.memory_limit_mb = _config.memory_limit_mb
        _verifier.python = _config.worker_python or sys.executable
        _verifier.close()  # restarts with the new settings on next use
    return _verifier


def warmup() -> None:
    """Start the math-verify worker now rather than on the first symbolic comparison (~1 s).
    Raises :class:`GraderUnavailable` (naming the reason) when it cannot start."""
    _get_verifier().start()


def evaluator_works(timeout_s: float | None = None) -> bool:
    """Whether math-verify still finds 1/2 equal to 0.5 (the worker's start-up self-check), not
    counted in ``stats()``: tells a batch of unreadable golds from an evaluator that reads nothing."""
    try:
        out = _get_verifier().check("\\frac{1}{2}", "0.5", timeout_s if timeout_s is not None else _config.timeout_s)
    except GraderUnavailable:
        return False
    return out.equal and out.error is None


def worker_pid() -> int | None:
    """Process id of the running math-verify supervisor, else None (for diagnostics and tests:
    its evaluator children are forks of it, so its size is theirs when they start)."""
    return _verifier.pid if _verifier is not None else None


def needs_worker(task: str) -> bool:
    """Whether ``task``'s answers can need math-verify (a non-numeric answer or gold)."""
    return TASKS.get(task).symbolic


def shutdown() -> None:
    """Stop the worker (it is also stopped at exit); the next symbolic comparison restarts it."""
    if _verifier is not None:
        _verifier.close()


# ---------------------------------------------------------------- grading


@lru_cache(maxsize=65536)
def _gold(task: str, gold: str) -> tuple[TaskSpec, str, int | Fraction | None]:
    """(spec, normalised gold, its plain-number value): golds repeat across samples and epochs."""
    spec = TASKS.get(task)
    gold_n = spec.normalise_gold(gold)
    return spec, gold_n, plain_number(gold_n)


def grade(task: str, completion: str, gold: str, *, timeout_s: float | None = None,
          strict: bool = False) -> GradeResult:
    """Grade one completion against one gold answer (see the module docstring for the steps).
    ``strict``: raise :class:`GraderUnavailable` when the math-verify worker cannot start,
    instead of scoring 0 (RL rewards must not train on a broken grader's zeros). Whatever the
    completion and the gold hold, returns a result (an unknown ``task`` raises KeyError)."""
    TASKS.get(task)  # a caller's bug, not an answer: raises naming the registered tasks
    _count("calls")
    try:
        return _grade(task, completion, gold, timeout_s, strict)
    except GraderUnavailable:  # only with strict=True: _grade scores it 0 otherwise
        raise
    except Exception as e:  # noqa: BLE001 - last resort: a failure on one answer must not stop a run
        _count("errors")
        return GradeResult(0.0, None, "none", "error", _clip(gold),
                           error=f"grader error: {type(e).__name__}: {_clip(e)}")


def _clip(x: object, n: int = 200) -> str:
    """``str(x)[:n]`` for an error message, whatever ``x`` is."""
    try:
        return str(x)[:n]
    except Exception:  # noqa: BLE001 - a __str__ that raises, or an int too long to print
        return f"<unprintable {type(x).__name__}>"


def _grade(task: str, completion: str, gold: str, timeout_s: float | None, strict: bool) -> GradeResult:
    limit = _config.max_completion_chars
    if len(completion) > limit or len(str(gold)) > limit:  # before the cached _gold: no huge cache keys
        _count("too_long")
        which = "completion" if len(completion) > limit else "gold"
        return GradeResult(0.0, None, "none", "skipped", _clip(gold), error=f"{which} too long")
    spec, gold_n, gold_v = _gold(task, gold)
    answer, method = extract_answer(completion)
    if answer is None:
        _count("no_answer")
        return GradeResult(0.0, None, method, "skipped", gold_n)
    if len(answer) > _config.max_answer_chars or len(gold_n) > _config.max_answer_chars:
        _count("too_long")
        which = "answer" if len(answer) > _config.max_answer_chars else "gold"
        return GradeResult(0.0, answer[:200], method, "skipped", gold_n[:200], error=f"{which} too long")

    pred_v = plain_number(answer)
    if pred_v is not None and gold_v is not None:
        _count("fast")
        if spec.integer and pred_v != int(pred_v):
            return GradeResult(0.0, answer, method, "fast", gold_n)
        return GradeResult(float(pred_v == gold_v), answer, method, "fast", gold_n)
    if not spec.symbolic:
        _count("fast")
        return GradeResult(0.0, answer, method, "fast", gold_n, error="not a plain number")

    _count("math_verify")
    try:
        out = _get_verifier().check(gold_n, answer, timeout_s if timeout_s is not None else _config.timeout_s)
    except GraderUnavailable as e:  # counted either way; benchmark evaluation scores 0 and reports it
        _count("errors")
        if strict:
            raise
        return GradeResult(0.0, answer, method, "math_verify", gold_n, error=f"worker unavailable: {e}")
    if out.timed_out:
        _count("timeouts")
    elif out.error:
        _count("errors")
    return GradeResult(float(out.equal), answer, method, "math_verify", gold_n, out.timed_out, out.error)


def score(task: str, completion: str, gold: str, *, timeout_s: float | None = None) -> float:
    """1.0 when the completion's final answer equals ``gold`` for ``task``, else 0.0.

    ``task`` is one of ``arith``, ``gsm8k``, ``math500``, ``aime24``. Never raises on bad
    completions; a comparison that exceeds the timeout scores 0 (see ``stats()``)."""
    return grade(task, completion, gold, timeout_s=timeout_s).score
