"""Held-out evaluation beside training (``rl.eval_mode: background``, a3po.training.evaluations): a
micro run's figures, completion tables, final weights and checkpoints equal the inline run's (a
checkpoint's own evaluation recorded pending instead of its figure), a figure finished late is
logged at its version's step, the evaluation of a checkpoint step overlaps the next update, the
last step collects every evaluation, a failure is raised in the trainer's thread naming the step,
a crash with an evaluation in flight (past the checkpoint, or the checkpoint's own) loses nothing,
the config refuses what cannot run, and a snapshot is the model as it was when taken."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import a3po.training.evaluations as evaluations
import a3po.training.loop as loop
from a3po.config import ConfigError, LoraConfig, config_from_dict, preset, with_overrides
from a3po.data.arithmetic import WORDS
from a3po.data.datasets import load_rows
from a3po.devices import autocasts, set_autocast
from a3po.models.factory import build_tiny_model, snapshot
from a3po.models.lora import apply_lora
from a3po.storage.checkpoint import CheckpointError, checkpoint_candidates, load_checkpoint
from a3po.training.completions import read_table, table_path, table_steps
from a3po.training.evaluations import EvaluationFailed
from a3po.training.loop import rl_train
from a3po.training.metrics import JsonlLogger, read_metrics_jsonl
from a3po.training.run_state import PendingEvaluation, RunState
from tests.support.resume import Crash, assert_same_final_state, crash_after, run_interrupted_and_resumed, without_timing

# An evaluation at every step and a checkpoint every second one: version 1 is evaluated between
# checkpoints, version 2 on a checkpoint step; small tables (4 training and 4 held-out rows). At
# this rate every version's figures differ (0.039, 0.064, 0.057, 0.054): equal figures are the
# same version's.
OVERRIDES = {"steps": 4, "eval_every": 1, "checkpoint_every": 2, "log_completions": 8, "lr": 1e-2,
             "lr_warmup_steps": 0, "lr_schedule": "constant"}
# The presets' layout in small: every evaluation step (2, 4) a checkpoint step.
ON_CHECKPOINTS = {**OVERRIDES, "eval_every": 2}
EVAL_KEYS = {"eval/heldout_acc", "eval/heldout_greedy_acc"}


class Recorder:
    """A metric logger that keeps every call, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.calls.append((step, dict(metrics)))


def _run(folder: Path, mode: str, progress=None, logger=None, ckpt_dir: str | None = None, overrides=OVERRIDES):
    cfg = with_overrides(preset("micro"), rl={**overrides, "eval_mode": mode})
    model, tok = build_tiny_model("micro", WORDS, seed=0)
    train, held, _ = load_rows(cfg.data, tok)
    ckpt_dir = ckpt_dir or str(folder / "checkpoints")
    return rl_train(cfg, model, tok, train, held, ckpt_dir=ckpt_dir, logger=logger, warmstart_acc=0.0,
                    progress=progress, completions_dir=str(folder / "completions"))


def _hold_background(mp: pytest.MonkeyPatch, holds: dict[int, int]) -> None:
    """Hold the background evaluation of each version ``v`` of ``holds`` until the trainer has
    updated the policy to version ``holds[v]``: one evaluated in the meantime reads a policy that
    moved on, and one collected before that update would wait for ever (the test times out)."""
    gates = {v: threading.Event() for v in holds}
    evaluate, update = evaluations.heldout_evaluation, loop.train_step

    def held_back(*args, **kwargs):
        name = threading.current_thread().name  # "heldout-eval-<version>" (a3po.training.evaluations)
        version = int(name.rpartition("-")[2]) if name.startswith("heldout-eval-") else None
        if version in gates:
            assert gates[version].wait(120), f"the trainer never made version {holds[version]}"
        return evaluate(*args, **kwargs)

    def train_step(*args, **kwargs):
        metrics = update(*args, **kwargs)
        for v, until in holds.items():
            if args[3] + 1 == until:  # the step index: this update made version step + 1
                gates[v].set()
        return metrics

    mp.setattr(evaluations, "heldout_evaluation", held_back)
    mp.setattr(loop, "train_step", train_step)


