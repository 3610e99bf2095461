"""OPPO intra + inter together (a3po.oppo.overcommit with a3po.oppo.intra): a sequence carried over to a
later step is scored again from its prompt + partial answer when it resumes (the scorers prefill
it as the engine does), and its figures are kept with it in the carry-over buffer once it is done.

Expected figures come from the trainer's one-shot functions (a3po.models.logprobs.token_logprobs,
a3po.models.critic.token_values, a3po.models.critic.reward_model_scores: full forwards of transformers models) over
the batch the trainer gets; cached vs full attention round differently (~1e-7 in fp32), so 1e-5."""

from __future__ import annotations

import pytest
import torch

from a3po.config import OppoConfig, config_from_dict, config_to_dict, effective_max_staleness, preset, proximal_method_name, with_overrides
from a3po.data.arithmetic import WORDS, generate_split
from a3po.models.critic import build_critic, reward_model_scores, token_values
from a3po.models.factory import build_tiny_model
from a3po.models.logprobs import token_logprobs
from a3po.oppo.intra import IntraScoring
from a3po.oppo.overcommit import DeltaController, OverlapProducer
from a3po.producer.producer import Admission, PromptSampler
from a3po.producer.weight_store import WeightStore, clone_state
from a3po.rollout.torch_engine import RolloutEngine
from a3po.rollout.types import SamplingParams
from tests.support.cli_runs import TIMING
from tests.support.ledger import assert_every_group_trained_once
from tests.support.ppo_parts import micro_ppo_parts
from tests.support.resume import assert_same_final_state, run_interrupted_and_resumed

pytestmark = pytest.mark.usefixtures("core_one_thread")

B, G, M = 2, 2, 8  # groups per batch, samples per group, max new tokens
TOL = 1e-5


def _eos_boost(model, tok, boost=4.0):
    """EOS +boost on the logit: answers of varied lengths (P(EOS) ~ 0.25 a token at +4), so some
    groups finish while others are still decoding and get carried over."""
    one_hot = torch.nn.functional.one_hot(torch.tensor(tok.eos_token_id), model.config.vocab_size).float()
    return model.lm_head.register_forward_hook(lambda m, i, o: o + boost * one_hot)


def _producer(model, tok, sampler, store, intra, start=0, delta=2):
    engine = RolloutEngine(model, tok.eos_token_id, tok.pad_token_id, version=start)
    return OverlapProducer(
        engine, store, Admission(store, 1, B * G, admitted=start * B * G), sampler, SamplingParams(M, 1.0),
        score=lambda comps, meta: [float(len(c)) for c in comps], decode=lambda t: " ".join(map(str, t)),
        max_staleness=1, schedule="deterministic", seed=0, start=start,
        batch_groups=B, group_size=G, delta=DeltaController(delta, delta, delta, 0, 0, 2), stream=intra,
    )


def _one_shot(parts, batch):
    ids, attn = batch.input_ids, batch.attention_mask
    with torch.no_grad():
        return {"ref_logp": token_logprobs(parts.reference, ids, attn, 1.0), "values": token_values(parts.critic, ids, attn),
                "scores": reward_model_scores(parts.reward_model, ids, attn)}


def _assert_streamed_equals_one_shot(parts, scored):
    batch, resp = scored.rollout, scored.rollout.response_mask
    expected = _one_shot(parts, batch)
    assert set(scored.streamed) == {"ref_logp", "values", "scores"}
    assert (scored.streamed["ref_logp"][resp] - expected["ref_logp"][resp]).abs().max() < TOL
    assert (scored.streamed["values"][resp] - expected["values"][resp]).abs().max() < TOL
    assert (scored.streamed["scores"] - expected["scores"]).abs().max() < TOL
    assert expected["values"][resp].abs().max() > 0.1  # not trivially 0


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_carried_then_finished_sequences_are_scored_as_one_shot(chunk):
    """Five producer steps with over-commitment; every delivered batch's streamed reference
    log-probs, critic values and reward-model scores equal one-shot scoring of that batch,
    including answers decoded over two or more steps (re-prefilled prompt + partial answer)."""
    policy, tok = build_tiny_model("micro", WORDS, seed=0)
    parts = micro_ppo_parts(policy, tok)
    intra = IntraScoring(parts, OppoConfig(chunk_min=chunk, chunk_max=chunk), tok.pad_token_id)
    hook = _eos_boost(policy, tok)
    store = WeightStore()
    store.publish(0, clone_state(policy))
    sampler = PromptSampler(generate_split(40, "train", seed=0), tok, B, G, seed=0)
    producer = _producer(policy, tok, sampler, store, intra)
    carried_rows = 0
    try:
        for v in range(6):
            intra.publish_critic(v, parts.critic)  # one critic for every version: one-shot uses it too
        for j in range(5):
            scored = producer.produce(j)
            _assert_streamed_equals_one_shot(parts, scored)
            carried_rows += sum(m["steps_seen"] >= 2 for m in scored.rollout.meta)
            assert scored.metrics["oppo/chunk_size"] == chunk
            # The chunk tuner's state travels with the batch, for the checkpoint of the batch trained last.
            assert scored.stream_state is not None and scored.stream_state == intra.state_dict()
    finally:
        hook.remove()
        intra.close()
    assert carried_rows > 0, "precondition: some trained answers were decoded over two or more steps"


