"""The group filter (``rl.filter_groups``, :mod:`a3po.producer.group_filter`): no group whose
rewards are all equal reaches the update while the cap allows a refill, refills never sample on
older weights than the batch's own (the staleness bound holds), a filtered run is reproducible and
resumes exactly, and a filter that finds nothing to train on stops the run with one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from a3po.algorithms.advantages import groups_with_signal
from a3po.config import preset, with_overrides
from a3po.data.arithmetic import WORDS
from a3po.data.datasets import load_rows
from a3po.models.factory import build_tiny_model
from a3po.producer.group_filter import Drawn, assemble
from a3po.producer.weight_store import clone_state
from a3po.rollout.types import RolloutBatch, stack_rows
from a3po.training import loop
from a3po.training.loop import SignalDrained, rl_train, stop_if_drained

pytestmark = pytest.mark.usefixtures("core_one_thread")
PAD = 0


def test_a_group_has_signal_when_its_rewards_differ():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.0, 0.0])
    groups = torch.tensor([3, 3, 5, 5, 7, 7, 9, 9])
    assert groups_with_signal(rewards, groups) == {3: False, 5: True, 7: False, 9: False}


def _batch(prompts: list[list[int]], answers: list[list[int]], groups: list[int], version: int) -> RolloutBatch:
    """A batch laid out as the engines lay one out: prompts left-padded to the widest, answers from there."""
    p, r = max(map(len, prompts)), max(map(len, answers))
    n = len(prompts)
    ids = torch.full((n, p + r), PAD)
    attn = torch.zeros((n, p + r), dtype=torch.long)
    resp = torch.zeros((n, p + r), dtype=torch.bool)
    for i, (q, a) in enumerate(zip(prompts, answers, strict=True)):
        ids[i, p - len(q):p] = torch.tensor(q)
        ids[i, p:p + len(a)] = torch.tensor(a)
        attn[i, p - len(q):p + len(a)] = 1
        resp[i, p:p + len(a)] = True
    logp = torch.where(resp, -torch.arange(n * (p + r), dtype=torch.float32).reshape(n, p + r) / 100, 0.0)
    versions = torch.where(resp, version, -1)
    return RolloutBatch(ids, attn, resp, logp, versions, torch.ones(n, dtype=torch.bool), p,
                        [{"id": f"q{g}", "group": g} for g in groups])


def test_stack_rows_re_pads_batches_of_other_widths_without_changing_a_row():
    a = _batch([[5, 6, 7], [8]], [[11, 12], [13]], [0, 1], version=2)
    b = _batch([[9, 9]], [[21, 22, 23, 24]], [4], version=3)
    out = stack_rows([(a, [1]), (b, [0]), (a, [0])], PAD)
    assert out.prompt_len == 3 and out.input_ids.shape == (3, 7)
    assert out.input_ids.tolist() == [[0, 0, 8, 13, 0, 0, 0], [0, 9, 9, 21, 22, 23, 24], [5, 6, 7, 11, 12, 0, 0]]
    for row, (src, i) in enumerate([(a, 1), (b, 0), (a, 0)]):
        assert out.behav_logp[row][out.response_mask[row]].tolist() == src.behav_logp[i][src.response_mask[i]].tolist()
        assert out.versions[row][out.response_mask[row]].tolist() == src.versions[i][src.response_mask[i]].tolist()
        assert int(out.attention_mask[row].sum()) == int(src.attention_mask[i].sum())
    assert [m["group"] for m in out.meta] == [1, 4, 0]


def test_assemble_trains_the_groups_with_signal_first_and_fills_a_short_batch_with_the_earliest_without():
    # Batch 2 of 4 prompts x 2 samples: groups 8 and 10 carry no signal; one refill round of 2 groups,
    # of which one has signal. The cap stopped there: 3 with signal, one filled up.
    first = Drawn(_batch([[1]] * 8, [[2]] * 8, [8, 8, 9, 9, 10, 10, 11, 11], 1),
                  torch.tensor([0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0]), [f"a{i}" for i in range(8)])
    refill = Drawn(_batch([[3, 3]] * 4, [[4, 4, 4]] * 4, [20, 20, 21, 21], 2),
                   torch.tensor([0.0, 0.0, 0.0, 1.0]), [f"b{i}" for i in range(4)])
    batch, figures = assemble([first, refill], batch_prompts=4, index=2, pad_id=PAD)
    assert batch.completions == ["a2", "a3", "a6", "a7", "b2", "b3", "a0", "a1"]
    assert batch.rewards.tolist() == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    assert [m["group"] for m in batch.rollout.meta] == [8, 8, 9, 9, 10, 10, 11, 11]  # batch 2's numbering
    assert [m["id"] for m in batch.rollout.meta] == ["q9", "q9", "q11", "q11", "q21", "q21", "q8", "q8"]
    assert figures == {"filter/prompts_drawn": 6.0, "filter/filtered_frac": 3 / 6, "filter/signal_groups": 3.0,
                       "filter/short_groups": 1.0, "filter/prompts_per_signal_group": 2.0,
                       "filter/generated_reward_mean": pytest.approx(5 / 12)}  # 4 + 1 of 12 samples


def test_a_step_with_no_group_with_signal_says_so_and_gives_no_ratio():
    flat = Drawn(_batch([[1]] * 4, [[2]] * 4, [0, 0, 1, 1], 0), torch.zeros(4), ["x"] * 4)
    batch, figures = assemble([flat], batch_prompts=2, index=0, pad_id=PAD)
    assert figures["filter/signal_groups"] == 0.0 and figures["filter/short_groups"] == 2.0
    assert "filter/prompts_per_signal_group" not in figures and len(batch.completions) == 4


# --- micro runs through rl_train ------------------------------------------------------------------


def odd_length_reward(task, completions, golds, ids=None):
    """1 for a completion of odd length: on the random micro model about half the groups of two differ."""
    return [float(len(c) % 2) for c in completions]


@pytest.fixture
def binary_rewards(monkeypatch):
    from tests.support.rewards import stub_rewards

    for name in stub_rewards(monkeypatch):  # the modules that look the grader up, now on the stand-in
        monkeypatch.setattr(sys.modules[name], "score_completions", odd_length_reward)


def _filtered_run(monkeypatch, steps=6, s=2, schedule="deterministic", ckpt_dir=None, progress=None, **rl):
    cfg = with_overrides(preset("micro"), rl={"variant": "loglinear", "steps": steps, "max_staleness": s,
                                              "schedule": schedule, "filter_groups": True, **rl})
    trained: list = []
    step_fn = loop.train_step

    def recording(model, optimizer, scored, step, *args, **kwargs):
        trained.append(scored)
        return step_fn(model, optimizer, scored, step, *args, **kwargs)

    monkeypatch.setattr(loop, "train_step", recording)
    model, tok = build_tiny_model("micro", WORDS, seed=0)
    train, held, _ = load_rows(cfg.data, tok)
    res = rl_train(cfg, model, tok, train, held, ckpt_dir=ckpt_dir, warmstart_acc=0.0, progress=progress)
    return res, trained, clone_state(model)


def _signal(scored) -> list[bool]:
    ids = torch.tensor([m["group"] for m in scored.rollout.meta])
    return list(groups_with_signal(scored.rewards, ids).values())


@pytest.mark.parametrize("schedule", ["deterministic", "threaded"])
def test_no_group_without_signal_is_trained_while_the_cap_allows_a_refill_and_refills_keep_the_bound(
        binary_rewards, monkeypatch, schedule):
    s = 2
    res, trained, _ = _filtered_run(monkeypatch, steps=6, s=s, schedule=schedule, filter_max_prompts=40)
    refilled = 0
    for j, (scored, h) in enumerate(zip(trained, res.history, strict=True)):
        signal = _signal(scored)
        assert len(signal) == 4 and len(scored.rollout) == 8  # the batch keeps the size the bound counts
        assert sum(signal) == h["filter/signal_groups"]
        if h["filter/short_groups"] == 0:
            assert all(signal), (j, scored.rewards)
        refilled += h["filter/prompts_drawn"] > 4
        # never older than the batch's own first version (deterministic: j - s; threaded: the bound)
        versions = scored.rollout.versions[scored.rollout.response_mask]
        assert int(versions.min()) >= max(0, j - s), (j, versions.unique())
        assert h["staleness/max"] <= s
    assert refilled >= 3, [h["filter/prompts_drawn"] for h in res.history]  # refills did happen
    assert all(h["filter/signal_groups"] == 4 for h in res.history), [h["filter/signal_groups"] for h in res.history]


def test_a_filtered_run_resumed_from_a_checkpoint_equals_an_uninterrupted_one(binary_rewards, monkeypatch, tmp_path):
    full, _, w_full = _filtered_run(monkeypatch, steps=6)

    class Crash(Exception):
        pass

    def crash_at_5(step, metrics):
        if step == 5:
            raise Crash()

    with pytest.raises(Crash):
        _filtered_run(monkeypatch, steps=6, ckpt_dir=str(tmp_path), progress=crash_at_5)
    resumed, _, w_resumed = _filtered_run(monkeypatch, steps=6, ckpt_dir=str(tmp_path))
    assert resumed.resumed_from == 4

    def algorithmic(history):
        return [{k: v for k, v in h.items() if not k.startswith(("perf/", "time/")) and k not in
                 ("prox/time_s", "filter/refill_gen_s")} for h in history]

    assert algorithmic(resumed.history) == algorithmic(full.history)
    assert any(h["filter/prompts_drawn"] > 4 for h in full.history)
    assert all(torch.equal(w_full[k], w_resumed[k]) for k in w_full)


def test_a_drained_filter_names_the_step_the_fraction_and_the_likely_cause():
    history = [{"filter/signal_groups": 2.0}] + [
        {"filter/signal_groups": 0.0, "filter/filtered_frac": 1.0, "filter/prompts_drawn": 16.0, "reward/mean": 0.0}] * 3
    stop_if_drained(history[:3], patience=3, step=3)  # a step with signal among the last three: goes on
    with pytest.raises(SignalDrained, match=r"step 4: no group with signal in 3 steps in a row .* filtered fraction "
                                            r"1\.00 of 16 prompts drawn, reward/mean 0\.000; likely every reward 0"):
        stop_if_drained(history, patience=3, step=4)


def test_the_train_command_stops_a_drained_run_with_one_line(tmp_path):
    # The real grader on the random micro model: every reward 0 in the first steps.
    config = tmp_path / "filter.yaml"
    config.write_text("rl:\n  filter_groups: true\n  filter_patience: 2\n  filter_max_prompts: 8\n")
    proc = subprocess.run([sys.executable, "-m", "a3po.training.command", "--preset", "micro", "--steps", "6",
                           "--config", str(config), "--output-dir", str(tmp_path / "out"), "--no-progress"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("a3po train: step 2: no group with signal in 2 steps in a row"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = (tmp_path / "out" / "loglinear-seed0" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2  # the steps trained before the stop are kept


@pytest.mark.slow
def test_a_rollout_worker_filters_and_refills_as_the_trainers_own_producer_does(tmp_path):
    # The worker builds the same producer (a3po.placement.in_process.local_producer); its batches travel
    # with their filter/* figures. Deterministic: the two runs are equal bit for bit.
    from tests.support.cli_runs import assert_equal_runs, run_to_json, share_warmstart, step_metrics, train_command

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "DO_NOT_TRACK": "true",
           "PYTHONUNBUFFERED": "1"}

    def config(workers: int) -> Path:
        path = tmp_path / f"w{workers}.yaml"
        path.write_text("warm_start: {steps: 150, batch_size: 32}\n"
                        "rl: {steps: 6, batch_prompts: 8, group_size: 4, minibatches: 2, max_new_tokens: 12, lr: 1.0e-3,\n"
                        "     lr_warmup_steps: 0, eval_every: 3, checkpoint_every: 3, filter_groups: true,\n"
                        "     filter_max_prompts: 24}\n"
                        f"distributed: {{rollout_workers: {workers}}}\n")
        return path

    single = run_to_json(train_command(config(0), tmp_path / "single"), root, env)
    share_warmstart(tmp_path / "single", tmp_path / "two")
    two = run_to_json(train_command(config(1), tmp_path / "two", nproc=2), root, env)
    assert (two["world_size"], two["rollout_workers"]) == (1, 1)
    assert_equal_runs(single, two, 6, ignore=("filter/refill_gen_s",))
    steps = step_metrics(two)
    assert any(m["filter/prompts_drawn"] > 8 for m in steps.values()), steps  # refills happened in the worker