def _tables(folder: Path) -> dict[int, list[dict]]:
    return {s: read_table(table_path(folder / "completions", s)) for s in table_steps(folder / "completions")}


def _eval_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("heldout-eval-") and t.is_alive()}


def _merged_lines(path: Path) -> list[dict]:
    """A metrics file's lines of steps 1.. merged by step (as its readers do), timings left out."""
    by_step: dict[int, dict] = {}
    for row in read_metrics_jsonl(path):
        by_step.setdefault(row["step"], {}).update(row)
    return without_timing([by_step[s] for s in sorted(by_step) if s > 0])


def _train_rows(table: list[dict]) -> list[dict]:
    return [r for r in table if r["source"] == "train"]


@pytest.fixture(scope="module")
def runs(core_one_thread, tmp_path_factory):
    """The inline run and the background run, each with its logged calls and its folder. In the
    background run version 1's evaluation is held until the policy is at version 2 (so it is
    collected at step 2), and version 2's, started at the checkpoint of step 2, until version 3
    (collected at step 3: it ran beside the update of step 3)."""
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        from tests.support.rewards import stub_rewards

        stub_rewards(mp)
        inline_log = Recorder()
        folder = tmp_path_factory.mktemp("inline")
        out["inline"] = (_run(folder, "inline", logger=inline_log), inline_log, folder)
        _hold_background(mp, {1: 2, 2: 3})
        recorder, folder, before = Recorder(), tmp_path_factory.mktemp("background"), _eval_threads()
        out["background"] = (_run(folder, "background", logger=recorder), recorder, folder)
        out["left_running"] = _eval_threads() - before
    return out


def test_background_figures_tables_and_final_weights_equal_the_inline_ones(runs):
    (inline, _, inline_dir), (background, _, background_dir) = runs["inline"], runs["background"]
    assert [s for s, _ in inline.eval_curve] == [0, 1, 2, 3, 4]
    assert len({acc for _, acc in inline.eval_curve}) == 5  # each version its own figure
    assert background.eval_curve == inline.eval_curve  # the figures themselves, bit for bit
    assert without_timing(background.history) == without_timing(inline.history)
    assert all(EVAL_KEYS <= m.keys() for m in background.history)  # merged into every evaluated step's entry
    assert _tables(background_dir) == _tables(inline_dir) and sorted(_tables(inline_dir)) == [1, 2, 3, 4]
    # The last checkpoint (the final weights) holds what the inline run's holds: every figure.
    ia, ib = (checkpoint_candidates(d / "checkpoints") for d in (inline_dir, background_dir))
    assert [s for s, _ in ia] == [s for s, _ in ib] == [4, 2]
    a, b = load_checkpoint(ia[0][1]), load_checkpoint(ib[0][1])
    assert a["eval_curve"] == b["eval_curve"] and len(a["eval_curve"]) == 5
    assert without_timing(a["history"]) == without_timing(b["history"])
    assert "pending_evaluation" not in a and "pending_evaluation" not in b  # the last step waits for its own
    assert a["policy"].keys() == b["policy"].keys()
    assert all(torch.equal(a["policy"][k], b["policy"][k]) for k in a["policy"])


