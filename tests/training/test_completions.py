"""Completion tables (a3po.training.completions, tasks.completions): the bounds, the rows of a
hand-built batch, the tables of a micro run and of a crashed-and-resumed one, and the MLflow
tables logged from a run folder on a real SQLite store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from a3po.config import preset, with_overrides
from a3po.data.arithmetic import WORDS
from a3po.data.datasets import load_rows
from a3po.models.factory import build_tiny_model
from a3po.producer.producer import ScoredBatch
from a3po.rollout.types import RolloutBatch
from a3po.training.completions import COLUMNS, CompletionTables, clip_text, read_table, split_rows, spread, table_path, table_steps, train_rows
from a3po.training.loop import rl_train
from tests.support.resume import run_interrupted_and_resumed
from tests.support.rewards import digit_reward, stub_rewards

# --- bounds and rows, no model ------------------------------------------------------------------


def test_clip_text_keeps_short_text_and_says_how_much_was_cut():
    assert clip_text("abc", 3) == "abc"
    assert clip_text("abcdef", 4) == "abcd [... 2 more characters]"  # 6 - 4 = 2 left out


def test_rows_split_between_the_batch_and_the_heldout_set():
    assert split_rows(16) == (8, 8)
    assert split_rows(5) == (3, 2)  # the odd row to the training batch
    assert split_rows(1) == (1, 0)
    assert spread(8, 3) == [0, 2, 5]  # 0*8//3, 1*8//3, 2*8//3
    assert spread(2, 5) == [0, 1]  # never more than the batch holds


def _batch() -> ScoredBatch:
    """Four samples in two groups, trained at version 5. Responses start at column 2; -1 marks
    columns outside the response."""
    versions = torch.tensor([
        [-1, -1, 3, 3, 4, -1],  # tokens of versions 3 and 4 (weights changed mid-sequence)
        [-1, -1, 4, 4, 4, 4],
        [-1, -1, 4, -1, -1, -1],
        [-1, -1, 3, 3, 3, 3],
    ])
    mask = versions >= 0
    rollout = RolloutBatch(
        input_ids=torch.zeros(4, 6, dtype=torch.long), attention_mask=torch.ones(4, 6, dtype=torch.long), response_mask=mask,
        behav_logp=torch.zeros(4, 6), versions=versions, finished=torch.tensor([True, False, True, False]), prompt_len=2,
        meta=[{"id": "p1", "gold": "7", "group": 0}, {"id": "p1", "gold": "7", "group": 0},
              {"id": "p2", "gold": "9", "group": 1}, {"id": "p2", "gold": "9", "group": 1}],
    )
    return ScoredBatch(index=5, rollout=rollout, rewards=torch.tensor([1.0, 0.0, 0.25, 0.75]),
                       completions=["x" * 30, "seven", "nine", "ten"], gen_time_s=0.0)


def test_training_rows_carry_rewards_versions_and_staleness():
    rows = train_rows(_batch(), trainer_version=5, k=4, prompts={"p1": "3 + 4", "p2": "4 + 5"}, max_chars=10)
    first = rows[0]
    assert (first["id"], first["prompt"], first["gold"], first["reward"]) == ("p1", "3 + 4", "7", 1.0)
    assert first["completion"] == "x" * 10 + " [... 20 more characters]"
    # Group 0 = rewards 1.0 and 0.0: mean 0.5; group 1 = 0.25 and 0.75: mean 0.5.
    assert [r["group_mean_reward"] for r in rows] == [0.5, 0.5, 0.5, 0.5]
    assert [r["tokens"] for r in rows] == [3, 4, 1, 4]
    assert [r["finished"] for r in rows] == [True, False, True, False]
    assert [(r["version_min"], r["version_max"]) for r in rows] == [(3, 4), (4, 4), (4, 4), (3, 3)]
    # staleness = 5 - version: newest token -> min, oldest -> max.
    assert [(r["staleness_min"], r["staleness_max"]) for r in rows] == [(1, 2), (1, 1), (1, 1), (2, 2)]


def test_a_table_holds_at_most_the_limit_and_rewinds(tmp_path):
    held = [{"id": f"h{i}", "prompt": f"q{i}", "gold": str(i)} for i in range(6)]
    tables = CompletionTables(tmp_path, limit=3, train_data=[{"id": "p1", "prompt": "3 + 4"}, {"id": "p2", "prompt": "4 + 5"}],
                              heldout_data=held, max_chars=8)
    greedy = (["answer number %d" % i for i in range(6)], [1.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    tables.write(0, heldout=greedy)  # no batch yet: 3 held-out rows
    tables.write(6, _batch(), greedy)  # 2 training rows (samples 0 and 2) + 1 held-out row
    tables.write(8, _batch(), greedy)
    start = read_table(table_path(tmp_path, 0))
    assert [(r["source"], r["id"], r["completion"]) for r in start] == [
        ("heldout", "h0", "answer n [... 7 more characters]"), ("heldout", "h1", "answer n [... 7 more characters]"),
        ("heldout", "h2", "answer n [... 7 more characters]")]
    six = read_table(table_path(tmp_path, 6))
    assert [(r["step"], r["source"], r["id"]) for r in six] == [(6, "train", "p1"), (6, "train", "p2"), (6, "heldout", "h0")]
    assert all(list(r) == list(COLUMNS) for r in six)  # every row has every column, in order
    # The batch of step 6 was trained at version 5: sample 0 (versions 3, 4) is 1 to 2 versions
    # stale, sample 2 (version 4) 1; the held-out answer is version 6's, and has no staleness.
    assert [(r["staleness_min"], r["staleness_max"]) for r in six[:2]] == [(1, 2), (1, 1)]
    assert (six[2]["version_min"], six[2]["staleness_max"], six[2]["reward"]) == (6, None, 1.0)
    assert table_steps(tmp_path) == [0, 6, 8]
    assert tables.rewind(6) == [8]  # a run resuming at step 6 redoes step 8
    assert table_steps(tmp_path) == [0, 6]
    with pytest.raises(ValueError, match="limit >= 1"):
        CompletionTables(tmp_path, limit=0, train_data=[], heldout_data=[])


def test_config_checks_the_row_limit():
    assert with_overrides(preset("micro"), rl={"log_completions": 0}).rl.log_completions == 0
    with pytest.raises(ValueError, match="rl.log_completions"):
        with_overrides(preset("micro"), rl={"log_completions": -1})


# --- micro runs through rl_train ----------------------------------------------------------------

# Tables at every step; 40 rows = the whole batch (4 prompts x 2 = 8 of 20 training rows) and
# every held-out problem (16 of 20 held-out rows), so their means are the step's metrics.
OVERRIDES = {"steps": 4, "eval_every": 1, "checkpoint_every": 2, "log_completions": 40}


def _micro_run(folder: Path, ckpt_dir: str | None = None, progress=None, **rl):
    cfg = with_overrides(preset("micro"), rl={**OVERRIDES, **rl})
    model, tok = build_tiny_model("micro", WORDS, seed=0)
    train, held, _ = load_rows(cfg.data, tok)
    res = rl_train(cfg, model, tok, train, held, ckpt_dir=ckpt_dir, warmstart_acc=0.0, progress=progress, completions_dir=str(folder))
    return res, held


def _tables(folder: Path) -> dict[int, list[dict]]:
    return {s: read_table(table_path(folder, s)) for s in table_steps(folder)}


@pytest.fixture(scope="module")
def micro_run(core_one_thread, tmp_path_factory):
    folder = tmp_path_factory.mktemp("completions")
    with pytest.MonkeyPatch.context() as mp:
        stub_rewards(mp)
        res, held = _micro_run(folder)
    return res, held, folder


def test_micro_run_writes_a_table_per_evaluation(micro_run):
    res, held, folder = micro_run
    tables = _tables(folder)
    assert sorted(tables) == [1, 2, 3, 4]  # eval_every 1; no step 0: the warm-start figure was given
    for step, rows in tables.items():
        train = [r for r in rows if r["source"] == "train"]
        heldout = [r for r in rows if r["source"] == "heldout"]
        assert len(train) == 8 and len(heldout) == 16
        m = res.history[step - 1]
        assert sum(r["reward"] for r in train) / 8 == pytest.approx(m["reward/mean"])
        assert sum(r["reward"] for r in heldout) / 16 == pytest.approx(m["eval/heldout_greedy_acc"])
        assert [r["id"] for r in heldout] == [str(r["id"]) for r in held]  # the same problems, in order
        # The stub grader's score of the text (training rewards are float32).
        assert [r["reward"] for r in rows] == pytest.approx([digit_reward("", [r["completion"]], [""])[0] for r in rows], abs=1e-7)
        assert all((r["version_min"], r["version_max"], r["staleness_max"]) == (step, step, None) for r in heldout)
        # Groups of 2 consecutive samples: each group's mean is the mean of its two rows.
        for a, b in zip(train[::2], train[1::2], strict=True):
            assert a["group_mean_reward"] == b["group_mean_reward"] == pytest.approx((a["reward"] + b["reward"]) / 2)


def test_micro_run_training_rows_follow_the_deterministic_schedule(micro_run):
    # max_staleness 2: batch j starts on version max(0, j - 2) and, from j = 2 on, switches to
    # j - 1 before its 5th token (max_new_tokens 8 // 2 = token index 4); the table of step k
    # shows batch k - 1, trained at version k - 1.
    #   step 1: batch 0, versions 0        -> staleness 0
    #   step 2: batch 1, versions 0        -> staleness 1
    #   step 3: batch 2, versions 0 (+1)   -> staleness max 2
    #   step 4: batch 3, versions 1 (+2)   -> staleness max 2
    _, _, folder = micro_run
    first_version = {1: 0, 2: 0, 3: 0, 4: 1}
    switches = {1: False, 2: False, 3: True, 4: True}
    for step, rows in _tables(folder).items():
        for r in (r for r in rows if r["source"] == "train"):
            assert r["version_min"] == first_version[step]
            assert r["version_max"] == first_version[step] + (1 if switches[step] and r["tokens"] > 4 else 0)
            assert r["staleness_max"] == step - 1 - r["version_min"]
            assert r["staleness_min"] == step - 1 - r["version_max"]


def test_resumed_run_rewrites_its_tables_once(micro_run, core_one_thread, core_stub_rewards, tmp_path):
    # Crash after step 3 (tables 1-3 written, checkpoint at 2): the resumed run removes table 3,
    # writes 3 and 4 again; the tables are those of the uninterrupted run, each once.
    _, _, uninterrupted = micro_run
    folder = tmp_path / "completions"
    res = run_interrupted_and_resumed(lambda ckpt, progress: _micro_run(folder, ckpt, progress)[0], tmp_path / "ckpt", kill_at=3)
    assert res.resumed_from == 2
    assert sorted(p.name for p in folder.iterdir()) == [f"step_00000{s}.jsonl" for s in (1, 2, 3, 4)]  # no temporary files left
    assert _tables(folder) == _tables(uninterrupted)


def test_no_tables_when_off(core_one_thread, core_stub_rewards, tmp_path):
    _micro_run(tmp_path / "completions", steps=1, log_completions=0)
    assert not (tmp_path / "completions").exists()


# --- MLflow -------------------------------------------------------------------------------------


# Slow: a new SQLite store runs MLflow's migrations (~8 s on 2 cores). The fast tier checks a
# trained run's tables on the shared store of tests/tasks/test_tracking.py.
@pytest.mark.slow
def test_tables_reach_mlflow_once(tmp_path):
    from tasks.completions import artifact_file, log_completion_tables
    from tasks.tracking import client_for, create_run, ensure_experiment

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = client_for(uri)
    run_id = create_run(client, ensure_experiment(client, "test", uri), "r", {})
    folder = tmp_path / "completions"
    held = [{"id": "h0", "prompt": "2 + 2", "gold": "4"}]
    tables = CompletionTables(folder, limit=3, train_data=[{"id": "p1", "prompt": "3 + 4"}, {"id": "p2", "prompt": "4 + 5"}], heldout_data=held)
    tables.write(4, _batch(), (["4"], [1.0]))
    tables.write(6, _batch(), (["5"], [0.0]))
    assert artifact_file(6) == "completions/step_000006.json"
    assert log_completion_tables(client, run_id, folder) == [4, 6]
    assert log_completion_tables(client, run_id, folder) == []  # a retried task: nothing appended twice
    local = Path(client.download_artifacts(run_id, "completions/step_000006.json", str(tmp_path / "dl")))
    table = json.loads(local.read_text())  # pandas' "split" layout, as log_table writes it
    assert table["columns"] == list(COLUMNS)
    rows = [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]
    assert [(r["source"], r["id"], r["completion"], r["reward"], r["staleness_max"]) for r in rows] == [
        ("train", "p1", "x" * 30, 1.0, 2), ("train", "p2", "nine", 0.25, 1), ("heldout", "h0", "5", 0.0, None)]
    listed = json.loads(client.get_run(run_id).data.tags["mlflow.loggedArtifacts"])
    assert listed == [{"path": "completions/step_000004.json", "type": "table"}, {"path": "completions/step_000006.json", "type": "table"}]
