"""OPPO inter-step overlap (a3po.oppo.overcommit): the Delta rule, the carry-over buffer, and the
ledger of every admitted prompt group from admission to training across a checkpoint and
resume taken while sequences are carried over (none lost, none trained twice); a resumed
OPPO run equals an uninterrupted one bit for bit; config bounds."""

from __future__ import annotations

import json

import pytest
import torch

from a3po.config import ConfigError, preset, with_overrides
from a3po.data.arithmetic import WORDS, generate_split
from a3po.data.datasets import load_rows
from a3po.models.factory import build_tiny_model
from a3po.oppo.overcommit import CarryBuffer, DeltaController, OverlapProducer, pack_rollout, reward_slope
from a3po.producer.producer import Admission, PromptSampler
from a3po.producer.weight_store import WeightStore, clone_state
from a3po.rollout.torch_engine import RolloutEngine
from a3po.rollout.types import SamplingParams
from a3po.storage.checkpoint import load_checkpoint, save_checkpoint
from a3po.training.loop import rl_train
from tests.support.ledger import assert_every_group_trained_once
from tests.support.resume import assert_same_final_state, run_interrupted_and_resumed

pytestmark = pytest.mark.usefixtures("core_one_thread")


# --- pure logic ---------------------------------------------------------------------------------


def test_reward_slope_is_the_least_squares_slope():
    # y = 2x + 1 -> 2; (0, 1, 0, 1): x_mean 1.5, sum (x-1.5)(y-0.5) = 0.75+(-0.25)+(-0.25)+0.75... = 1.0 / 5 = 0.2
    assert reward_slope([1.0, 3.0, 5.0]) == pytest.approx(2.0)
    assert reward_slope([0.0, 1.0, 0.0, 1.0]) == pytest.approx(0.2)
    assert reward_slope([4.0]) == 0.0


def test_delta_grows_while_the_reward_rises_and_shrinks_otherwise_within_bounds():
    c = DeltaController(delta=2, delta_min=1, delta_max=4, delta_grow=1, delta_shrink=2, window=3)
    # one point: no slope, no change; then rising: +1 up to the cap of 4
    assert [c.update(r) for r in (0.1, 0.2, 0.3, 0.4, 0.5)] == [2, 3, 4, 4, 4]
    # window (0.4, 0.5, 0.5) still rises; then (0.5, 0.5, 0.5) flat: -2; then falling: floor 1
    assert [c.update(r) for r in (0.5, 0.5, 0.4)] == [4, 2, 1]
    assert c.rewards == [0.5, 0.5, 0.4]


def test_buffer_takes_the_first_complete_groups_and_round_trips_json():
    buf = CarryBuffer(max_new_tokens=3)
    for g in range(3):
        buf.admit(g, [[1, 2], [1, 2]], [{"id": f"p{g}"}] * 2, step=0)
    with pytest.raises(ValueError, match="admitted twice"):
        buf.admit(1, [[1]], [{}], step=0)
    s = buf.groups
    buf.extend(s[2][0], [5], [-0.5], [0], finished=True, step=0)  # EOS after 1 token
    buf.extend(s[2][1], [6, 7, 8], [-1.0, -1.0, -1.0], [0, 0, 0], finished=False, step=0)  # budget reached
    buf.extend(s[0][0], [5, 6], [-0.1, -0.2], [0, 0], finished=False, step=0)  # still generating
    assert buf.complete() == [2] and [x.group for x in buf.active()] == [0, 0, 1, 1]
    restored = CarryBuffer(3)
    restored.load_state_dict(json.loads(json.dumps(buf.state_dict())))
    assert restored.state_dict() == buf.state_dict()
    taken = restored.take(1)
    assert [x.group for x in taken[0]] == [2, 2] and 2 not in restored.groups
    with pytest.raises(RuntimeError, match="only 0 complete groups"):
        restored.take(1)


