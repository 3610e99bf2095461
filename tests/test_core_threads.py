"""Intra-op threads of the training update (:mod:`a3po.training.threads`): which runs give it every core,
the torch behaviour that rests on (a thread's count is its own; a new thread takes the count last
set when it runs its first op), and that an update gives the same bits on more threads."""

from __future__ import annotations

import threading

import pytest
import torch

from a3po.config import preset, with_overrides
from a3po.training.threads import intra_op_threads, producer_and_trainer_alternate, update_threads, usable_cores


def _cfg(variant: str, **sections):
    return with_overrides(preset("micro"), rl={"variant": variant}, **sections)


def test_sync_in_one_process_trains_on_every_core_async_variants_keep_torch_threads():
    assert producer_and_trainer_alternate(_cfg("sync"))
    assert update_threads(_cfg("sync")) == usable_cores()
    assert update_threads(_cfg("sync", torch_threads=usable_cores() + 3)) == usable_cores() + 3  # never fewer than asked
    assert update_threads(_cfg("sync", update_threads=1)) == 1  # e.g. on a machine busy with other work
    assert update_threads(_cfg("loglinear", update_threads=3)) == 1  # overlapping threads keep torch_threads
    for variant in ("recompute", "loglinear"):  # the producer decodes while the trainer trains
        assert not producer_and_trainer_alternate(_cfg(variant))
        assert update_threads(_cfg(variant, torch_threads=1)) == 1


def test_thread_counts_are_checked_when_the_config_is_built():
    with pytest.raises(ValueError, match="update_threads >= 0"):
        _cfg("sync", update_threads=-1)


def test_sync_with_other_processes_on_the_machine_keeps_torch_threads():
    cfg = _cfg("sync", distributed={"rollout_workers": 1})
    assert not producer_and_trainer_alternate(cfg)
    assert update_threads(cfg) == cfg.torch_threads == 1


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
    from a3po.rollout.torch_engine import RolloutEngine, SamplingParams
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

