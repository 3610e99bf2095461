"""OPPO with rollout workers (``distributed.rollout_workers``, a3po/placement/worker_loop.py):
the carry-over (``oppo.inter``) and the streaming scorers (``oppo.intra``) run in the worker.

Fast: the wire format carries the streamed tensors and the OPPO states exactly; with two
workers each owns the groups it admitted, and the ledger (every admitted group trained exactly
once, none lost) holds across a checkpoint taken mid carry-over, the producers resuming from the
per-worker states the trainer keeps (:class:`a3po.placement.remote_rollouts.WorkerStates`).

Slow (``python -m a3po.training.command`` under torchrun, as tests/placement/test_rollout_workers.py): 1 trainer +
1 worker with ``oppo.inter`` equals the one-process ``oppo.inter`` run exactly under the
deterministic schedule (the worker runs the same producer with the same group numbering, the
state travels as JSON, floats exactly); a killed worker's rerun resumes to the same end; with
``oppo.intra`` the worker's streamed scores match the trainer's one-shot scoring (an intra-off
run) within 1e-5 / rel 1e-4, as in one process (tests/oppo/test_intra.py derives the tolerances).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from a3po.data.arithmetic import WORDS, generate_split
from a3po.models.factory import build_tiny_model
from a3po.oppo.overcommit import DeltaController, OverlapProducer, per_worker_states
from a3po.placement.remote_rollouts import WorkerStates
from a3po.placement.worker_wire import put_batch, take_batch
from a3po.producer.producer import Admission, PromptSampler, ScoredBatch
from a3po.producer.weight_store import WeightStore, clone_state
from a3po.rollout.torch_engine import RolloutEngine
from a3po.rollout.types import RolloutBatch, SamplingParams
from a3po.storage.checkpoint import latest_checkpoint, load_checkpoint
from tests.support.cli_runs import assert_equal_runs, final_weights, killed_at_step, run_and_kill, run_to_json, step_metrics
from tests.support.cli_runs import share_warmstart as _share_warmstart
from tests.support.cli_runs import train_command as _command

REPO_ROOT = Path(__file__).resolve().parents[2]

# --- fast: the wire and the per-worker ledger ---------------------------------------------------


def test_a_batch_travels_with_its_streamed_tensors_and_oppo_states_exactly():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 30, (3, 7), generator=g)
    rollout = RolloutBatch(ids, torch.ones_like(ids), torch.rand(3, 7, generator=g) > 0.5, torch.randn(3, 7, generator=g),
                           torch.randint(-1, 4, (3, 7), generator=g), torch.tensor([True, False, True]), 4, [{"group": i} for i in range(3)])
    # 0.1 + 0.2 is not 0.3 in binary: JSON must keep every bit of a carried log-prob.
    state = {"buffer": {"groups": [[{"logp": [0.1 + 0.2, -1e-300]}]]}, "next_group": 5}
    sent = ScoredBatch(9, rollout, torch.tensor([1.0, 0.0, 0.5]), ["a", "b", "c"], 0.25, {"calls": 3}, {"oppo/delta": 2.0},
                       producer_state=state, stream_state={"chunk_tuner": {"size": 4}},
                       streamed={"ref_logp": torch.randn(3, 7, generator=g), "scores": torch.rand(3, generator=g)})
    wire: list[torch.Tensor] = []
    put_batch(sent, lambda t: wire.append(t.clone()))
    got = take_batch(lambda t: t.copy_(wire.pop(0)), torch.device("cpu"))
    assert not wire and got.index == 9
    assert (got.producer_state, got.stream_state) == (state, {"chunk_tuner": {"size": 4}})
    assert got.producer_state["buffer"]["groups"][0][0]["logp"][0] == 0.30000000000000004
    assert list(got.streamed) == ["ref_logp", "scores"]
    assert all(torch.equal(got.streamed[k], sent.streamed[k]) and got.streamed[k].dtype == torch.float32 for k in sent.streamed)
    # No OPPO: nothing more travels.
    wire.clear()
    put_batch(ScoredBatch(0, rollout, sent.rewards, sent.completions, 0.0), lambda t: wire.append(t.clone()))
    plain = take_batch(lambda t: t.copy_(wire.pop(0)), torch.device("cpu"))
    assert (plain.producer_state, plain.stream_state, plain.streamed) == (None, None, {})


def test_worker_states_are_each_workers_newest_as_of_the_batch_delivered():
    states = WorkerStates(2)

    def batch(j: int) -> ScoredBatch:
        return ScoredBatch(j, None, None, [], 0.0, producer_state={"after": j}, stream_state={"t": j})

    got = [states.record(j % 2, batch(j)) for j in range(3)]
    # After batch 0 worker 1 has had nothing trained (None: it starts afresh); after batch 2 worker 0 is at 2, worker 1 at 1.
    assert [b.producer_state for b in got] == [{"workers": [{"after": 0}, None]}, {"workers": [{"after": 0}, {"after": 1}]},
                                               {"workers": [{"after": 2}, {"after": 1}]}]
    assert got[2].stream_state == {"workers": [{"t": 2}, {"t": 1}]}


def test_a_checkpoints_carry_over_resumes_only_with_as_many_producers():
    one = {"buffer": {}, "delta": {}, "next_group": 3}
    assert per_worker_states(one, 1) == [one]  # one process <-> one worker: the same group numbering
    assert per_worker_states({"workers": [one]}, 1) == [one]
    assert per_worker_states(None, 2) == [None, None]
    with pytest.raises(ValueError, match=r"belongs to 2 rollout producer\(s\) .* this launch has 1: .*same number of rollout workers"):
        per_worker_states({"workers": [one, None]}, 1)
    with pytest.raises(ValueError, match=r"belongs to 1 rollout producer\(s\) \(distributed.rollout_workers 0\), this launch has 2"):
        per_worker_states(one, 2)


B, G, M, N = 2, 2, 8, 2  # groups per batch, samples per group, max new tokens, workers


def _worker_producer(model, tok, sampler, store, start: int) -> OverlapProducer:
    """Worker ``start mod N``'s producer, as a3po.placement.in_process.local_producer builds it (stride N)."""
    engine = RolloutEngine(model, tok.eos_token_id, tok.pad_token_id, version=store.latest)
    return OverlapProducer(
        engine, store, Admission(store, 1, B * G, admitted=start * B * G), sampler, SamplingParams(M, 1.0),
        score=lambda comps, meta: [float(len(c)) for c in comps], decode=lambda t: " ".join(map(str, t)),
        max_staleness=1, schedule="deterministic", seed=0, start=start, stride=N,
        batch_groups=B, group_size=G, delta=DeltaController(2, 2, 2, 0, 0, 2),
    )


