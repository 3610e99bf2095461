"""A broken grader fails an RL run loudly, and the grader's counters are logged per step.

Real failures, no mocks: a worker interpreter that does not exist (the worker cannot start), and
an evaluator memory limit so small that math-verify cannot work (it fails its self-check, or
every comparison). Fraction golds (``3/4``) are not plain numbers, so the fast path cannot decide
them and every extracted answer goes to math-verify (see ``a3po.grading``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from a3po import grading
from a3po.config import preset, with_overrides
from a3po.data.arithmetic import WORDS
from a3po.data.datasets import load_rows
from a3po.grading import GraderUnavailable, GradingConfig
from a3po.grading.rewards import score_completions
from a3po.models.factory import build_tiny_model
from a3po.training.loop import rl_train
from a3po.training.metrics import JsonlLogger

REPO = Path(__file__).resolve().parents[2]
FRACTIONS = ["3/4", "1/2", "2/3", "5/4"]


@pytest.fixture(autouse=True)
def _default_grader_afterwards():
    yield
    grading.set_config(GradingConfig())
    grading.shutdown()  # the next symbolic comparison starts a worker with the default settings


def _fraction_rows(path: Path, n: int) -> Path:
    """GSM8K-format rows whose golds are fractions; solutions for the warm start."""
    with path.open("w") as f:
        for i in range(n):
            gold = FRACTIONS[i % len(FRACTIONS)]
            f.write(json.dumps({"id": f"q{i}", "prompt": f"Question: Mia has {i} apples.\nAnswer: ", "gold": gold,
                                "solution": f"Mia has {gold}\n#### {gold}"}) + "\n")
    return path


def _gsm8k_micro(tmp_path: Path, steps: int = 2):
    return with_overrides(
        preset("micro"),
        data={"task": "gsm8k", "train_path": str(_fraction_rows(tmp_path / "train.jsonl", 16)),
              "heldout_path": str(_fraction_rows(tmp_path / "heldout.jsonl", 4))},
        rl={"steps": steps},
    )


def test_rl_run_whose_worker_cannot_start_exits_non_zero_naming_the_reason(tmp_path):
    # The real command (`a3po train`: warm start, held-out scoring, RL) in a fresh process, with
    # the worker's interpreter pointing at a file that does not exist.
    cfg = _gsm8k_micro(tmp_path)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump({"data": {k: getattr(cfg.data, k) for k in ("task", "train_path", "heldout_path")}}))
    missing = tmp_path / "no-such-python"
    driver = (
        "import sys; from a3po import grading; "
        f"grading.set_config(grading.GradingConfig(worker_python={str(missing)!r})); "
        "from a3po.training.command import main; "
        f"sys.exit(main(['--preset', 'micro', '--config', {str(tmp_path / 'cfg.yaml')!r}, '--steps', '2', "
        f"'--no-progress', '--output-dir', {str(tmp_path / 'out')!r}]))"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-c", driver], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "GraderUnavailable" in proc.stderr, proc.stderr[-3000:]
    assert f"math-verify worker could not be run with {missing}" in proc.stderr
    assert "No such file or directory" in proc.stderr
    assert not list((tmp_path / "out").glob("*/metrics.jsonl"))  # no step was trained on zeros


def test_rl_train_checks_the_grader_before_the_first_step(tmp_path):
    # In-process: rl_train raises before producing a batch, with the reason, and logs nothing.
    cfg = _gsm8k_micro(tmp_path)
    model, tok = build_tiny_model("micro", WORDS, seed=0)
    train, held, _ = load_rows(cfg.data, tok)
    grading.set_config(GradingConfig(worker_python=str(tmp_path / "no-such-python")))
    log = tmp_path / "metrics.jsonl"
    with pytest.raises(GraderUnavailable, match="could not be run with .*no-such-python"):
        rl_train(cfg, model, tok, train, held, warmstart_acc=0.0, logger=JsonlLogger(log))
    assert not log.exists()


def test_evaluator_that_cannot_work_under_its_memory_limit_raises_for_rewards():
    # 1 MB of address space: depending on the allocator's state the evaluator fails the worker's
    # start-up self-check, or fails every comparison, or gets through some of them under the
    # limit (math-verify then catches the MemoryError of the others and would answer "not
    # equal"). Rewards raise in the first two cases; in the third the limit must still have cost
    # a score (on this host 3/4 and 5/4 always fail, 1/2 passes), and every wrong score must be a
    # counted worker error (grader/worker_errors in the step's metrics): never a silent zero.
    # With the limit not applied all four scores are right and nothing is counted, which fails.
    grading.set_config(GradingConfig(memory_limit_mb=1))
    answers = [f"#### {f}" for f in FRACTIONS]
    errors_before = grading.stats()["errors"]
    try:
        scores = score_completions("gsm8k", answers, ["0.75", "0.5", "0.666", "1.25"], ["a", "b", "c", "d"])
    except GraderUnavailable as e:
        assert re.search("failed its self-check|every math-verify comparison of the batch failed", str(e)), str(e)
    else:
        wrong = sum(a != b for a, b in zip(scores, [1.0, 1.0, 0.0, 1.0], strict=True))
        assert wrong >= 1, f"a 1 MB evaluator graded every answer right: was the limit applied? {scores}"
        assert grading.stats()["errors"] - errors_before >= wrong, (scores, grading.stats())
    # The same settings with no memory limit grade normally (3/4 = 0.75, 1/2 = 0.5, 5/4 = 1.25;
    # 2/3 is not 0.666): the failure above is the limit's, not the inputs'.
    grading.set_config(GradingConfig(memory_limit_mb=0))
    assert score_completions("gsm8k", answers, ["0.75", "0.5", "0.666", "1.25"]) == [1.0, 1.0, 0.0, 1.0]


def _vm_size_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmSize in /proc/{pid}/status")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads process sizes from /proc")
def test_memory_error_that_math_verify_catches_is_a_counted_error_not_a_zero():
    # Deterministic starvation: an address-space limit 16 MB above the evaluator's own size
    # (its size at fork is its supervisor's) leaves room for ordinary answers, not for
    # 2^(2^28), a 32 MB integer that sympy builds when it evaluates the answer. math-verify
    # catches that MemoryError and answers "not equal"; the grader must report it instead.
    grading.set_config(GradingConfig(memory_limit_mb=0))
    grading.warmup()
    limit_mb = int(_vm_size_mb(grading.worker_pid())) + 16
    grading.set_config(GradingConfig(memory_limit_mb=limit_mb))
    assert grading.grade("math500", "\\boxed{\\frac{1}{2}}", "0.5").score == 1.0  # passes the self-check, grades
    before = grading.stats()
    r = grading.grade("math500", "\\boxed{2^{2^{28}}}", "5")
    after = grading.stats()
    assert (r.score, r.path, r.timed_out, r.worker_error) == (0.0, "math_verify", False, True), r
    assert "short of memory" in r.error, r.error
    assert (after["errors"] - before["errors"], after["timeouts"] - before["timeouts"]) == (1, 0)
    # Afterwards the same limit still grades ordinary answers, with the same supervisor.
    assert grading.grade("math500", "\\boxed{\\frac{3}{4}}", "0.75").score == 1.0
    assert grading.grade("math500", "\\boxed{\\frac{2}{3}}", "0.666").score == 0.0
    assert grading.stats()["errors"] == after["errors"]
    assert grading.stats()["worker_starts"] == after["worker_starts"]  # same supervisor, a new child


# Both ways of the evaluator's memory watch, each in a forked evaluator under the limit of the
# test above (its own size + 16 MB): a failed allocation raises a BaseException that math-verify
# cannot catch (the default), or a trace function sees the MemoryError that it does catch (where
# the interpreter's MemoryError cannot be replaced). Without a watch, the same call says "not equal".
_WATCH_SCRIPT = r"""
import json, os, resource, sys
from a3po.grading import verify_worker as vw

