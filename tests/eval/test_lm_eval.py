"""The project's grader against lm-eval's own gsm8k strict-match, on identical completions.

lm-eval's side is its installed task: the ``strict-match`` filter ensemble built from the task
YAML (regex ``#### (\\-?[0-9\\.\\,]+)`` then take_first) and the task's ``process_results`` with
its exact_match settings (ignore_case, regexes_to_ignore ``,`` ``\\$`` ``(?s).*#### `` ``\\.$``),
all loaded through lm-eval's TaskManager, nothing re-typed here. The completions are what a
model trained on GSM8K writes: the reference solutions (all correct), the same solutions with
the final number changed (all wrong), and formatting variants both accept. Where the project is
deliberately more lenient (a ``\\boxed{}`` answer, "the answer is", ``#### $18``, ``#### 18.00``,
no final line), the difference is pinned below rather than hidden.
"""

from __future__ import annotations

from pathlib import Path

import lm_eval  # noqa: F401  (a hard dependency: a broken install fails here, it is not skipped)
import pytest

from a3po.grading import score
from eval import lm_eval_bridge
from eval.data import fixture_path
from eval.synthetic import wrong_answer


def variants(solution: str) -> list[tuple[str, float]]:
    """(completion, expected score) variants of one GSM8K reference solution ending '#### N'."""
    head, _, tail = solution.rpartition("####")
    gold = tail.strip()
    number = int(gold.replace(",", ""))
    return [
        (solution, 1.0),  # the reference itself
        (f"{head}#### {wrong_answer(gold)}", 0.0),  # the same reasoning, a wrong final number
        (f"{head}#### {number}.", 1.0),  # trailing period
        (f"{head}#### {number:,}", 1.0),  # thousands commas
        (f"{head}#### {number}\n\nQuestion: another problem\nAnswer: 3 + 4 = 7\n#### 7", 1.0),  # runs on: first #### counts
        (f"{head}#### {-number - 1}", 0.0),  # a negative number
    ]


def agreement(task, docs: list[dict]) -> tuple[int, list]:
    """(completions compared, mismatches) between lm-eval strict-match, a3po.grading and the expectation."""
    n, mismatches = 0, []
    for j in range(len(variants(docs[0]["answer"]))):
        texts = [variants(d["answer"])[j][0] for d in docs]
        expected = [variants(d["answer"])[j][1] for d in docs]
        lm = lm_eval_bridge.lm_eval_item_scores(task, texts, "strict-match", docs=docs)
        ours = [score("gsm8k", t, d["answer"]) for t, d in zip(texts, docs, strict=True)]
        n += len(texts)
        mismatches += [(j, t[-50:], e, a, b) for t, e, a, b in zip(texts, expected, lm, ours, strict=True) if not e == a == b]
    return n, mismatches


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lm_eval")


@pytest.fixture(scope="module")
def fixture_task(workdir: Path):
    return lm_eval_bridge.build_task("gsm8k", fixture_path("gsm8k"), workdir)


def test_strict_match_agrees_on_the_fixture(fixture_task) -> None:
    n, mismatches = agreement(fixture_task, list(fixture_task.eval_docs))
    assert n == 5 * 6 and mismatches == []


@pytest.mark.data
def test_strict_match_agrees_on_the_real_gsm8k_test(shared_data: Path, workdir: Path) -> None:
    task = lm_eval_bridge.build_task("gsm8k", shared_data, workdir)
    docs = list(task.eval_docs)
    assert len(docs) == 1319
    n, mismatches = agreement(task, docs)
    print(f"\ngsm8k strict-match: lm-eval and a3po.grading agree (and match the expectation) on {n - len(mismatches)}/{n} completions")
    assert mismatches == []


def test_documented_divergences(fixture_task) -> None:
    # Answers the project's grader accepts and lm-eval's strict-match does not (never the reverse here).
    doc = list(fixture_task.eval_docs)[1]  # gold "#### 1,250"
    lenient = [
        "She earns 25 * 50 dollars, so the answer is \\boxed{1250}.",  # boxed, no #### line
        "She earns 25 * 50 = 1250 dollars.\n#### $1,250",  # currency sign after ####
        "She earns 25 * 50 = 1250 dollars.\n#### 1250.00",  # numerically equal
        "She earns 25 * 50 = 1250 dollars.",  # no final line: the last number
    ]
    lm = lm_eval_bridge.lm_eval_item_scores(fixture_task, lenient, "strict-match", docs=[doc] * len(lenient))
    assert lm == [0.0] * 4
    assert [score("gsm8k", t, doc["answer"]) for t in lenient] == [1.0] * 4


def test_installed_task_config_is_read_not_retyped() -> None:
    cfg = lm_eval_bridge.installed_config("gsm8k")
    strict = next(f for f in cfg["filter_list"] if f["name"] == "strict-match")
    assert strict["filter"][0]["regex_pattern"] == "#### (\\-?[0-9\\.\\,]+)"
    assert lm_eval_bridge.installed_config("math500")["task"] == "minerva_math500"
    assert lm_eval_bridge.installed_config("aime24")["dataset_path"] == "Maxwell-Jia/AIME_2024"


@pytest.mark.slow  # ~20 s: imports lm-eval's HF model stack and runs three tasks
def test_run_lm_eval_on_the_tiny_model_offline() -> None:
    # lm-eval's own gsm8k / minerva_math500 / aime24 on the in-memory tiny model, data from the
    # fixtures (aime24 rewritten to the hub's column names). A random model scores 0: this checks
    # the plumbing (tasks build offline, HFLM takes the model and its tokenizer, metrics return).
    from eval.runner import load_model

    model, tok, _ = load_model("tiny")
    out = lm_eval_bridge.run_lm_eval(
        model, tok, ["gsm8k", "math500", "aime24"], source=fixture_path("gsm8k").parent, limit=1, max_gen_toks=4, batch_size=1
    )
    # 4 tokens of a random model: no fixture gold is written (a key missing raises KeyError).
    assert out["gsm8k"]["exact_match,strict-match"] == 0.0
    assert out["math500"]["math_verify,none"] == 0.0 and out["aime24"]["exact_match,none"] == 0.0
    assert all(v["sample_len"] == 1 for v in out.values())
