"""A rollout worker's process (``distributed.rollout_workers: N``): :func:`serve_rollouts` takes the
trainer's hello and weight versions, generates its batches and sends them to trainer rank 0
(:mod:`a3po.placement.remote_rollouts` is the trainer's side, :mod:`a3po.placement.worker_wire`
the bytes between them).

Worker ``k`` of N generates batches ``j = k, k + N, ...`` with the trainer process's own code
(:func:`a3po.placement.in_process.local_producer`: same engine, sampling parameters, per-batch seed
``batch_seed(seed, j)``, reward function). With ``rollout.engine: vllm`` the worker holds the vLLM
engine (reloaded in place for each version it receives) and the trainer ranks none; with
``proximal: metrics`` the worker re-scores each batch with its own trainer-precision copy of the
policy and the engine-vs-trainer figures (``rollout/behav_logp_*``) travel with the batch.

With ``model.lora`` a version is the adapters alone (what the trainer's store holds): the worker
builds the trainer's peft model on the same warm start (:func:`worker_inputs`; the adapters' ``A``
is drawn from a fixed seed and ``B`` is 0, so the two start equal) and merges each version into its
own frozen base (``W0 + s B A``, as the trainer process's engine does). Adapters rather than merged
weights: a push is the adapters' size, ~r (in + out) / (in out) of the model's (~1/190 at r 16 on a
7B model), the merge costs a fraction of one decode step per version, and the worker's engine then
loads exactly what a single-process run's engine loads.

The staleness bound holds across processes: a worker admits batch ``j`` only once *it* has
received version ``j - b`` (:class:`a3po.producer.producer.Admission` on its own store), and what
it has received is never newer than what the trainer has published. ``b`` is the bound that came
with the newest version the worker holds; each worker's admission takes it before the version
enters its store.

OPPO runs here: with ``oppo.inter`` this worker's carry-over buffer (its checkpointed state comes
with the hello), with ``oppo.intra`` the scorers on the worker's reference and reward model and on
the trainer's critic versions pushed with the weights (:mod:`a3po.oppo.intra`).
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Callable

import torch

from a3po.devices import model_device
from a3po.models.lora import trained_state, with_lora
from a3po.oppo.intra import IntraScoring
from a3po.parallel.ranks import Ranks
from a3po.placement.in_process import RolloutInputs, behaviour_check, local_producer, weight_retention
from a3po.placement.worker_wire import (
    STOP,
    TRAINER,
    receive_version,
    rollout_links,
    send_batch,
    send_failure,
    state_layout,
    version_wire,
    wire_name,
)
from a3po.producer.producer import ProducerFailed
from a3po.producer.weight_store import Retention, WeightStore


def worker_inputs(inp: RolloutInputs) -> RolloutInputs:
    """``inp`` with the policy the trainer's versions fit: the warm start itself, or with
    ``model.lora`` the warm start with the trainer's adapters injected (:func:`a3po.models.lora.with_lora`)."""
    return replace(inp, policy=with_lora(inp.policy, inp.cfg.model.lora))