def test_both_on_every_group_trained_once_across_a_checkpoint_mid_carry_over(tmp_path):
    """The ledger of tests/oppo/test_overcommit.py with intra on: producer threads, a trainer that
    moves the policy and the critic every step (the scorers read the critic of each batch's
    version), a checkpoint while answers are mid-way, a new producer and new scorers resumed from
    it. Every admitted group is trained exactly once or still in flight, and every trained batch
    (those after the resume too: the done samples' figures come back from the JSON state) carries
    streamed figures equal to one-shot scoring with the critic of the version its last part was
    decoded on."""
    from a3po.storage.checkpoint import load_checkpoint, save_checkpoint

    policy, tok = build_tiny_model("micro", WORDS, seed=0)
    parts = micro_ppo_parts(policy, tok)
    hook = _eos_boost(policy, tok)
    sampler = PromptSampler(generate_split(40, "train", seed=0), tok, B, G, seed=0)
    store = WeightStore()
    store.publish(0, clone_state(policy))
    trainer_model, _ = build_tiny_model("micro", WORDS, seed=0)
    critics = {0: clone_state(parts.critic)}
    trained: list[tuple[int, object]] = []
    last_state: list[dict] = []
    CKPT, STEPS = 3, 7

    def consume(producer, intra, steps):
        producer.start()
        try:
            for j in steps:
                scored = producer.next_batch(timeout=120)
                assert scored.index == j
                trained.append((j, scored))
                last_state[:] = [scored.producer_state]
                with torch.no_grad():  # the trainer's step: policy and critic move
                    for p in trainer_model.parameters():
                        p.add_(0.01)
                    parts.critic.score.weight.add_(0.1)
                critics[j + 1] = clone_state(parts.critic)
                intra.publish_critic(j + 1, parts.critic)  # before the policy's, as rl_train does
                store.publish(j + 1, clone_state(trainer_model))
                if j + 1 == CKPT:
                    save_checkpoint(tmp_path, CKPT, {"oppo_state": scored.producer_state}, keep=1)
        finally:
            producer.stop()
            producer.join(timeout=30)

    try:
        intra = IntraScoring(parts, OppoConfig(chunk_min=3, chunk_max=3), tok.pad_token_id)
        intra.publish_critic(0, parts.critic)
        try:
            consume(_producer(policy, tok, sampler, store, intra), intra, range(CKPT))
        finally:
            intra.close()
        state = load_checkpoint(tmp_path / "step_000003")["oppo_state"]
        store.closed = False
        # New scorers, as a resumed run builds them (critic versions from intra_critic_history).
        intra = IntraScoring(parts, OppoConfig(chunk_min=3, chunk_max=3), tok.pad_token_id)
        for v in range(CKPT - 1, CKPT + 1):
            intra.critic_store.publish(v, critics[v])
        resumed = _producer(policy, tok, sampler, store, intra, start=CKPT)
        resumed.load_state_dict(state)
        try:
            consume(resumed, intra, range(CKPT, STEPS))
        finally:
            intra.close()
        final = last_state[0]
    finally:
        hook.remove()

    partial_at_ckpt = {s["group"] for g in state["buffer"]["groups"] for s in g if s["tokens"] and not s["done"]}
    done_at_ckpt = {s["group"] for g in state["buffer"]["groups"] for s in g if s["done"]}
    assert partial_at_ckpt and done_at_ckpt, "precondition: answers mid-way and done ones waiting for their group"
    assert all(s["scored"] is not None for g in state["buffer"]["groups"] for s in g if s["done"])

    trained_groups = [scored.rollout.meta[i]["group"] for _, scored in trained for i in range(0, len(scored.rollout), G)]
    assert_every_group_trained_once(trained_groups, final, B, STEPS)

    # Streamed == one-shot, row by row, with the critic of the version that decoded the row's last
    # part (recorded with the sample); a wrong version shows since the critic moves every step.
    checker = build_critic(policy)
    reference, rm = parts.reference, parts.reward_model
    resumed_rows = 0
    for j, scored in trained:
        batch, resp = scored.rollout, scored.rollout.response_mask
        ids, attn = batch.input_ids, batch.attention_mask
        with torch.no_grad():
            ref = token_logprobs(reference, ids, attn, 1.0)
            scores = reward_model_scores(rm, ids, attn)
        assert (scored.streamed["ref_logp"][resp] - ref[resp]).abs().max() < TOL
        assert (scored.streamed["scores"] - scores).abs().max() < TOL
        for i, m in enumerate(batch.meta):
            assert m["scored_version"] <= max(0, j - 1)  # batch j starts on version max(0, j - 1)
            checker.load_state_dict(critics[m["scored_version"]])
            with torch.no_grad():
                v = token_values(checker, ids[i:i + 1], attn[i:i + 1])[0]
            assert (scored.streamed["values"][i][resp[i]] - v[resp[i]]).abs().max() < TOL, (j, i, m)
            resumed_rows += j >= CKPT and m["group"] in partial_at_ckpt | done_at_ckpt
    assert resumed_rows > 0


