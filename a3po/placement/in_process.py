"""A producer thread in this process: what generating and scoring need (:class:`RolloutInputs`)
and how a producer is built from them (:func:`local_producer`), the same in a trainer process and
in a rollout worker (:mod:`a3po.placement.worker_loop`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from a3po.config import RunPlan, TrainConfig, filter_settings, mid_batch_updates
from a3po.data.datasets import prompt_style
from a3po.models.lora import MergedWeights, is_lora
from a3po.oppo.overcommit import DeltaController, OverlapProducer
from a3po.producer.group_filter import GroupFilter
from a3po.producer.producer import Admission, PromptSampler, RolloutProducer, StreamHook
from a3po.producer.weight_store import Retention, WeightStore
from a3po.rollout.engines import build_engine
from a3po.rollout.logprob_mismatch import BehaviourCheck
from a3po.rollout.types import SamplingParams


@dataclass(frozen=True)
class RolloutInputs:
    """What generating and scoring need, whichever process does it."""

    cfg: TrainConfig
    plan: RunPlan  # the run's derived facts, resolved in this process (its thread budgets are its own)
    policy: torch.nn.Module
    tokenizer: object
    train_rows: list[dict]
    score: Callable[[list[str], list[dict]], list[float]]  # (completions, meta) -> rewards
    # a3po.oppo.intra.IntraScoring with oppo.intra (the trainer's, or a rollout worker's own)
    intra: StreamHook | None = None


def local_producer(
    inp: RolloutInputs, store: WeightStore, start: int, stride: int = 1, end: int | None = None,
    check: Callable | None = None
) -> RolloutProducer:
    """A producer thread (with OPPO's carry-over when ``oppo.inter``) sampling from the engine
    ``rollout.engine`` names, which starts on the store's newest weights; the same construction
    in a trainer process and in a rollout worker. ``check(rollout)``: extra per-batch figures."""
    rl, tok = inp.cfg.rl, inp.tokenizer
    s = inp.plan.max_staleness
    # With LoRA the store holds adapters: the engine's plain copy of the policy loads them merged.
    merge = MergedWeights(inp.policy) if is_lora(inp.policy) else None
    state = store.get(store.latest)
    engine = build_engine(inp.policy, tok, state if merge is None else merge(state), store.latest, inp.cfg,
                          inp.plan.engine_dtype)
    if merge is not None:
        engine = MergingEngine(engine, merge)
    batch_size = rl.batch_prompts * rl.group_size
    # OPPO's inter-step overlap is the same producer with over-commitment and carry-over.
    oppo = inp.cfg.oppo
    overlap = dict(batch_groups=rl.batch_prompts, group_size=rl.group_size, delta=DeltaController(
        oppo.delta_init, oppo.delta_min, oppo.delta_max, oppo.delta_grow, oppo.delta_shrink, oppo.window),
    ) if oppo.inter else {}
    return (OverlapProducer if oppo.inter else RolloutProducer)(
        engine,
        store,
        # The first admissions under the plan's start bound (adaptive: 1), moved later within [0, s].
        Admission(store, inp.plan.start_bound, batch_size, admitted=start * batch_size, limit=s),
        PromptSampler(inp.train_rows, tok, rl.batch_prompts, rl.group_size, rl.seed, prompt_style(inp.cfg.data)),
        SamplingParams(rl.max_new_tokens, rl.temperature, rl.top_p),
        score=inp.score,
        decode=lambda toks: tok.decode([t for t in toks if t != tok.eos_token_id], skip_special_tokens=True),
        max_staleness=inp.plan.start_bound,
        schedule=rl.schedule,
        seed=rl.seed,
        start=start,
        stride=stride,
        end=end,
        mid_batch_updates=mid_batch_updates(inp.cfg.rollout),
        check=check,
        **overlap,
        stream=inp.intra,
        threads=inp.plan.generate_threads,
        group_filter=GroupFilter(filter_settings(rl)[0]) if rl.filter_groups else None,
    )


def behaviour_check(inp: RolloutInputs, store: WeightStore) -> BehaviourCheck | None:
    """The per-batch re-scoring with a trainer-precision torch copy of the policy
    (:class:`~a3po.rollout.logprob_mismatch.BehaviourCheck`), when the plan asks for it
    (:attr:`~a3po.config.plan.RunPlan.rescore`): ``proximal: metrics`` reports the engine's log-prob
    error against it (``rollout/behav_logp_*``); an asynchronous rollout correction keeps its
    log-probs, the correction's numerator (``trainer_logp: producer``). None when neither. The same
    in a trainer process and in a rollout worker, whose figures travel to the trainer with the batch."""
    rl, plan = inp.cfg.rl, inp.plan
    if not plan.rescore:
        return None
    return BehaviourCheck(inp.policy, engine_weights(inp.policy, store), rl.temperature,
                          keep_logp=plan.trainer_logp == "producer", share_prompt=rl.shared_prompt_forward)


def engine_weights(policy: torch.nn.Module, store: WeightStore) -> Callable[[int], dict[str, torch.Tensor]]:
    """``version -> state dict`` of the plain model the engine (and the log-prob check) runs: the
    store's version itself, or with LoRA its adapters merged into the frozen base."""
    if not is_lora(policy):
        return store.get
    merge = MergedWeights(policy)
    return lambda version: merge(store.get(version))


class MergingEngine:
    """An engine whose weight loads take a LoRA policy's adapter versions (what the store holds)
    and hand it the merged weights (``W0 + s B A``, :class:`~a3po.models.lora.MergedWeights`): one
    merge per version loaded; every other attribute is the engine's own."""

    def __init__(self, engine, merge: MergedWeights) -> None:
        self._engine, self._merge = engine, merge

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        self._engine.load_weights(self._merge(state), version)

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


def weight_retention(plan: RunPlan, end: int | None = None) -> Retention:
    """How long the run's weight stores keep a version (:class:`~a3po.producer.weight_store.Retention`):
    while a batch before ``end`` (default: the run's last) not yet trained can read it."""
    return Retention(plan.max_staleness, plan.schedule, plan.steps if end is None else end)
