"""Verdicts that need something to judge, settings given twice, options checked before training,
and dataset rows whose ids or text cannot be used.

- A verdict over zero items is refused (``tasks.verdicts.all_pass``): a parity night without a
  reference, or comparing an arm with itself, a comparison of no arms, a claim over no seed.
- A setting given twice is never silently replaced: ``a3po train --config`` keeps the file's
  values unless an option is given, and an option that replaces one warns naming both; in the
  flows, ``--set`` and a field's own option on one command line are refused.
- Every option is checked before anything trains: the nightly's statistics options exit 2 in one
  line, nothing written; repeated or non-integer seeds too.
- Dataset rows: a repeated id (rows are looked up by id) and a string that is not UTF-8 text (a
  lone surrogate from a ``"\\ud800"`` escape) name the file, the row and the field, or are skipped
  and counted under ``on_bad_row: skip``; benchmark files are read by the same check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from a3po.config import DataConfig
from a3po.data.arithmetic import WORDS
from a3po.data.datasets import BadRowError, load_rows, read_jsonl
from a3po.models.tokenizer import build_tokenizer
from tasks.verdicts import NothingToJudge, all_pass

REPO_ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "DO_NOT_TRACK": "true"}


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(WORDS)


def _rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))  # json.dumps writes a lone surrogate as "\ud800"
    return path


def _row(i: int, **fields) -> dict:
    return {"id": f"q{i}", "prompt": f"Question: {i} + 1 = ?\nAnswer: ", "gold": str(i + 1), **fields}


# --- a verdict needs something to judge ----------------------------------------------------------


def test_a_verdict_over_nothing_is_refused_not_passed():
    assert all_pass([True, True], "results") and not all_pass([True, False], "results")
    with pytest.raises(NothingToJudge, match="no parity results to judge"):
        all_pass([], "parity results")  # all([]) is True: a pass on nothing


def test_a_parity_decision_needs_a_reference_other_than_the_candidate():
    from tasks.parity import decide, parity_metrics

    with pytest.raises(NothingToJudge, match="no references to compare the candidate 'loglinear' with"):
        decide([], "loglinear", [])
    with pytest.raises(ValueError, match="the candidate 'loglinear' is also a reference"):
        decide([], "loglinear", ["recompute", "loglinear"])
    with pytest.raises(ValueError, match=r"references repeat \['sync'\]"):
        decide([], "loglinear", ["sync", "sync"])
    with pytest.raises(NothingToJudge):  # the parent run's parity/pass metric was 1.0 on no results
        parity_metrics([])


def test_a_claim_over_no_seed_is_not_measurable_and_no_rows_are_refused():
    from tasks.claims import CLAIMS, NOT_MEASURABLE, REPRODUCED, Measured, check_claims, judge

    # Before: "reproduced ... on all 0 seed(s)".
    assert judge(CLAIMS[0], Measured({}, ""))[0] == NOT_MEASURABLE
    assert judge(CLAIMS[0], Measured({0: 20.0}, ""))[0] == REPRODUCED  # prox_time >= 10
    with pytest.raises(NothingToJudge, match="no comparison rows for the claims"):
        check_claims([], None)


@pytest.mark.parametrize(("variants", "modes", "placements", "what"), [
    ([], None, None, "variants"), (["sync"], [], None, "OPPO modes"), (["sync"], None, [], "placements")])
def test_a_comparison_of_no_arms_is_refused(variants, modes, placements, what):
    from tasks.arms import expand_arms

    with pytest.raises(NothingToJudge, match=f"no {what} given"):
        expand_arms(variants, modes, placements)


def _one_line_exit_2(main, argv: list[str], capsys, out: Path) -> str:
    try:
        status = main([*argv, "--output-dir", str(out)])
    except SystemExit as e:  # a usage error raised while the options are read, as argparse does
        status = e.code
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert not out.exists()  # refused before any folder, server or training
    return err[0]


@pytest.mark.parametrize(("argv", "message"), [
    (["--references", ""], "no references to compare the candidate 'loglinear' with"),
    (["--references", "recompute,loglinear"], "the candidate 'loglinear' is also a reference"),
])
def test_the_nightly_refuses_nothing_to_compare_before_training(tmp_path, capsys, argv, message):
    from flows.nightly_parity import main

    line = _one_line_exit_2(main, ["--preset", "micro", "--seeds", "0", "--steps", "2", *argv], capsys, tmp_path / "out")
    assert message in line


@pytest.mark.parametrize(("command", "argv", "what"), [
    ("compare", ["--variants", ""], "variants"), ("compare", ["--oppo", ""], "OPPO modes"),
    ("claims", ["--placements", ""], "placements")])
def test_compare_and_claims_refuse_no_arms_before_training(tmp_path, capsys, command, argv, what):
    from flows.compare_variants import main as compare_main
    from flows.paper_claims import main as claims_main

    main = {"compare": compare_main, "claims": claims_main}[command]
    line = _one_line_exit_2(main, ["--preset", "micro", "--seeds", "0", "--benchmarks", "", *argv], capsys, tmp_path / "out")
    assert what in line


# --- every option is checked before anything trains ---------------------------------------------


@pytest.mark.parametrize(("argv", "option"), [
    (["--n-boot", "0"], "--n-boot"), (["--confidence", "1.5"], "--confidence"), (["--confidence", "0.3"], "--confidence"),
    (["--history", "-1"], "--history"), (["--tolerance", "-0.1"], "--tolerance"),
    (["--rule", "shortfall", "--noise-sd", "0.02", "--calibration-seeds", "1"], "--calibration-seeds"),
    (["--seeds", "0,0"], "--seeds"), (["--seeds", "a"], "--seeds"),
])
def test_the_nightly_checks_every_option_before_training(tmp_path, capsys, argv, option):
    """Before: each trained the whole comparison, then failed with exit 1 (a parity failure's
    status) or, for --seeds 0,0, trained one run and reported two seeds; --seeds a: a traceback."""
    from flows.nightly_parity import main

    line = _one_line_exit_2(main, ["--preset", "micro", "--steps", "2", "--seeds", "0,1", "--references", "recompute", *argv],
                            capsys, tmp_path / "out")
    assert line.startswith(f"error: {option}: "), line


def test_a_bad_launch_node_list_is_one_line(tmp_path, capsys):
    from flows.compare_variants import main

    line = _one_line_exit_2(main, ["--preset", "micro", "--launch", "torchrun", "--launch-nodes", "a"], capsys, tmp_path / "out")
    assert line == "error: --launch-nodes: expected comma-separated integers, got 'a'"


# --- a setting given twice ------------------------------------------------------------------------


def test_a3po_train_keeps_the_files_variant_when_no_option_is_given(tmp_path):
    """Before: the CLI's default --variant loglinear replaced ``rl: {variant: sync}`` silently."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("rl: {variant: sync, steps: 1, eval_every: 1}\n")
    cmd = [sys.executable, "-m", "a3po.training.command", "--preset", "micro", "--config", str(cfg), "--output-dir", str(tmp_path / "o"),
           "--no-progress"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["variant"] == "sync"
    assert "warning" not in proc.stderr


def test_an_option_that_replaces_a_file_value_warns_naming_both(tmp_path, capsys):
    from cli import main

    cfg = tmp_path / "c.yaml"
    # The missing DeepSpeed JSON stops the command after the config is built, before anything is written.
    cfg.write_text(f"rl: {{variant: sync, steps: 3}}\ndistributed: {{deepspeed_config: {tmp_path / 'none.json'}}}\n")
    assert main(["train", "--preset", "micro", "--config", str(cfg), "--variant", "loglinear", "--steps", "3",
                 "--output-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    # steps: 3 in both: not a conflict; the variant is.
    assert err[0] == f"a3po train: warning: rl.variant: 'loglinear' from the command line replaces 'sync' from {cfg}"
    assert len(err) == 2 and err[1].startswith("a3po train: error: ")


def test_the_flows_refuse_a_field_given_twice_and_warn_when_an_option_replaces_the_file(tmp_path, capsys):
    from a3po.config import ConfigError
    from flows.common import build_config
    from flows.compare_variants import main

    with pytest.raises(ConfigError, match=r"rl\.steps is given twice, 3 in overrides \(--set\) and 5 as steps \(--steps\)"):
        build_config("micro", overrides={"rl": {"steps": 3}}, steps=5)
    assert build_config("micro", overrides={"rl": {"steps": 5}}, steps=5).rl.steps == 5  # the same value twice is fine
    line = _one_line_exit_2(main, ["--preset", "micro", "--set", "device=cpu", "--device", "cuda"], capsys, tmp_path / "out")
    assert line == "error: device is given twice, 'cpu' by --set and 'cuda' by --device: give it once"
    cfg = tmp_path / "c.yaml"
    cfg.write_text("rl: {steps: 3, lr: 0.01}\n")
    assert build_config("micro", config=str(cfg), steps=7).rl.steps == 7
    assert f"warning: rl.steps: 7 from the command line replaces 3 from {cfg}" in capsys.readouterr().err
    # A comparison runs every arm on its own seeds: a file's rl.seed is replaced, said aloud.
    from flows.common import ComparisonSpec

    cfg.write_text("rl: {seed: 7}\n")
    assert ComparisonSpec(preset="micro", config=str(cfg), seeds=[0, 1]).train_config().rl.seed == 7
    assert f"warning: rl.seed: 7 from {cfg} is replaced by the comparison's seeds [0, 1] (--seeds)" in capsys.readouterr().err


# --- dataset rows: ids and text -------------------------------------------------------------------


def test_a_repeated_id_names_the_file_and_both_rows_or_is_skipped(tmp_path, tok):
    """Before: accepted; the completion tables looked prompts up by id, so every row of id 'a'
    showed the last such row's prompt beside its own completion and gold."""
    train = _rows(tmp_path / "train.jsonl", [_row(0), _row(1, id="a"), _row(2), _row(3, id="a")])
    held = _rows(tmp_path / "heldout.jsonl", [_row(5), _row(6)])
    with pytest.raises(BadRowError, match=rf"^{train}: row 4: id 'a' is also the id of row 2 "):
        load_rows(DataConfig(train_path=str(train), heldout_path=str(held)), tok)
    kept, _, reports = load_rows(DataConfig(train_path=str(train), heldout_path=str(held), on_bad_row="skip"), tok)
    assert [r["prompt"] for r in kept] == [_row(i)["prompt"] for i in (0, 1, 2)] and len(reports[0].skipped) == 1
    # An id that repeats a generated one (<file>#<index>) or differs only in type (1 and "1") repeats it too.
    _rows(train, [_row(0), {k: v for k, v in _row(1).items() if k != "id"}, _row(2, id=f"{train}#1")])
    with pytest.raises(BadRowError, match=rf"^{train}: row 3: id '{train}#1' is also the id of row 2 "):
        load_rows(DataConfig(train_path=str(train), heldout_path=str(held)), tok)
    _rows(train, [_row(0), _row(1)])
    _rows(held, [_row(5, id=1), _row(6, id="1")])
    with pytest.raises(BadRowError, match=rf"^{held}: row 2: id '1' is also the id of row 1 "):
        load_rows(DataConfig(train_path=str(train), heldout_path=str(held)), tok)


@pytest.mark.parametrize("field", ["gold", "prompt", "solution"])
def test_a_lone_surrogate_names_file_row_and_field_or_is_skipped(tmp_path, tok, field):
    """Before: a gold passed validation (even with on_bad_row: skip) and killed the run when it
    wrote the first completion table; a prompt gave a tokenizer TypeError naming no row."""
    bad = _row(1)
    bad[field] = "what is \ud800?"
    p = _rows(tmp_path / "train.jsonl", [_row(0), bad, _row(2)])
    message = rf"^{p}: row 2: field '{field}': not UTF-8 text \(lone surrogate U\+D800 at character 8\)$"
    with pytest.raises(BadRowError, match=message):
        read_jsonl(p)
    kept, _, reports = load_rows(DataConfig(train_path=str(p), heldout_path=str(p), on_bad_row="skip"), tok)
    assert [r["id"] for r in kept] == ["q0", "q2"] and reports[0].skipped == [f"{p}: row 2: field '{field}': not UTF-8 text "
                                                                                "(lone surrogate U+D800 at character 8)"]


def test_benchmark_files_refuse_a_lone_surrogate_naming_the_row(tmp_path):
    from eval.data import SchemaError, load_benchmark

    rows = [{"question": "1+1?", "answer": "#### 2"}, {"question": "What is \udfff plus 1?", "answer": "#### 3"}]
    jl = _rows(tmp_path / "gsm8k.jsonl", rows)
    with pytest.raises(SchemaError, match=rf"^{jl}: row 2: field 'question': not UTF-8 text \(lone surrogate U\+DFFF"):
        load_benchmark("gsm8k", jl)
    js = tmp_path / "gsm8k.json"
    js.write_text(json.dumps(rows))
    with pytest.raises(SchemaError, match=rf"^{js}: row 2: field 'question': not UTF-8 text"):
        load_benchmark("gsm8k", js)


def _record(arm: str, seed: int, rewards: list[float]) -> dict:
    return {"arm": arm, "variant": arm, "seed": seed, "history": [{"reward/mean": r} for r in rewards]}


def test_parity_is_not_judged_between_references_whose_reward_did_not_move():
    from tasks.parity import MIN_REFERENCE_GAIN, references_moved

    # Ten steps, smooth_frac 0.2: start = the first two steps' mean, final = the last two's.
    rose = [0.1, 0.1, 0.2, 0.3, 0.3, 0.4, 0.4, 0.4, 0.4, 0.4]  # +0.3
    flat_high = [0.6] * 10  # a high reward that never moved: its final figure alone looks healthy
    candidate = _record("loglinear", 0, [0.0] * 10)  # a candidate that learned nothing is not the reference
    assert references_moved([candidate, _record("recompute", 0, rose)], ["recompute"], 0.2) is None
    why = references_moved([candidate, _record("recompute", 0, flat_high)], ["recompute"], 0.2)
    assert why.startswith("the references (recompute) moved their reward +0.000 from their first steps (mean over 1 run(s))")
    # The mean over the references' runs: +0.3 and -0.3 average to nothing moved.
    fell = list(reversed(rose))
    assert "+0.000" in references_moved([_record("recompute", 0, rose), _record("sync", 0, fell)], ["recompute", "sync"], 0.2)
    # Just under the bound is not enough; at it, it is.
    under = [0.1, 0.1] + [0.1 + MIN_REFERENCE_GAIN - 0.01] * 8
    at = [0.1, 0.1] + [0.1 + MIN_REFERENCE_GAIN + 1e-9] * 8
    assert references_moved([_record("recompute", 0, under)], ["recompute"], 0.2) is not None
    assert references_moved([_record("recompute", 0, at)], ["recompute"], 0.2) is None
