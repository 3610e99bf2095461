"""The readers of a run's metrics file merge the lines of one step: a background held-out
evaluation (rl.eval_mode, a3po.training.evaluations) logs its figures at its step after that
step's line."""

from __future__ import annotations

from a3po.training.metrics import JsonlLogger
from tasks.launched import read_metrics_jsonl
from tasks.summary import final_reward, read_history


def test_a_late_evaluation_line_is_merged_into_its_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = JsonlLogger(path)
    log.log_metrics({"reward/mean": 0.25}, 1)
    log.log_metrics({"reward/mean": 0.5}, 2)
    log.log_metrics({"eval/heldout_acc": 0.75}, 1)  # version 1's figure, collected at step 2
    log.log_metrics({"reward/mean": 1.0, "eval/heldout_acc": 0.5}, 3)
    merged = [{"reward/mean": 0.25, "eval/heldout_acc": 0.75}, {"reward/mean": 0.5},
              {"reward/mean": 1.0, "eval/heldout_acc": 0.5}]
    assert read_metrics_jsonl(path) == merged
    assert read_history(path) == [{"step": s, **m} for s, m in zip((1, 2, 3), merged, strict=True)]
    assert final_reward(read_history(path)) == final_reward([{"reward/mean": r} for r in (0.25, 0.5, 1.0)])
