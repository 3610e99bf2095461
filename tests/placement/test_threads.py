"""Intra-op threads of the training update (:mod:`a3po.placement.cores`): the torch behaviour the
thread budgets rest on (a thread's count is its own; a new thread takes the count last set when it
runs its first op), that an update gives the same bits on more threads, and the cores each process
owns. Which runs give a phase every core is the run plan's (tests/config/test_plan.py)."""

from __future__ import annotations

import multiprocessing
import os
import threading

import pytest
import torch

from a3po.config import preset, with_overrides
from a3po.parallel.ranks import Ranks
from a3po.placement.cores import (
    core_slices,
    local_roles,
    own_cores,
    usable_core_ids,
    usable_cores,
)
from a3po.training.threads import intra_op_threads


def _cfg(variant: str, **sections):
    return with_overrides(preset("micro"), rl={"variant": variant}, **sections)


def test_thread_counts_are_checked_when_the_config_is_built():
    for field in ("update_threads", "generate_threads"):
        with pytest.raises(ValueError, match="update_threads and generate_threads >= 0"):
            _cfg("sync", **{field: -1})


def _count_in_new_thread() -> int:
    seen = []
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    t.start()
    t.join()
    return seen[0]


def test_torch_thread_counts_are_per_thread_and_new_threads_take_the_last_set():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        assert _count_in_new_thread() == 3  # the producer thread starts after rl_train sets the count
        torch.set_num_threads(1)
        assert _count_in_new_thread() == 1

        def own_count():
            torch.set_num_threads(2)

        t = threading.Thread(target=own_count)
        t.start()
        t.join()
        assert torch.get_num_threads() == 1  # another thread's setting leaves this one's alone
    finally:
        torch.set_num_threads(before)


def test_intra_op_threads_restores_the_count():
    before = torch.get_num_threads()
    with intra_op_threads(before + 2):
        assert torch.get_num_threads() == before + 2
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("threads", [2, 3])
def test_a_training_update_is_bitwise_the_same_whatever_the_thread_count(threads):
    """Giving sync's updates every core must not change a run: one train_step of the tiny
    architecture (random weights) on one rollout, with 1 and with ``threads`` intra-op threads,
    compared bit for bit (weights after the update and every metric but timings)."""
    from a3po.algorithms.optimizers import adamw
    from a3po.algorithms.proximal import PROXIMAL_METHODS
    from a3po.config import RLConfig
    from a3po.data.arithmetic import WORDS
    from a3po.models.factory import build_tiny_model
    from a3po.producer.producer import ScoredBatch
    from a3po.producer.weight_store import clone_state
    from a3po.rollout.torch_engine import RolloutEngine
    from a3po.rollout.types import SamplingParams
    from a3po.training.step import train_step

    model, tok = build_tiny_model("tiny", WORDS, seed=0)
    prompts = [tok(f"{a} {b}", add_special_tokens=False)["input_ids"] for a in WORDS[:8] for b in WORDS[:4]]
    with intra_op_threads(1):
        batch = RolloutEngine(model, tok.eos_token_id, tok.pad_token_id).generate_batch(
            prompts, SamplingParams(12, 1.0), seed=5, meta=[{"group": i // 4} for i in range(len(prompts))])
    rewards = torch.arange(len(prompts), dtype=torch.float32) % 3  # varies within every group of 4
    rl = RLConfig(variant="sync", batch_prompts=8, group_size=4, minibatches=2, max_new_tokens=12, temperature=1.0, lr=1e-2)
    start = clone_state(model)

    def update(n: int):
        model.load_state_dict(start)
        opt = adamw(model.parameters(), rl.lr)  # the trainer's (fused on the CPU)
        with intra_op_threads(n):
            m = train_step(model, opt, ScoredBatch(0, batch, rewards, [], 0.0), 0, rl, PROXIMAL_METHODS.get("behaviour"))
        return clone_state(model), {k: v for k, v in m.items() if not k.startswith(("perf/", "prox/time"))}

    (w1, m1), (wn, mn) = update(1), update(threads)
    assert not torch.equal(w1["model.norm.weight"], start["model.norm.weight"])  # the update moved the weights
    assert all(torch.equal(w1[k], wn[k]) for k in w1)
    assert m1 == mn



# --- the placements' core ownership (a3po.placement.cores) ---------------------------------------


def test_core_slices_give_workers_the_top_cores_and_trainers_the_rest():
    # 1 trainer + 1 worker on cores 0..3, 1 core per worker: the worker takes core 3.
    assert core_slices([0, 1, 2, 3], [False, True], 1) == [(0, 1, 2), (3,)]
    # 2 trainers + 2 workers of 2 cores on 8 cores (listed unsorted): workers 7-6 and 5-4, trainers split 0..3.
    assert core_slices([7, 6, 5, 4, 3, 2, 1, 0], [False, False, True, True], 2) == [(0, 1), (2, 3), (6, 7), (4, 5)]
    # 2 trainers over 3 cores left: one each, the odd core unused so the ranks are alike.
    assert core_slices([0, 1, 2, 3, 4], [False, False, True], 2) == [(0,), (1,), (3, 4)]
    # A node of workers only (trainers on another node).
    assert core_slices([0, 1], [True, True], 1) == [(1,), (0,)]


def test_core_slices_refuse_a_role_without_a_core():
    with pytest.raises(ValueError, match="rollout_cores 2: 1 rollout worker.*need 3 cores.*may use 2"):
        core_slices([0, 1], [False, True], 2)
    with pytest.raises(ValueError, match="2 trainer rank"):
        core_slices([0, 1], [False, False, True], 1)


def test_local_roles_follow_torchrun_rank_blocks():
    # 2 nodes of 2 processes, 3 trainer ranks + 1 worker: node 1 holds ranks 2 (trainer) and 3 (worker).
    ranks = Ranks(rank=3, world_size=3, local_rank=1, rollout_workers=1)
    assert local_roles(ranks, {"LOCAL_WORLD_SIZE": "2"}) == [False, True]
    assert local_roles(Ranks(rank=0, world_size=1, local_rank=0, rollout_workers=2), {}) == [False, True, True]


def test_rollout_cores_need_a_rollout_worker():
    with pytest.raises(ValueError, match="rollout_cores is set but distributed.rollout_workers is 0"):
        _cfg("sync", distributed={"rollout_cores": 1})
    assert _cfg("sync", distributed={"rollout_workers": 1, "rollout_cores": 1}).distributed.rollout_cores == 1


def _pinned_child(conn) -> None:
    ranks = Ranks(rank=1, world_size=1, local_rank=1, rollout_workers=1)
    cfg = _cfg("loglinear", distributed={"rollout_workers": 1, "rollout_cores": 1})
    mine = own_cores(cfg, ranks, {"LOCAL_WORLD_SIZE": "2"})
    conn.send((mine, sorted(os.sched_getaffinity(0))))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or usable_cores() < 2, reason="needs CPU affinity and 2 cores")
def test_a_rollout_worker_pins_itself_to_its_cores():
    # A child process: the test's own affinity stays as it is. Forked, not spawned (no second torch
    # import); the child runs no torch op, so the parent's OpenMP pool cannot deadlock it.
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_pinned_child, args=(child,))
    p.start()
    mine, mask = parent.recv()
    p.join(30)
    top = usable_core_ids()[-1]
    assert mine == (top,) and mask == [top]