def test_a_checkpoint_records_its_own_steps_evaluation_as_pending(runs):
    # By design the background checkpoint of step 2 differs from the inline one: version 2's
    # evaluation was still running when it was written, so it holds the figures up to version 1
    # and records version 2's as pending, with the training rows of step 2's table.
    (inline, _, inline_dir), (_, _, background_dir) = runs["inline"], runs["background"]
    a, b = (load_checkpoint(dict(checkpoint_candidates(d / "checkpoints"))[2]) for d in (inline_dir, background_dir))
    assert a["eval_curve"] == [list(p) for p in inline.eval_curve[:3]] and "pending_evaluation" not in a
    assert b["eval_curve"] == a["eval_curve"][:2]  # (0, warm start), (1, ...): not 2
    rows = _train_rows(_tables(inline_dir)[2])
    assert len(rows) == 4 and b["pending_evaluation"] == {"version": 2, "train_rows": [
        {k: v for k, v in r.items() if k != "step"} for r in rows]}
    ha, hb = without_timing(a["history"]), without_timing(b["history"])
    assert hb[0] == ha[0] and EVAL_KEYS <= ha[1].keys()
    assert hb[1] == {k: v for k, v in ha[1].items() if k not in EVAL_KEYS}  # step 2's entry without its figures
    assert all(torch.equal(a["policy"][k], b["policy"][k]) for k in a["policy"])  # version 2 in both


def test_the_evaluation_of_a_checkpoint_step_overlaps_the_next_update_and_the_last_step_collects_all(runs):
    (_, inline_log, _), (_, recorder, _) = runs["inline"], runs["background"]
    # Version 2's evaluation, started at the checkpoint of step 2, was held until the update of
    # step 3 had made version 3: it ran beside that update, and came in at step 2 during step 3.
    steps = [s for s, _ in recorder.calls]
    assert steps == [1, 1, 2, 2, 3, 3, 4]
    assert not EVAL_KEYS & recorder.calls[2][1].keys()  # step 2's line, then its figures
    assert recorder.calls[3][1] == {k: inline_log.calls[1][1][k] for k in EVAL_KEYS}
    # The last step: version 3's collected (a call at step 3), version 4's evaluated in the trainer's
    # thread and merged into step 4's line; no evaluation thread left running after the run.
    assert recorder.calls[5][1].keys() == EVAL_KEYS and EVAL_KEYS <= recorder.calls[6][1].keys()
    assert runs["left_running"] == set()


def test_a_figure_is_logged_at_its_versions_step(runs):
    (_, inline_log, _), (background, recorder, _) = runs["inline"], runs["background"]
    # Inline: one call per step, the figures in it.
    assert [s for s, _ in inline_log.calls] == [1, 2, 3, 4]
    assert all(EVAL_KEYS <= m.keys() for _, m in inline_log.calls)
    # Background: version 1's evaluation was held until version 2 was made, so step 1's line went
    # out without it and its figures came in a call of their own at step 1, after that line.
    steps = [s for s, _ in recorder.calls]
    assert steps[:3] == [1, 1, 2]
    first, late = recorder.calls[0][1], recorder.calls[1][1]
    assert not EVAL_KEYS & first.keys()
    assert late == {k: inline_log.calls[0][1][k] for k in EVAL_KEYS}
    # Every version's figures reached the logger once, at its own step, equal to the inline ones.
    logged = {(s, k): v for s, m in recorder.calls for k, v in m.items() if k in EVAL_KEYS}
    assert logged == {(s, k): v for s, m in inline_log.calls for k, v in m.items() if k in EVAL_KEYS}
    # Version 4, the last step's, is evaluated in the trainer's thread: merged into its line as inline.
    assert EVAL_KEYS <= dict(recorder.calls)[4].keys()
    assert background.history[0]["time/eval_wait_s"] >= 0 and all("time/eval_wait_s" in m for m in background.history)


def test_a_failed_background_evaluation_is_raised_naming_its_step(core_one_thread, core_stub_rewards, tmp_path,
                                                                  monkeypatch):
    def fails(*args, **kwargs):
        raise ValueError("no memory for the evaluation")

    monkeypatch.setattr(evaluations, "heldout_evaluation", fails)  # warm start given: only the loop's run
    with pytest.raises(EvaluationFailed, match="evaluation of step 1 failed: ValueError: no memory") as e:
        _run(tmp_path, "background")
    assert isinstance(e.value.__cause__, ValueError)