def test_two_workers_own_their_groups_and_each_is_trained_once_across_a_checkpoint_mid_carry_over(core_one_thread):
    """Two workers' producers (batches 0, 2, 4, ... and 1, 3, 5, ...), a trainer that moves the
    policy each step and keeps :class:`WorkerStates`; a checkpoint after step 3 while answers are
    mid-way, then one batch each generated past it and lost (a crash), then new producers resumed
    from the checkpoint's per-worker states. Expected, by hand: worker k admitted exactly the groups
    k, k + 2, ..., each trained once (in a batch of its own worker) or still in its buffer."""
    model, tok = build_tiny_model("micro", WORDS, seed=0)
    # EOS +4 on the logit (P(EOS) ~ 0.25 a token): varied lengths, so groups get carried over.
    hook = model.lm_head.register_forward_hook(lambda m, i, o: o + 4.0 * torch.nn.functional.one_hot(
        torch.tensor(tok.eos_token_id), o.shape[-1]))
    sampler = PromptSampler(generate_split(40, "train", seed=0), tok, B, G, seed=0)
    store = WeightStore()
    store.publish(0, clone_state(model))
    trainer_model, _ = build_tiny_model("micro", WORDS, seed=0)
    CKPT, STEPS = 4, 9
    trained: list[tuple[int, list[dict]]] = []
    ledger = WorkerStates(N)

    def step(producers: list[OverlapProducer], j: int) -> ScoredBatch:
        producer = producers[j % N]
        scored = ledger.record(j % N, producer._produce_next(j))
        trained.append((j, scored.rollout.meta))
        with torch.no_grad():
            for p in trainer_model.parameters():
                p.add_(0.01)
        store.publish(j + 1, clone_state(trainer_model))
        return scored

    try:
        producers = [_worker_producer(model, tok, sampler, store, k) for k in range(N)]
        for j in range(CKPT):
            checkpoint = json.loads(json.dumps(step(producers, j).producer_state))  # the checkpoint holds JSON
        for j in (CKPT, CKPT + 1):  # generated, never trained: lost with the crashed workers
            producers[j % N]._produce_next(j)
        ledger = WorkerStates(N)
        ledger.carry = per_worker_states(checkpoint, N)
        resumed = [_worker_producer(model, tok, sampler, store, CKPT + k) for k in range(N)]
        for k, producer in enumerate(resumed):
            producer.load_state_dict(ledger.carry[(CKPT + k) % N])
        resumed = sorted(resumed, key=lambda p: p.next_index % N)
        for j in range(CKPT, STEPS):
            final = step(resumed, j).producer_state["workers"]
    finally:
        hook.remove()

    partial = [s["group"] for w in checkpoint["workers"] for g in w["buffer"]["groups"] for s in g if s["tokens"] and not s["done"]]
    assert partial, "precondition: some sequences were mid-answer at the checkpoint"
    trained_groups = [(j, metas[i]["group"]) for j, metas in trained for i in range(0, len(metas), G)]
    assert len(trained_groups) == B * STEPS
    for k in range(N):
        mine = [g for j, g in trained_groups if j % N == k]
        assert all(g % N == k for g in mine), (k, mine)  # a worker trains only groups it admitted
        in_flight = {g[0]["group"] for g in final[k]["buffer"]["groups"]}
        admitted = set(range(k, final[k]["next_group"], N))
        assert len(mine) == len(set(mine)) and set(mine) | in_flight == admitted and not set(mine) & in_flight  # once; none lost
    # Groups carried across the checkpoint were trained after it.
    assert all(j >= CKPT for j, g in trained_groups if g in partial)