def test_pack_rollout_keeps_each_tokens_logp_and_version():
    buf = CarryBuffer(max_new_tokens=4)
    buf.admit(7, [[1, 2, 3], [4]], [{"id": "a"}, {"id": "a"}], step=1)
    a, b = buf.groups[7]
    buf.extend(a, [9], [-0.25], [1], finished=False, step=1)
    buf.extend(a, [10], [-0.5], [2], finished=True, step=2)
    buf.extend(b, [11, 12, 13, 14], [-1.0, -2.0, -3.0, -4.0], [2, 2, 2, 2], finished=False, step=2)
    batch = pack_rollout(buf.take(1), pad_id=0)
    # prompt width 3, answer width 4: row 0 = [1 2 3 | 9 10 . .], row 1 = [. . 4 | 11 12 13 14]
    assert batch.input_ids.tolist() == [[1, 2, 3, 9, 10, 0, 0], [0, 0, 4, 11, 12, 13, 14]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1]]
    assert batch.versions.tolist() == [[-1, -1, -1, 1, 2, -1, -1], [-1, -1, -1, 2, 2, 2, 2]]
    assert batch.behav_logp[0, 3:5].tolist() == [-0.25, -0.5]
    assert batch.finished.tolist() == [True, False] and batch.prompt_len == 3
    assert batch.meta[0]["steps_seen"] == 2 and batch.meta[0]["admitted_step"] == 1


@pytest.mark.parametrize("oppo, match", [
    ({"chunk_min": 0}, "chunk_min <= chunk_max"),
    ({"chunk_min": 8, "chunk_max": 4}, "chunk_min <= chunk_max"),
    ({"delta_init": 9}, "delta_min <= delta_init <= delta_max"),
    ({"delta_grow": -1}, "delta_grow"),
    ({"window": 1}, "window must be >= 2"),
    ({"intra": True}, "PPO path"),
])
def test_config_bounds_are_checked_when_built(oppo, match):
    with pytest.raises(ConfigError, match=match):
        with_overrides(preset("micro"), oppo=oppo)



def test_the_old_names_of_delta_grow_and_shrink_are_refused_naming_the_new_ones_and_old_checkpoints_resume():
    from a3po.config import config_differences, config_to_dict

    with pytest.raises(ConfigError, match=r"^overrides: oppo.d_inc was renamed oppo.delta_grow \(same meaning\)$"):
        with_overrides(preset("micro"), oppo={"d_inc": 2})
    # A config saved in a checkpoint before the rename reads as the new names: same values, no difference.
    cfg = with_overrides(preset("micro"), oppo={"delta_grow": 2, "delta_shrink": 3})
    saved = config_to_dict(cfg)
    saved["oppo"] = {{"delta_grow": "d_inc", "delta_shrink": "d_dec"}.get(k, k): v for k, v in saved["oppo"].items()}
    assert "d_inc" in saved["oppo"] and "delta_grow" not in saved["oppo"]
    assert config_differences(saved, config_to_dict(cfg)) == []
    saved["oppo"]["d_dec"] = 1  # another value under the old name is a difference, under the new name
    assert config_differences(saved, config_to_dict(cfg)) == ["oppo.delta_shrink"]

def test_inter_refuses_the_behaviour_only_proximal_of_sync():
    with pytest.raises(ConfigError, match="staleness-aware"):
        with_overrides(preset("micro"), oppo={"inter": True}, rl={"variant": "sync"})
    assert with_overrides(preset("micro"), oppo={"inter": True}, rl={"variant": "sync", "proximal": "recompute"}).oppo.inter


# --- the ledger across a checkpoint and resume ---------------------------------------------------

B, G, M = 2, 2, 8  # groups per batch, samples per group, max new tokens


def _producer(model, tok, sampler, store, start=0):
    engine = RolloutEngine(model, tok.eos_token_id, tok.pad_token_id, version=start)
    return OverlapProducer(
        engine, store, Admission(store, 1, B * G, admitted=start * B * G), sampler, SamplingParams(M, 1.0),
        score=lambda comps, meta: [float(len(c)) for c in comps], decode=lambda t: " ".join(map(str, t)),
        max_staleness=1, schedule="deterministic", seed=0, start=start,
        batch_groups=B, group_size=G, delta=DeltaController(2, 2, 2, 0, 0, 2),
    )