def test_a_crash_with_an_evaluation_in_flight_loses_no_figure(runs, core_one_thread, core_stub_rewards, tmp_path):
    # Crashed after step 3, whose evaluation is in flight (or just collected): the checkpoint of
    # step 2 holds every figure up to 1 and version 2's evaluation pending; the resumed run
    # evaluates version 2 from the checkpoint's weights, then 3 and 4 again.
    resumed = run_interrupted_and_resumed(
        lambda ckpt, progress: _run(tmp_path, "background", progress=progress, ckpt_dir=ckpt), tmp_path / "ckpt", 3)
    assert resumed.resumed_from == 2
    assert_same_final_state(runs["inline"][0], resumed)
    assert _tables(tmp_path) == _tables(runs["inline"][2])


def test_a_crash_right_after_a_checkpoint_with_its_evaluation_in_flight_resumes_to_the_inline_record(
        core_one_thread, core_stub_rewards, tmp_path, monkeypatch):
    # Evaluations at steps 2 and 4, both checkpoint steps. Version 2's background evaluation is held
    # until the trainer makes version 4, so it is still running when the run crashes after step 3
    # (the checkpoint of step 2 written). The resumed run evaluates the restored weights first.
    inline_dir = tmp_path / "inline"
    inline = _run(inline_dir, "inline", logger=JsonlLogger(inline_dir / "metrics.jsonl"), overrides=ON_CHECKPOINTS)
    assert [s for s, _ in inline.eval_curve] == [0, 2, 4]
    _hold_background(monkeypatch, {2: 4})
    folder = tmp_path / "background"

    def run(progress):
        return _run(folder, "background", progress=progress, logger=JsonlLogger(folder / "metrics.jsonl"),
                    overrides=ON_CHECKPOINTS)

    with pytest.raises(Crash):
        run(crash_after(3))
    assert not any(EVAL_KEYS & row.keys() for row in read_metrics_jsonl(folder / "metrics.jsonl"))  # none collected
    assert table_steps(folder / "completions") == []
    state = load_checkpoint(dict(checkpoint_candidates(folder / "checkpoints"))[2])
    assert state["eval_curve"] == [[0, 0.0]] and state["pending_evaluation"]["version"] == 2
    resumed = run(None)
    assert resumed.resumed_from == 2
    assert_same_final_state(inline, resumed)  # eval curve and history
    assert _merged_lines(folder / "metrics.jsonl") == _merged_lines(inline_dir / "metrics.jsonl")
    # The rewound file has step 2's line from the checkpoint, then the figures the resumed run measured.
    step2 = [row for row in read_metrics_jsonl(folder / "metrics.jsonl") if row["step"] == 2]
    assert len(step2) == 2 and step2[1].keys() == {"step"} | EVAL_KEYS
    assert _tables(folder) == _tables(inline_dir) and sorted(_tables(folder)) == [2, 4]
    # The table of step 2 was written from the training rows the checkpoint kept.
    assert _train_rows(_tables(folder)[2]) == [{"step": 2, **r} for r in state["pending_evaluation"]["train_rows"]]


def test_a_checkpoints_pending_evaluation_is_checked_and_optional(runs):
    state = load_checkpoint(dict(checkpoint_candidates(runs["background"][2] / "checkpoints"))[2])
    assert RunState.from_checkpoint(state, "c").pending_evaluation == PendingEvaluation(
        2, state["pending_evaluation"]["train_rows"])
    # Written before the field existed (or nothing pending): resumed as before.
    assert RunState.from_checkpoint({k: v for k, v in state.items() if k != "pending_evaluation"},
                                    "c").pending_evaluation is None
    with pytest.raises(CheckpointError, match="not the evaluation of its step 2"):
        RunState.from_checkpoint({**state, "pending_evaluation": {"version": 1, "train_rows": None}}, "c")