# --- slow: the real command, one trainer and one worker --------------------------------------------

STEPS_RUN = 8


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1", "DO_NOT_TRACK": "true"}


def _config(tmp: Path, name: str, workers: int, extra: str) -> Path:
    path = tmp / f"config-{name}-w{workers}.yaml"
    path.write_text(
        "warm_start: {steps: 150, batch_size: 32}\n"
        f"rl: {{steps: {STEPS_RUN}, batch_prompts: 8, group_size: 4, minibatches: 2, max_new_tokens: 12, lr: 1.0e-3,\n"
        "     lr_warmup_steps: 0, eval_every: 4, checkpoint_every: 2, schedule: deterministic, max_staleness: 1}\n"
        f"distributed: {{rollout_workers: {workers}}}\n" + extra
    )
    return path


INTER = "oppo: {inter: true, delta_init: 2, delta_min: 1, delta_max: 3}\n"
# tiny-ppo's PPO parts (GAE critic, k3 KL), synchronous (s = 0: the critic that scores is the one
# train_step would use, tests/oppo/test_intra.py), the chunk size pinned (bitwise reproducible streams).
PPO = ("ppo: {critic: policy_copy, critic_lr: 1.0e-3, gamma: 1.0, lam: 0.95, kl_coef: 0.05, kl_estimator: k3}\n")


def _ppo_config(tmp: Path, name: str, workers: int, oppo: str, max_staleness: int) -> Path:
    # update_threads 1: in one process a synchronous update otherwise takes every core (beside
    # workers it keeps torch_threads), which rounds the update differently (~1e-7).
    path = _config(tmp, name, workers, PPO + f"oppo: {{{oppo}, chunk_min: 4, chunk_max: 4}}\nupdate_threads: 1\n")
    path.write_text(path.read_text().replace("max_staleness: 1}", f"max_staleness: {max_staleness}, advantage: gae}}"))
    return path


def _intra_config(tmp: Path, workers: int, intra: bool) -> Path:
    return _ppo_config(tmp, f"intra{int(intra)}", workers, f"intra: {str(intra).lower()}", max_staleness=0)


