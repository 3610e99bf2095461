"""A finished run's record is reused only when it is what the run wrote (a3po.training.records):
each way a record, its history or its final model can differ from what was written is refused,
naming the file and the check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from a3po.training.records import RecordRefused, finished_record, history_text, seal

HISTORY = [{"reward/mean": 0.25, "time/train_wall_s": 1.0},
           {"reward/mean": 0.5, "time/train_wall_s": 2.0, "eval/heldout_acc": 0.375}]
RECORD = {"variant": "loglinear", "seed": 0, "warmstart_acc": 0.125, "final_acc": 0.375, "steps": 2, "wall_s": 3.5,
          "resumed_from": None, "eval_curve": [[0, 0.125], [2, 0.375]]}


def finished_run(tmp_path: Path, record: dict = RECORD, history: list[dict] = HISTORY) -> Path:
    """A run folder as a finished run leaves it: final/, result.json (sealed), history.jsonl."""
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "final" / "model.safetensors").write_bytes(b"weights")
    (run / "final" / "config.json").write_text("{}")
    (run / "result.json").write_text(json.dumps(seal(record, history, run / "final")))
    (run / "history.jsonl").write_text(history_text(history))
    return run


def edit_json(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_an_intact_record_is_reused_with_its_history_rows(tmp_path):
    record, rows = finished_record(finished_run(tmp_path), "loglinear", 0, 2)
    assert record["final_acc"] == 0.375 and record["eval_curve"] == [[0, 0.125], [2, 0.375]]
    assert rows == [{"step": 1, **HISTORY[0]}, {"step": 2, **HISTORY[1]}]


def test_a_run_that_did_not_finish_is_not_a_record(tmp_path):
    run = finished_run(tmp_path)
    (run / "history.jsonl").unlink()  # killed between result.json and its history
    assert finished_record(run, "loglinear", 0, 2) is None


# Each way a finished run's folder can disagree with what was written, and the words that name it.
TAMPERED = {
    # result.json edited by hand: its figure, seed and variant (the figures then disagree with its curve)
    "edited record": (lambda run: edit_json(run / "result.json", final_acc=0.9, seed=7, variant="sync"),
                      "result.json: its content does not match the digest"),
    # one step's reward rewritten in the history a re-run would log
    "edited history": (lambda run: (run / "history.jsonl").write_text(history_text(
        [HISTORY[0], {**HISTORY[1], "reward/mean": 0.75}])), "history.jsonl: its content does not match the digest"),
    # other weights copied over the final model
    "other final weights": (lambda run: (run / "final" / "model.safetensors").write_bytes(b"other"),
                            "model.safetensors: content hash mismatch"),
    "final file gone": (lambda run: (run / "final" / "config.json").unlink(), "config.json is missing"),
    # an earlier version's record, written without digests
    "no digests": (lambda run: (run / "result.json").write_text(json.dumps(RECORD)),
                   "lacks digest, history_sha256, final_files"),
    "not JSON": (lambda run: (run / "result.json").write_text("{"), "result.json: unreadable"),
}


@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_a_record_that_is_not_what_the_run_wrote_is_refused_naming_the_file(tmp_path, case):
    tamper, words = TAMPERED[case]
    run = finished_run(tmp_path)
    tamper(run)
    with pytest.raises(RecordRefused, match=words):
        finished_record(run, "loglinear", 0, 2)


@pytest.mark.parametrize("given,words", [
    (("sync", 0, 2), "variant 'loglinear', but this folder's run has variant 'sync'"),
    (("loglinear", 1, 2), "seed 0, but this folder's run has seed 1"),
    (("loglinear", 0, 3), "steps 2, but this folder's run has steps 3"),
])
def test_a_sealed_record_of_another_run_is_refused(tmp_path, given, words):
    """A folder that holds another run's record (copied in whole, digests and all)."""
    run = finished_run(tmp_path)
    with pytest.raises(RecordRefused, match=words):
        finished_record(run, *given)


@pytest.mark.parametrize("record,history,words", [
    # sealed as written, but its final figure is not its own curve's last point
    ({**RECORD, "final_acc": 0.9}, HISTORY, r"final_acc 0.9 is not the last point of its own eval_curve \(0.375\)"),
    # its final figure is not the history's last evaluation
    (RECORD, [HISTORY[0], {**HISTORY[1], "eval/heldout_acc": 0.5}], r"final_acc 0.375 is not .*history.jsonl's last evaluation \(0.5 at step 2\)"),
    # the history shorter than the record's steps
    (RECORD, HISTORY[:1], "2 steps, but .*history.jsonl holds 1"),
])
def test_a_record_whose_figures_disagree_with_its_own_curves_is_refused(tmp_path, record, history, words):
    """The cross-checks that hold even where a writer sealed a wrong record."""
    run = finished_run(tmp_path, record, history)
    with pytest.raises(RecordRefused, match=words):
        finished_record(run, "loglinear", 0, 2)