def test_config_refuses_what_background_evaluation_cannot_run_naming_the_field():
    assert config_from_dict({}).rl.eval_mode == "inline"
    with pytest.raises(ConfigError, match=r"rl\.eval_mode"):
        config_from_dict({"rl": {"eval_mode": "sideways"}})
    ds = {"distributed": {"deepspeed_config": "zero3.json"}}
    config_from_dict({**ds, "rl": {"eval_mode": "inline"}})
    with pytest.raises(ConfigError, match=r"rl\.eval_mode 'background' with distributed\.deepspeed_config"):
        config_from_dict({**ds, "rl": {"eval_mode": "background"}})


def test_a_snapshot_is_the_model_as_it_was(core_one_thread):
    model, _ = build_tiny_model("micro", WORDS, seed=0)
    policy = apply_lora(model, LoraConfig(r=4, alpha=8.0))
    set_autocast(policy, True)
    copy = snapshot(policy)
    frozen = [n for n, p in policy.named_parameters() if not p.requires_grad]
    params = dict(copy.named_parameters())
    assert frozen and all(params[n] is p for n, p in policy.named_parameters() if not p.requires_grad)  # shared
    assert all(params[n] is not p for n, p in policy.named_parameters() if p.requires_grad)
    assert autocasts(copy) and type(copy) is type(policy)  # peft's layers and the autocast mark come along
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        for p in policy.parameters():
            if p.requires_grad:
                p.add_(0.1)  # the policy trains on after the snapshot; B was 0: now the adapters act
        moved, kept = policy(ids).logits, copy(ids).logits
        assert not torch.equal(moved, kept)
        fresh = apply_lora(build_tiny_model("micro", WORDS, seed=0)[0], LoraConfig(r=4, alpha=8.0))
        assert torch.equal(kept, fresh(ids).logits)  # the copy computes what the policy did when it was taken


def test_a_stop_with_an_evaluation_in_flight_cancels_it_and_joins_its_thread(core_one_thread, core_stub_rewards,
                                                                            tmp_path, monkeypatch):
    # Version 1's evaluation is held till it is cancelled, so it runs when the trainer stops right after
    # starting it (step 1's report); it then decodes for real and must stop at its first token.
    # A thread left running here is one left in torch code at interpreter exit: a native abort.
    real, seen = evaluations.heldout_evaluation, []

    def held_till_cancelled(*args, cancel=None, **kwargs):
        if threading.current_thread().name == "heldout-eval-1":
            assert cancel is not None and cancel.wait(120), "the trainer never cancelled the evaluation in flight"
            try:
                return real(*args, cancel=cancel, **kwargs)
            except BaseException as e:
                seen.append(type(e).__name__)
                raise
        return real(*args, cancel=cancel, **kwargs)

    monkeypatch.setattr(evaluations, "heldout_evaluation", held_till_cancelled)
    with pytest.raises(Crash):
        _run(tmp_path, "background", progress=crash_after(1))
    assert not _eval_threads()
    assert seen == ["DecodingCancelled"]


def test_a_cancelled_decoding_stops_at_its_next_token_and_an_unset_event_changes_nothing():
    from a3po.rollout.torch_engine import DecodingCancelled, generate_text
    from a3po.rollout.types import SamplingParams

    model, tok = build_tiny_model("micro", WORDS, seed=0)
    params = SamplingParams(6, temperature=1.0)
    prompts = ["1 + 2 =", "3 + 4 ="]
    assert generate_text(model, tok, prompts, params, seed=3, cancel=threading.Event()) == \
        generate_text(model, tok, prompts, params, seed=3)
    stop = threading.Event()
    stop.set()
    with pytest.raises(DecodingCancelled, match="at token 0"):
        generate_text(model, tok, prompts, params, seed=3, cancel=stop)
