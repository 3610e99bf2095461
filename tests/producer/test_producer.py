"""Asynchronous controller: the admission bound, the deterministic schedule's staleness (token
by token, and per step in a real micro run), bit-for-bit reproducibility and resume, and
sync = staleness 0.

Deterministic schedule (``a3po/producer/producer.py``), with ``s = max_staleness`` and ``M =
max_new_tokens``: batch ``j`` starts on version ``max(0, j - s)``; if ``s >= 1`` and
``j - s + 1 >= 1`` it switches to version ``j - s + 1`` before decode step ``M // 2``. The
trainer trains batch ``j`` at version ``j``, so a token's staleness is

    t <  M//2:  j - max(0, j - s) = min(j, s)
    t >= M//2:  s - 1              (when j >= s and s >= 1), else min(j, s)

so per step ``staleness/max = min(j, s)``: for s = 2, [0, 1, 2, 2, ...]; and
``staleness/mean`` is 0 at j = 0, 1 at j = 1, and in [1, 2] from j = 2 on (exactly 1.5 when no
row stops before step M).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from a3po.config import preset, with_overrides
from a3po.data.arithmetic import WORDS, generate_split
from a3po.data.datasets import load_rows
from a3po.models.factory import build_tiny_model
from a3po.producer.producer import Admission, PromptSampler, RolloutProducer
from a3po.producer.weight_store import Retention, Stopped, WeightStore, clone_state
from a3po.rollout.torch_engine import RolloutEngine
from a3po.rollout.types import SamplingParams
from a3po.storage.checkpoint import load_checkpoint
from a3po.training import loop
from a3po.training.loop import rl_train
from tests.support.producer_record import record_produced
from tests.support.rewards import stub_rewards

pytestmark = pytest.mark.usefixtures("core_one_thread")


def _wait_for(cond, timeout=60.0):
    # "Eventually" with room for a loaded machine: a pass returns as soon as cond() holds.
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            return False
        time.sleep(0.01)
    return True


# --- admission ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "s, expected",
    [
        # Batch size 4, versions 0, 1, 2. Sync (s = 0): at version v the trainer has consumed v
        # batches and the producer may hold exactly the next one: 4, 8, 12 samples admitted in all.
        (0, [4, 8, 12]),
        # s = 1: one batch more may be in flight (sampled by weights one version old).
        (1, [8, 12, 16]),
        (2, [12, 16, 20]),
    ],
)
def test_capacity_per_version(s, expected):
    adm = Admission(WeightStore(), max_staleness=s, batch_size=4)
    assert [adm.capacity(v) for v in range(3)] == expected


@pytest.mark.parametrize(
    "s, admitted_per_version",
    # batch size 3; at version v the producer fills v + 1 batches (sync), or s more (async);
    # versions 0..4 (the producer may run once more after the last publish, before close).
    [(0, [3, 6, 9, 12, 15]), (2, [9, 12, 15, 18, 21])],
)
def test_admission_never_exceeds_bound_and_blocks_until_a_new_version(s, admitted_per_version):
    bs = 3
    store = WeightStore()
    store.publish(0, {})
    adm = Admission(store, max_staleness=s, batch_size=bs)
    log: list[tuple[int, int]] = []  # (admitted after the call, newest version when it returned)
    done = threading.Event()

    def producer():
        try:
            for _ in range(50):
                adm.admit(bs)
                log.append((adm.admitted, store.latest))
        except Stopped:
            pass
        finally:
            done.set()

    th = threading.Thread(target=producer, daemon=True)
    th.start()
    try:
        for v in range(4):
            expected = admitted_per_version[v]  # then it blocks
            assert _wait_for(lambda expected=expected: adm.admitted == expected), (v, adm.admitted, expected)
            time.sleep(0.15)  # it stays blocked: no sample beyond the bound
            assert adm.admitted == expected
            assert not done.is_set()
            store.publish(v + 1, {})
        assert all(n <= admitted_per_version[latest] for n, latest in log)
    finally:
        store.close()  # unblocks the waiting producer with Stopped
        th.join(timeout=5)
    assert not th.is_alive()
    assert done.is_set()


def test_admit_of_more_than_the_bound_blocks_and_close_stops_it():
    store = WeightStore()
    store.publish(0, {})
    adm = Admission(store, max_staleness=1, batch_size=4)  # capacity at version 0: 8
    outcome = []

    def waiter():
        try:
            adm.admit(9)
            outcome.append("admitted")
        except Stopped:
            outcome.append("stopped")

    th = threading.Thread(target=waiter, daemon=True)
    th.start()
    th.join(timeout=0.3)
    assert th.is_alive() and outcome == []  # blocked
    store.close()
    th.join(timeout=5)
    assert outcome == ["stopped"] and adm.admitted == 0


def test_weight_store_keeps_recent_versions_only():
    # Deterministic, s = 2, 40 batches: after version L, batches j >= L read versions j - 2 and
    # j - 1, so versions L - 2 .. L stay and older ones go.
    store = WeightStore(Retention(max_staleness=2, schedule="deterministic", end=40))
    for v in range(6):
        store.publish(v, {"v": torch.tensor(v)})
    assert store.versions() == [3, 4, 5]
    assert int(store.get(5)["v"]) == 5
    with pytest.raises(KeyError, match="no longer kept"):
        store.get(2)


def test_a_huge_staleness_bound_keeps_only_the_versions_batches_can_read():
    # s = 10**9 with 40 batches: batch j starts on max(0, j - s) = 0 and never switches
    # (j - s + 1 < 1), so only version 0 and the newest are ever read again; a bound of
    # s + 2 versions would keep all 40.
    store = WeightStore(Retention(max_staleness=10**9, schedule="deterministic", end=40))
    for v in range(40):
        store.publish(v, {"v": torch.tensor(v)})
    assert store.versions() == [0, 39]
    # s = 30, versions 0..19 published: batches j >= 19 start on max(0, j - 30) (0, then 1..9)
    # and switch halfway to j - 29 (1..10 for j = 30..39): versions 0..10 and the newest, 19.
    store = WeightStore(Retention(max_staleness=30, schedule="deterministic", end=40))
    for v in range(20):
        store.publish(v, {"v": torch.tensor(v)})
    assert store.versions() == [*range(11), 19]


def test_threaded_store_keeps_what_a_producer_holds_and_the_newest():
    retention = Retention(max_staleness=10**9, schedule="threaded", end=40)
    store = WeightStore(retention)
    retention.hold("producer", 3)  # a batch in progress started on version 3
    for v in range(8):
        store.publish(v, {"v": torch.tensor(v)})
    assert store.versions() == [3, 4, 5, 6, 7]
    retention.release("producer")
    store.publish(8, {"v": torch.tensor(8)})
    assert store.versions() == [8]


# --- the deterministic schedule, token by token -------------------------------------------------


@pytest.mark.parametrize("s", [0, 1, 2])
def test_deterministic_schedule_token_versions(s):
    M, steps = 6, 5
    model, tok = build_tiny_model("micro", WORDS, seed=0)
    # Suppress EOS so every row decodes all M steps (both halves of the schedule are visible).
    h = model.lm_head.register_forward_hook(
        lambda mod, i, o: o + torch.nn.functional.one_hot(torch.tensor(tok.eos_token_id), o.shape[-1]) * -50.0
    )
    trainer_model, _ = build_tiny_model("micro", WORDS, seed=0)
    store = WeightStore()
    store.publish(0, clone_state(trainer_model))
    rows = generate_split(20, "train", 0)
    sampler = PromptSampler(rows, tok, batch_prompts=2, group_size=2, seed=0)
    producer = RolloutProducer(
        RolloutEngine(model, tok.eos_token_id, tok.pad_token_id, version=0), store,
        Admission(store, s, batch_size=4), sampler, SamplingParams(M), score=lambda c, m: [0.0] * len(c),
        decode=lambda ids: tok.decode(ids), max_staleness=s, schedule="deterministic", seed=0,
    )
    producer.start()
    try:
        for j in range(steps):
            sb = producer.next_batch(timeout=60)
            assert sb.index == j
            b = sb.rollout
            v = b.versions[:, b.prompt_len :]
            assert v.shape[1] == M and bool(b.response_mask[:, b.prompt_len :].all())
            first = max(0, j - s)
            second = j - s + 1 if (s >= 1 and j - s + 1 >= 1) else first
            assert v[:, : M // 2].eq(first).all(), (j, v)
            assert v[:, M // 2 :].eq(second).all(), (j, v)
            staleness = j - v
            assert int(staleness.max()) == min(j, s)
            # "train": any change of weights, then publish the next version
            with torch.no_grad():
                for p in trainer_model.parameters():
                    p.add_(0.01)
            store.publish(j + 1, clone_state(trainer_model))
    finally:
        producer.stop()
        producer.join(timeout=10)
        h.remove()
    assert not producer.is_alive()


# --- real micro runs through rl_train -----------------------------------------------------------


def _micro_run(variant="loglinear", steps=6, s=2, ckpt_dir=None, progress=None, schedule="deterministic"):
    cfg = with_overrides(preset("micro"), rl={"variant": variant, "steps": steps, "max_staleness": s, "schedule": schedule})
    model, tok = build_tiny_model("micro", WORDS, seed=0)
    train, held, _ = load_rows(cfg.data, tok)
    res = rl_train(cfg, model, tok, train, held, ckpt_dir=ckpt_dir, warmstart_acc=0.0, progress=progress)
    return res, clone_state(model)


def _algorithmic(history):
    """The per-step metrics that must not depend on timing."""
    return [{k: v for k, v in h.items() if not k.startswith(("perf/", "time/")) and k != "prox/time_s"} for h in history]


@pytest.fixture(scope="module")
def two_runs(core_one_thread):
    with pytest.MonkeyPatch.context() as mp:
        stub_rewards(mp)
        return _micro_run(), _micro_run()


def test_micro_run_staleness_per_step_follows_the_schedule(core_stub_rewards, two_runs):
    (res, _), _ = two_runs
    st_max = [h["staleness/max"] for h in res.history]
    st_mean = [h["staleness/mean"] for h in res.history]
    assert st_max == [0.0, 1.0, 2.0, 2.0, 2.0, 2.0]
    assert st_mean[:2] == [0.0, 1.0]
    assert all(1.0 <= m <= 2.0 for m in st_mean[2:])
    assert [h["version"] for h in res.history] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]


def test_two_runs_same_seed_are_bit_identical(core_stub_rewards, two_runs):
    (r1, w1), (r2, w2) = two_runs
    h1, h2 = _algorithmic(r1.history), _algorithmic(r2.history)
    assert h1 == h2  # exact float equality, every step, every metric
    assert any(h["loss/policy"] != 0.0 for h in h1)  # something was learned from (non-trivial losses)
    assert len({h["reward/mean"] for h in h1}) > 1
    assert r1.eval_curve == r2.eval_curve
    assert all(torch.equal(w1[k], w2[k]) for k in w1)


def test_sync_variant_has_zero_staleness_everywhere(core_stub_rewards):
    res, _ = _micro_run(variant="sync", steps=4, s=2)  # max_staleness is ignored by sync
    assert [h["staleness/max"] for h in res.history] == [0.0] * 4
    assert [h["staleness/mean"] for h in res.history] == [0.0] * 4
    # on-policy: behaviour weight pi_prox/pi_behav is exactly 1 (prox = behav)
    assert all(h["stability/behav_iw_mean"] == 1.0 for h in res.history)


@pytest.mark.parametrize("s", [0, 1, 2])
def test_threaded_schedule_trains_every_step_within_the_staleness_bound(core_stub_rewards, core_one_thread, s, monkeypatch):
    # The free-running producer loads the newest weights whenever they appear, so how stale a
    # token is depends on timing; what cannot depend on it: every step trains its own batch in
    # order, no token is staler than the bound, and with s = 0 the run is on-policy.
    # To see that the producer does run ahead, the first train step waits until batches 0..s are
    # made: they can only be sampled by version 0, so step j <= s trains tokens j versions stale.
    produced = record_produced(monkeypatch)
    train_step = loop.train_step

    def after_the_producer_ran_ahead(model, optimizer, scored, step, *args, **kwargs):
        if step == 0:
            _wait_for(lambda: len(produced) > s, timeout=30.0)  # a producer that cannot run ahead fails below
        return train_step(model, optimizer, scored, step, *args, **kwargs)

    monkeypatch.setattr(loop, "train_step", after_the_producer_ran_ahead)
    res, _ = _micro_run(steps=8, s=s, schedule="threaded")
    assert [h["version"] for h in res.history] == [float(v) for v in range(1, 9)]
    st_max = [h["staleness/max"] for h in res.history]
    assert all(0.0 <= m <= s for m in st_max), st_max
    assert st_max[: s + 1] == [float(j) for j in range(s + 1)], st_max  # s = 0: on-policy from the start
    if s == 0:
        assert st_max == [0.0] * 8
    assert all(torch.isfinite(torch.tensor(h["loss/policy"])) for h in res.history)


class _Crash(Exception):
    pass


def test_resumed_run_equals_uninterrupted_run(core_stub_rewards, two_runs, tmp_path):
    (full, w_full), _ = two_runs

    def crash_at_5(step, metrics):
        if step == 5:  # after the step-4 checkpoint (checkpoint_every = 2), before step 6's
            raise _Crash()

    with pytest.raises(_Crash):
        _micro_run(ckpt_dir=str(tmp_path), progress=crash_at_5)
    resumed, w_resumed = _micro_run(ckpt_dir=str(tmp_path))
    assert resumed.resumed_from == 4
    assert _algorithmic(resumed.history) == _algorithmic(full.history)
    assert all(torch.equal(w_full[k], w_resumed[k]) for k in w_full)


def test_a_huge_staleness_bound_checkpoints_version_0_and_the_newest_and_resumes_exactly(core_stub_rewards, tmp_path):
    # s = 10**9 (deterministic): every batch starts on version 0 and none switches, so the step-4
    # checkpoint needs version 0 (batches 4.. regenerate from it) and 4 (the policy), not 0..4.
    s = 10**9
    full, w_full = _micro_run(s=s)

    def crash_at_5(step, metrics):
        if step == 5:
            raise _Crash()

    with pytest.raises(_Crash):
        _micro_run(s=s, ckpt_dir=str(tmp_path), progress=crash_at_5)
    assert sorted(load_checkpoint(tmp_path / "step_000004")["weights_history"]) == [0, 4]
    resumed, w_resumed = _micro_run(s=s, ckpt_dir=str(tmp_path))
    assert resumed.resumed_from == 4
    assert _algorithmic(resumed.history) == _algorithmic(full.history)
    assert all(torch.equal(w_full[k], w_resumed[k]) for k in w_full)