def serve_rollouts(inp: RolloutInputs, ranks: Ranks, intra: Callable[[Retention], IntraScoring] | None = None) -> int:
    """Generate this worker's batches for the trainer until the run ends; returns how many it
    sent. The engine starts from ``inp.policy`` (the warm start, as the trainer loaded it).
    ``intra`` (``oppo.intra``): builds the worker's scorers on the retention of its weight stores."""
    inp = worker_inputs(inp)
    weights_link, samples_link = rollout_links()
    hello = weights_link.share(None)
    wire = version_wire(inp)
    if hello["wire"] != wire_name(wire):  # e.g. nodes that differ in native bf16 under dtype: auto
        raise RuntimeError(f"rollout worker rank {ranks.rank}: the trainer sends its weight versions as "
                           f"{hello['wire'] or 'its own full-precision bytes'}, this worker takes them as "
                           f"{wire_name(wire) or 'full-precision bytes'} (its engine's dtype here: "
                           f"{inp.plan.engine_dtype.value}); both decide from the same config, so their machines "
                           "differ in native bf16 under dtype: auto: set rollout.dtype to pin the engine's dtype")
    layout = state_layout(trained_state(inp.policy), wire)  # the versions' layout: the whole state, or the adapters
    if hello["layout"] != layout:
        diff = next((a, b) for a, b in zip(hello["layout"] + [None], layout + [None], strict=False) if a != b)
        raise RuntimeError(f"rollout worker rank {ranks.rank}: the trainer's weights do not fit this worker's model "
                           f"(trainer {diff[0]} vs worker {diff[1]}); both must load the same model")
    tied = hello["tied"]
    entries = {name: (d, s) for name, d, s in layout}
    if any(entries.get(a) != entries.get(b) or b not in entries for a, b in tied.items()):
        raise RuntimeError(f"rollout worker rank {ranks.rank}: the trainer sends tied weights {tied} once, but "
                           "this worker's model does not have them alike; both must load the same model")
    device = model_device(inp.policy)
    store = WeightStore(weight_retention(inp.plan, end=hello["end"]))
    k, n = ranks.rank - ranks.world_size, ranks.rollout_workers
    scoring = intra(store.retention) if intra is not None else None
    if scoring is not None:
        inp = replace(inp, intra=scoring)
        if hello["intra_state"][k] is not None:  # this worker's chunk tuner continues its schedule
            scoring.load_state_dict(hello["intra_state"][k])
    critic_store = scoring.critic_store if scoring is not None else None
    if (hello["critic_layout"] is None) != (critic_store is None):
        raise RuntimeError(f"rollout worker rank {ranks.rank}: the trainer "
                           f"{'sends no' if critic_store is not None else 'sends'} critic weights for oppo.intra and "
                           f"this worker {'scores with' if critic_store is not None else 'has no'} a critic")
    layouts = [layout] + ([hello["critic_layout"]] if critic_store is not None else [])

    def publish(version: int, states: list[dict[str, torch.Tensor]]) -> None:
        if critic_store is not None:  # before the policy's: a batch on that version finds its critic
            critic_store.publish(version, states[1])
        store.publish(version, states[0])

    bound = inp.plan.start_bound
    for _ in hello["versions"]:  # the versions the first batches start on (a checkpoint's history on resume)
        version, bound, states = receive_version(layouts, device, weights_link, tied)
        publish(version, states)
    first = hello["start"] + (k - hello["start"]) % n
    # The engine's log-prob error against this worker's trainer-precision copy (proximal: metrics)
    # travels to the trainer in each batch's figures. The rollout correction's own log-probs do not:
    # with workers it runs synchronously only, the trainer computing them (a3po.config.train).
    producer = local_producer(inp, store, first, stride=n, end=hello["end"], check=behaviour_check(inp, store))
    if inp.cfg.oppo.inter:  # this worker's carry-over as the checkpoint kept it (None: none trained yet)
        producer.load_state_dict(hello["oppo_state"][k])
    if bound != producer.max_staleness:
        producer.set_bound(bound)

    def receive_weights() -> None:
        try:
            while True:
                version, bound, states = receive_version(layouts, device, weights_link, tied)
                if version == STOP:  # normally after this worker's last batch; earlier if the trainer failed
                    producer.out.put(None)
                    return
                if bound != producer.max_staleness:  # before the version: admissions on it see its bound
                    producer.set_bound(bound)
                publish(version, states)
        except BaseException as e:
            producer.out.put(ProducerFailed(f"rollout worker rank {ranks.rank} lost the trainer (rank {TRAINER}) "
                                            f"waiting for weights: {e!r}"))
            store.close()

    receiver = threading.Thread(target=receive_weights, name="weight-receive", daemon=True)
    receiver.start()
    producer.start()
    sent = 0
    try:
        for _ in range(first, hello["end"], n):
            batch = producer.next_batch(timeout=None)
            if batch is None:  # the trainer ended the run early: its own error is the run's
                break
            send_batch(batch, samples_link)
            sent += 1
    except BaseException as e:
        try:  # tell the trainer why, so its error names this worker and the cause
            send_failure(f"{e}", samples_link)
        except BaseException:
            pass
        producer.stop()
        if scoring is not None:
            scoring.close()
        raise
    receiver.join()  # every broadcast needs all members: take the trainer's versions until it stops
    producer.stop()
    if scoring is not None:  # scorer threads end before the producer is joined, as in the trainer process
        scoring.close()
    producer.join(timeout=30)
    return sent