vw.equivalent("1", "1")  # warm, as the supervisor is before it forks

def vm_size():
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024

def in_starved_child(mode, gold, pred):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        watch = None if mode == "none" else vw._MemoryWatch(uncatchable=mode == "uncatchable" and vw._uncatchable_memory_errors())
        limit = vm_size() + 16 * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        try:
            out = watch.run(vw.equivalent, gold, pred) if watch else vw.equivalent(gold, pred)
        except BaseException as e:
            out = type(e).__name__
        os.write(w, json.dumps([out, watch.traced if watch else None]).encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    return json.loads(os.read(r, 1000))

print(json.dumps({mode: [in_starved_child(mode, "5", "2^{2^{28}}"), in_starved_child(mode, "\\frac{1}{2}", "0.5")]
                  for mode in ("none", "traced", "uncatchable")}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads process sizes from /proc")
def test_both_memory_watches_turn_a_caught_memory_error_into_starved():
    proc = subprocess.run([sys.executable, "-c", _WATCH_SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    # [result of 2^(2^28) vs 5, whether traced], [result of 0.5 vs 1/2, whether traced]
    assert got["none"] == [[False, None], [True, None]]  # the silent zero the watches exist for
    assert got["traced"] == [["Starved", True], [True, True]]
    assert got["uncatchable"] == [["Starved", False], [True, False]]  # CPython: the free way is used


def test_benchmark_grading_scores_zero_but_counts_the_unavailable_worker(tmp_path):
    grading.set_config(GradingConfig(worker_python=str(tmp_path / "no-such-python")))
    before = grading.stats()["errors"]
    r = grading.grade("gsm8k", "#### 3/4", "0.75")  # not strict: a benchmark run keeps going
    assert (r.score, r.path, r.worker_error) == (0.0, "math_verify", True)
    assert "worker unavailable" in r.error and "no-such-python" in r.error
    assert grading.stats()["errors"] == before + 1


def test_micro_run_logs_the_grader_counters_per_step(tmp_path):
    # A normal run with the real grader and worker: every step carries grader/* for its batch of
    # batch_prompts * group_size = 4 * 2 = 8 completions, each decided by exactly one route.
    cfg = _gsm8k_micro(tmp_path, steps=2)
    model, tok = build_tiny_model("micro", WORDS, seed=0)
    train, held, _ = load_rows(cfg.data, tok)
    res = rl_train(cfg, model, tok, train, held, warmstart_acc=0.0, logger=JsonlLogger(tmp_path / "metrics.jsonl"))
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == [1, 2]
    for h, m in zip(res.history, logged, strict=True):
        counts = {k: m[f"grader/{k}"] for k in
                  ("calls", "fast", "math_verify", "timeouts", "worker_errors", "no_answer", "too_long")}
        assert counts == {k: h[f"grader/{k}"] for k in counts}
        assert counts["calls"] == 8
        assert counts["fast"] + counts["math_verify"] + counts["no_answer"] + counts["too_long"] == 8
        assert counts["fast"] == 0  # fraction golds: the plain-number compare never decides
        assert counts["worker_errors"] == counts["timeouts"] == 0
    # The random micro policy writes a number in some completions (1 of 8, then 4 of 8 with seed 0),
    # so the math-verify route was counted, not only the "no answer" one.
    assert sum(h["grader/math_verify"] for h in res.history) > 0
