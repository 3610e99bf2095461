"""The step-size table pairs arm and seed across the two comparisons and differences the final
smoothed reward (not the run's mean reward, not the last raw step)."""

import json

import pytest

from a3po.training.records import RecordRefused, history_text, seal
from bench import step_size_table


def write_run(root, name, rewards, final_acc, lr_scale=None):
    """A finished run folder as the training task leaves it: history, final weights, sealed record."""
    d = root / name
    (d / "final").mkdir(parents=True)
    (d / "final" / "model.safetensors").write_bytes(name.encode())
    history = []
    for step, r in enumerate(rewards, start=1):
        row = {"reward/mean": r, "stability/behav_iw_max": float(step)}
        if lr_scale is not None:
            row["step_size/lr_scale"] = lr_scale
        history.append(row)
    (d / "history.jsonl").write_text(history_text(history))
    arm, seed = name.rsplit("-", 1)[0].rsplit("-seed", 1)
    record = {"variant": arm.split("+")[0], "seed": int(seed), "warmstart_acc": 0.0, "final_acc": final_acc,
              "steps": len(rewards), "wall_s": 10.0, "eval_curve": [[len(rewards), final_acc]]}
    (d / "result.json").write_text(json.dumps(seal(record, history, d / "final")))


def test_pairs_by_seed_and_differences_the_smoothed_final_reward(tmp_path, capsys):
    fixed, ess = tmp_path / "fixed", tmp_path / "ess"
    # 8 steps: the smoothing window is 2, so the final reward is the mean of the last two steps
    write_run(fixed, "loglinear+s4-seed0-0000000a", [0.0] * 6 + [0.2, 0.2], 0.50)
    write_run(fixed, "loglinear+s4-seed1-0000000b", [0.0] * 6 + [0.4, 0.4], 0.60)
    write_run(fixed, "loglinear+s4-seed2-0000000c", [0.0] * 8, 0.10)  # no ess partner: left out
    write_run(ess, "loglinear+s4-seed0-0000000d", [0.9] * 6 + [0.5, 0.3], 0.55, lr_scale=0.8)
    write_run(ess, "loglinear+s4-seed1-0000000e", [0.9] * 6 + [0.3, 0.7], 0.60, lr_scale=0.6)
    step_size_table.main(["--fixed", str(fixed), "--ess", str(ess)])
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step_size_table"]["loglinear+s4"]
    assert row["seeds"] == 2
    assert row["fixed_final_reward"] == pytest.approx(0.3)
    assert row["ess_final_reward"] == pytest.approx(0.45)
    # paired differences +0.2 and +0.1: the bootstrap means are 0.1, 0.15 and 0.2
    assert row["diff_final_reward"] == pytest.approx(0.15)
    assert row["diff_final_reward_lo"] == pytest.approx(0.1)
    assert row["diff_final_reward_hi"] == pytest.approx(0.2)
    assert row["diff_final_acc"] == pytest.approx(0.025)
    assert row["ess_lr_scale"] == pytest.approx(0.7)
    assert row["ess_iw_max"] == pytest.approx(8.0)


def test_an_edited_record_is_refused(tmp_path):
    fixed, ess = tmp_path / "fixed", tmp_path / "ess"
    write_run(fixed, "loglinear+s4-seed0-0000000a", [0.1] * 4, 0.5)
    write_run(ess, "loglinear+s4-seed0-0000000b", [0.1] * 4, 0.5)
    result = ess / "loglinear+s4-seed0-0000000b" / "result.json"
    result.write_text(result.read_text().replace('"final_acc": 0.5', '"final_acc": 0.9'))
    with pytest.raises(RecordRefused, match="does not match the digest"):
        step_size_table.main(["--fixed", str(fixed), "--ess", str(ess)])


def test_refuses_folders_with_nothing_in_common(tmp_path):
    write_run(tmp_path / "fixed", "loglinear+s1-seed0-0000000a", [0.1] * 4, 0.5)
    write_run(tmp_path / "ess", "loglinear+s1-seed1-0000000b", [0.1] * 4, 0.5)
    with pytest.raises(SystemExit, match="no \\(arm, seed\\) finished in both"):
        step_size_table.main(["--fixed", str(tmp_path / "fixed"), "--ess", str(tmp_path / "ess")])