def test_every_admitted_group_is_trained_once_across_a_checkpoint_mid_carry_over(tmp_path):
    model, tok = build_tiny_model("micro", WORDS, seed=0)
    # EOS +4 on the logit: answers of varied lengths (P(EOS) ~ 0.25 a token), so some groups
    # finish while others are still decoding.
    hook = model.lm_head.register_forward_hook(lambda m, i, o: o + 4.0 * torch.nn.functional.one_hot(
        torch.tensor(tok.eos_token_id), o.shape[-1]))
    rows = generate_split(40, "train", seed=0)
    sampler = PromptSampler(rows, tok, B, G, seed=0)
    store = WeightStore()
    store.publish(0, clone_state(model))
    trainer_model, _ = build_tiny_model("micro", WORDS, seed=0)
    trained: list[tuple[int, list[dict], torch.Tensor]] = []  # (step, meta, versions)
    last_state: list[dict] = []  # producer state after the last batch the trainer took
    CKPT, STEPS = 3, 7

    def consume(producer, steps):
        producer.start()
        try:
            for j in steps:
                scored = producer.next_batch(timeout=120)
                assert scored.index == j
                trained.append((j, scored.rollout.meta, scored.rollout.versions.clone()))
                last_state[:] = [scored.producer_state]
                with torch.no_grad():
                    for p in trainer_model.parameters():
                        p.add_(0.01)
                store.publish(j + 1, clone_state(trainer_model))
                if j + 1 == CKPT:  # the trainer's checkpoint after step CKPT-1 holds this state
                    save_checkpoint(tmp_path, CKPT, {"oppo_state": scored.producer_state}, keep=1)
        finally:
            producer.stop()
            producer.join(timeout=30)

    try:
        consume(_producer(model, tok, sampler, store), range(CKPT))
        # The first producer ran ahead (max_staleness 1): what it made after the checkpoint is lost
        # with it, as in a crash. A new one resumes from the checkpoint.
        state = load_checkpoint(tmp_path / "step_000003")["oppo_state"]
        store.closed = False
        resumed = _producer(model, tok, sampler, store, start=CKPT)
        resumed.load_state_dict(state)
        consume(resumed, range(CKPT, STEPS))
        # Not resumed.state_dict(): the producer ran ahead of the trainer; the ledger is the
        # state that goes with the last trained batch (what the next checkpoint would hold).
        final = last_state[0]
    finally:
        hook.remove()

    # The checkpoint was taken in the middle of a carry-over: partial answers were in the buffer.
    partial_at_ckpt = {s["group"] for g in state["buffer"]["groups"] for s in g if s["tokens"] and not s["done"]}
    assert partial_at_ckpt, "precondition: some sequences were mid-answer at the checkpoint"

    # Ledger: groups 0 .. next_group-1 were admitted; each is trained exactly once or still in flight.
    trained_groups = [m[0]["group"] for _, metas, _ in trained for m in [metas[i:i + G] for i in range(0, len(metas), G)]]
    assert_every_group_trained_once(trained_groups, final, B, STEPS)
    for _, metas, _ in trained:
        for i in range(0, len(metas), G):  # whole groups, with their own prompts (group g = sampler batch g's first)
            group = [m["group"] for m in metas[i:i + G]]
            assert len(set(group)) == 1 and [m["id"] for m in metas[i:i + G]] == [sampler.batch(group[0])[1][0]["id"]] * G
    # The groups carried across the checkpoint were trained after the resume, with tokens sampled
    # by versions from before it and after it.
    after = {m["group"]: (j, v[k]) for j, metas, v in trained for k, m in enumerate(metas)}
    for g in partial_at_ckpt:
        j, versions = after[g]
        assert j >= CKPT
    carried_versions = torch.cat([v[k][v[k] >= 0] for j, metas, v in trained for k, m in enumerate(metas)
                                  if m["group"] in partial_at_ckpt and m["steps_seen"] >= 2])
    assert carried_versions.min() < CKPT - 1 < carried_versions.max()


# --- a real OPPO run through rl_train: resumed == uninterrupted --------------------------------


def _oppo_run(ckpt_dir=None, progress=None):
    cfg = with_overrides(preset("micro"), rl={"steps": 6, "max_staleness": 1}, oppo={"inter": True, "delta_init": 2})
    model, tok = build_tiny_model("micro", WORDS, seed=0)
    train, held, _ = load_rows(cfg.data, tok)
    res = rl_train(cfg, model, tok, train, held, ckpt_dir=ckpt_dir, warmstart_acc=0.0, progress=progress)
    return res, clone_state(model)


def test_resumed_oppo_run_equals_uninterrupted_run(core_stub_rewards, tmp_path):
    full = _oppo_run()
    assert full[0].history[3]["oppo/carried"] > 0  # the step-4 checkpoint holds a carry-over
    resumed = run_interrupted_and_resumed(_oppo_run, tmp_path, kill_at=5)
    assert resumed[0].resumed_from == 4
    assert_same_final_state(resumed, full)
    assert max(h["staleness/max"] for h in full[0].history) >= 1  # carried tokens were trained stale