def _train(config: Path, out: Path, nproc: int | None = None, variant: str = "loglinear") -> dict:
    return run_to_json(_command(config, out, nproc, variant), REPO_ROOT, _env())


@pytest.fixture(scope="module")
def inter_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("oppo-workers")
    single = _train(_config(tmp, "inter", 0, INTER), tmp / "single")
    _share_warmstart(tmp / "single", tmp / "two")
    two = _train(_config(tmp, "inter", 1, INTER), tmp / "two", nproc=2)
    return {"single": single, "two": two, "tmp": tmp}


@pytest.mark.slow
def test_trainer_plus_worker_with_oppo_inter_equals_the_one_process_oppo_inter_run(inter_runs):
    single, two = inter_runs["single"], inter_runs["two"]
    assert (two["world_size"], two["rollout_workers"]) == (1, 1)
    assert_equal_runs(single, two, STEPS_RUN)  # exactly: module docstring
    carried = [m["oppo/carried"] for m in step_metrics(two).values()]
    assert max(carried) > 0, f"precondition: nothing was carried over, the buffer was not exercised: {carried}"


def _kill_after_first_checkpoint(command: list[str], latest: Path, rank: int) -> int:
    """Run ``command``, SIGKILL ``rank`` once a checkpoint exists; the step of the checkpoint left."""
    proc, _, _ = run_and_kill(command, REPO_ROOT, _env(), latest, rank=rank)
    return killed_at_step(proc, latest, STEPS_RUN)


def _carried(latest: Path, workers: int) -> int:
    """Samples with answer tokens in the workers' carry-over buffers of the checkpoint ``latest`` points at."""
    carry = load_checkpoint(latest_checkpoint(latest.parent))["oppo_state"]
    assert len(carry["workers"]) == workers, carry
    return sum(1 for w in carry["workers"] if w is not None for g in w["buffer"]["groups"] for s in g if s["tokens"])


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_killed_oppo_inter_worker_reruns_to_the_uninterrupted_end(inter_runs, workers):
    """SIGKILL of a worker once a checkpoint exists, while answers sit in the carry-over; the rerun
    hands each worker its checkpointed carry-over and ends equal to the uninterrupted run of as
    many workers (one worker: the run above; two: each owns its groups): no group lost or trained
    twice, else the prompts, rewards and weights would differ."""
    tmp = inter_runs["tmp"]
    if workers == 1:
        uninterrupted = inter_runs["two"]
    else:
        _share_warmstart(tmp / "single", tmp / "three")
        uninterrupted = _train(_config(tmp, "inter", 2, INTER), tmp / "three", nproc=3)
        assert uninterrupted["rollout_workers"] == 2
    out = tmp / f"killed-w{workers}"
    _share_warmstart(tmp / "single", out)
    config = _config(tmp, "inter", workers, INTER)
    latest = out / "loglinear-seed0" / "checkpoints" / "latest"
    killed_at = _kill_after_first_checkpoint(_command(config, out, 1 + workers), latest, rank=workers)
    assert _carried(latest, workers) > 0, "precondition: the checkpoint holds no carried answer"
    resumed = _train(config, out, nproc=1 + workers)
    assert resumed["resumed_from"] is not None and resumed["resumed_from"] <= killed_at
    assert_equal_runs(uninterrupted, resumed, STEPS_RUN)  # exactly: module docstring


BUSY = "oppo/scorer_busy_s/"  # scorer wall time: the one figure two equal runs may disagree on


def _without_busy(run: dict) -> dict[int, dict[str, float]]:
    return {s: {k: v for k, v in m.items() if not k.startswith(BUSY)} for s, m in step_metrics(run).items()}


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 + 1e-4 * abs(b)


