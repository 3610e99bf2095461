"""The run's actions file (a3po.training.actions) without a model: a row a line, a torn last line (a
process killed mid-write) cut before the next row, the rows after a checkpoint dropped on resume.
The rows of real runs are checked in tests/training/test_guard.py and test_staleness.py."""

from __future__ import annotations

import json

import pytest

from a3po.training.actions import COLUMNS, Action, ActionLog, read_actions

WARN = Action(2, "guard", "rl.guard_policy warn", "no change", "guard/abs_err_p99 2.5 > rl.guard_max_err 1",
              {"guard/abs_err_p99": 2.5, "rl.guard_max_err": 1.0, "guard/bound": 4.0})
MOVE = Action(3, "staleness", "rl.staleness_control adaptive", "staleness bound 2 -> 1",
              "stability/behav_iw_p99 2.5 > rl.staleness_max_iw 2 for 2 step(s)", {"staleness/bound": 1.0})


def test_a_row_a_line_with_the_columns(tmp_path):
    log = ActionLog(tmp_path / "run" / "actions.jsonl")
    log.record(WARN)
    log.record(MOVE)
    assert not log.path.exists()  # held until the step's metrics line is written
    log.flush()
    lines = (tmp_path / "run" / "actions.jsonl").read_text().splitlines()
    assert [list(json.loads(x)) for x in lines] == [list(COLUMNS)] * 2
    assert json.loads(lines[0])["figures"] == {"guard/abs_err_p99": 2.5, "rl.guard_max_err": 1.0, "guard/bound": 4.0}
    assert read_actions(log.path) == [WARN, MOVE]
    assert MOVE.line() == ("step 3, staleness (rl.staleness_control adaptive): staleness bound 2 -> 1; "
                           "stability/behav_iw_p99 2.5 > rl.staleness_max_iw 2 for 2 step(s)")
    assert read_actions(tmp_path / "none.jsonl") == []  # a run that never acted


def test_a_torn_line_is_cut_and_a_resume_drops_the_rows_after_its_checkpoint(tmp_path):
    path = tmp_path / "actions.jsonl"
    first = ActionLog(path)
    first.record(WARN)
    first.flush()
    with open(path, "ab") as f:
        f.write(b'{"step": 3, "sour')  # killed mid-write
    assert read_actions(path) == [WARN]  # the reader ignores it
    again = ActionLog(path)
    again.record(MOVE)
    again.flush()  # a new process cuts it before its first row
    assert read_actions(path) == [WARN, MOVE]
    log = ActionLog(path)
    log.rewind(2)  # resumed from the checkpoint of step 2: step 3 is trained again
    assert read_actions(path) == [WARN]
    log.record(MOVE)
    log.flush()
    assert read_actions(path) == [WARN, MOVE]
    ActionLog(path).rewind(0)  # a fresh start keeps nothing
    assert read_actions(path) == []


def test_a_step_that_crashes_before_its_metrics_line_leaves_no_row(tmp_path):
    path = tmp_path / "actions.jsonl"
    log = ActionLog(path)
    log.record(WARN)
    log.flush()  # step 2 done
    log.record(MOVE)  # step 3 acted, then the process died before step 3's metrics line
    assert read_actions(path) == [WARN]
    log.flush()
    log.flush()  # nothing held twice
    assert read_actions(path) == [WARN, MOVE]


def test_a_row_without_a_column_is_an_error_naming_the_file(tmp_path):
    path = tmp_path / "actions.jsonl"
    path.write_text('{"step": 4, "source": "guard"}\n')
    with pytest.raises(ValueError, match=r"actions.jsonl: the row of step 4 has no setting, action, reason, figures"):
        read_actions(path)