def test_both_on_is_accepted_by_the_config():
    cfg = with_overrides(preset("micro"), rl={"advantage": "gae", "variant": "loglinear"},
                         ppo={"critic": "policy_copy", "kl_coef": 0.05}, oppo={"intra": True, "inter": True})
    # The form a checkpoint saves reads back to the same config, checked again on the way.
    assert config_from_dict(config_to_dict(cfg)) == cfg
    # Carried tokens are stale: the trust region is anchored by loglinear's proximal policy, not
    # the behaviour policy, and the producer may lead by the micro preset's max_staleness (2).
    assert (proximal_method_name(cfg.rl), effective_max_staleness(cfg.rl)) == ("loglinear", 2)


# --- through rl_train -----------------------------------------------------------------------------

PPO_BOTH = {"rl": {"advantage": "gae", "variant": "loglinear", "max_staleness": 1, "steps": 6, "eval_every": 6},
            "ppo": {"critic": "policy_copy", "critic_lr": 1e-3, "kl_coef": 0.05, "kl_estimator": "k3"},
            "oppo": {"intra": True, "inter": True, "delta_init": 2, "chunk_min": 4, "chunk_max": 4}}


def _run(ckpt_dir=None, progress=None):
    from a3po.data.datasets import load_rows
    from a3po.training.loop import rl_train

    cfg = with_overrides(preset("micro"), **PPO_BOTH)
    model, tok = build_tiny_model("micro", WORDS, seed=0)
    train, held, _ = load_rows(cfg.data, tok)
    return rl_train(cfg, model, tok, train, held[:4], ckpt_dir=ckpt_dir, warmstart_acc=0.0, progress=progress)


def test_ppo_run_with_both_trains_on_streamed_figures_of_carried_answers(core_stub_rewards, monkeypatch):
    """train_step never runs the reference (the scorers did, chunk by chunk, carried answers
    included) and runs the critic only for its value updates."""
    import a3po.training.loop

    counts = {"reference": 0, "critic": 0}
    real = a3po.training.loop.build_ppo_parts

    def build(*args, **kwargs):
        parts = real(*args, **kwargs)
        parts.reference.register_forward_hook(lambda *a: counts.__setitem__("reference", counts["reference"] + 1))
        parts.critic.register_forward_hook(lambda *a: counts.__setitem__("critic", counts["critic"] + 1))
        return parts

    monkeypatch.setattr(a3po.training.loop, "build_ppo_parts", build)
    res = _run()
    steps, minibatches = PPO_BOTH["rl"]["steps"], preset("micro").rl.minibatches
    assert counts == {"reference": 0, "critic": steps * minibatches}
    assert sum(h["oppo/carried"] for h in res.history) > 0 and max(h["oppo/trained_age_max"] for h in res.history) >= 1
    streamed = [h for h in res.history if "oppo/chunks" in h]
    assert streamed, "no step logged oppo/chunks: nothing was streamed"
    assert all(h["oppo/chunk_size"] == 4 and h["oppo/chunks"] >= 1 for h in streamed), streamed
    assert res.history[-1]["ppo/kl"] > 0


@pytest.mark.slow
def test_resumed_run_with_both_equals_uninterrupted_run(core_stub_rewards, tmp_path):
    """Crash after step 5, resume from the step-4 checkpoint (carry-over buffer with the done
    samples' streamed figures, critic history): the same per-step figures as one uninterrupted run."""
    full = _run()
    assert full.history[3]["oppo/carried"] > 0  # the step-4 checkpoint holds a carry-over
    resumed = run_interrupted_and_resumed(_run, tmp_path, kill_at=5)
    assert resumed.resumed_from == 4
    assert_same_final_state(resumed, full, skip=TIMING + ("oppo/scorer_busy_s/",))