@pytest.mark.slow
def test_oppo_intra_in_a_worker_streams_what_one_shot_scoring_gives(inter_runs):
    """PPO (GAE critic + k3 KL, s = 0), chunks of 4. The worker streams the reference log-probs
    (its frozen warm start) and the critic's values (the trainer's critic, pushed with each
    version as bytes) and the trainer uses them: every per-step figure equals the one-process
    intra run's exactly (same code on the same weights, one thread each), and the intra-off run's
    (the trainer's one-shot forwards) within tests/oppo/test_intra.py's tolerances, so the streamed
    tensors are the one-shot ones to ~1e-7."""
    tmp = inter_runs["tmp"]
    off = _train(_intra_config(tmp, 0, intra=False), tmp / "single", variant="sync")
    _share_warmstart(tmp / "single", tmp / "intra-in-process")
    one = _train(_intra_config(tmp, 0, intra=True), tmp / "intra-in-process", variant="sync")
    _share_warmstart(tmp / "single", tmp / "intra")
    on = _train(_intra_config(tmp, 1, intra=True), tmp / "intra", nproc=2, variant="sync")
    assert (on["world_size"], on["rollout_workers"]) == (1, 1)
    mon, moff = step_metrics(on), step_metrics(off)
    assert sorted(mon) == sorted(moff) == list(range(1, STEPS_RUN + 1))
    assert _without_busy(on) == _without_busy(one)
    # The clip fraction counts ties (V == V_old bit for bit with intra off in a minibatch's first
    # pass) that the streamed ~1e-7 flips (tests/oppo/test_intra.py): compared through the value loss.
    skip = ("oppo/", "ppo/value_clip_frac")
    bad = {(s, k): (mon[s][k], moff[s][k]) for s in moff for k in moff[s] if not k.startswith(skip) and not _close(mon[s][k], moff[s][k])}
    assert not bad, bad
    assert all(mon[s]["oppo/chunk_size"] == 4 and mon[s][BUSY + "ref_logp"] > 0 and mon[s][BUSY + "values"] > 0 for s in mon)
    assert moff[STEPS_RUN]["ppo/kl"] > 0 and len({round(m["ppo/value_mean"], 6) for m in moff.values()}) > 1  # the critic moved


BOTH = "intra: true, inter: true, delta_init: 2, delta_min: 1, delta_max: 3"


@pytest.fixture(scope="module")
def both_runs(inter_runs):
    """Both overlaps (PPO, loglinear, s = 1): one process, and 1 trainer + 1 worker."""
    tmp = inter_runs["tmp"]
    _share_warmstart(tmp / "single", tmp / "both-in-process")
    one = _train(_ppo_config(tmp, "both", 0, BOTH, max_staleness=1), tmp / "both-in-process")
    _share_warmstart(tmp / "single", tmp / "both")
    two = _train(_ppo_config(tmp, "both", 1, BOTH, max_staleness=1), tmp / "both", nproc=2)
    return {"one": one, "two": two, "tmp": tmp}


@pytest.mark.slow
def test_oppo_intra_and_inter_in_a_worker_equal_both_in_one_process(both_runs):
    """The worker's carry-over keeps each done answer's streamed figures and its streaming scorers
    read the pushed critic versions: every figure equals the one-process run's, exactly."""
    one, two = both_runs["one"], both_runs["two"]
    assert _without_busy(two) == _without_busy(one)
    m2 = step_metrics(two)
    assert max(m["oppo/carried"] for m in m2.values()) > 0 and m2[STEPS_RUN]["ppo/kl"] > 0


@pytest.mark.slow
def test_oppo_intra_and_inter_in_a_worker_resume_after_a_kill(both_runs):
    """A worker killed once a checkpoint exists (carried answers with their streamed figures in its
    buffer, the critic versions the resumed batches start on in the checkpoint's history, pushed
    again in the hello) reruns to the uninterrupted end exactly."""
    tmp = both_runs["tmp"]
    out = tmp / "both-killed"
    _share_warmstart(tmp / "single", out)
    config = _ppo_config(tmp, "both", 1, BOTH, max_staleness=1)
    latest = out / "loglinear-seed0" / "checkpoints" / "latest"
    killed_at = _kill_after_first_checkpoint(_command(config, out, 2), latest, rank=1)
    assert _carried(latest, 1) > 0, "precondition: the checkpoint holds no carried answer"
    resumed = _train(config, out, nproc=2)
    assert resumed["resumed_from"] is not None and resumed["resumed_from"] <= killed_at
    assert _without_busy(resumed) == _without_busy(both_runs["two"])
    wa, wb = final_weights(both_runs["two"]), final_weights(resumed)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
