"""What a run's config means, resolved once where the run starts and handed down (:class:`RunPlan`).

The config says what was asked; the plan says what follows from it: the staleness bound in force,
the proximal method and whether it runs a forward, where the trainer's log-probs of the behaviour
versions come from, where rollouts run, which weight versions a store keeps and the thread budgets.
The loop, the placements and the producer read these facts from the plan instead of re-deriving
them from the config, so what a variant or a placement means is decided, and tested, here alone
(``docs/variants.md`` describes the same facts).

The precision (:class:`a3po.devices.Precision`) is resolved here too, from the config's dtype and
what the caller detected of the machine (:func:`a3po.devices.native_bf16`), passed in as the cores
are: the plan stays a plain function of its arguments.

The ranks (this process's place in the launch, :func:`a3po.parallel.ranks.init_ranks`) are not in
the plan: they come from the launcher's environment and joining them starts process groups, once
per process, whereas the plan is a plain value of the config, the same on every process of a run.
They are handed down beside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from a3po.algorithms.proximal import PROXIMAL_METHODS
from a3po.algorithms.rollout_correction import trainer_logp_source
from a3po.algorithms.staleness import STALENESS_CONTROLS
from a3po.config.axes import Placement, placement_of
from a3po.config.rl import Variant, effective_max_staleness, proximal_method_name
from a3po.config.train import TrainConfig
from a3po.devices import DType, Precision, resolve_precision


@dataclass(frozen=True)
class RunPlan:
    """The derived facts of one run (build with :meth:`of`)."""

    variant: Variant
    max_staleness: int
    """The staleness bound: ``rl.max_staleness`` for the asynchronous variants, 0 for sync (the
    producer never runs ahead of the trainer); where the bound moves mid-run (``staleness_control``
    'adaptive', the guard's 'tighten') the largest it may take. Admission, the deterministic schedule,
    the versions a store keeps and a checkpoint's weight history all follow it."""
    staleness_control: str
    """``rl.staleness_control`` (:data:`a3po.algorithms.staleness.STALENESS_CONTROLS`): whether the bound
    in force moves within ``[1, max_staleness]`` after each step ('adaptive') or stays ('fixed')."""
    start_bound: int
    """The bound of the run's first admissions (:meth:`a3po.algorithms.staleness.StalenessControl.start`):
    ``max_staleness`` when fixed, 1 when adaptive."""
    proximal: str
    """The proximal method's name in :data:`a3po.algorithms.proximal.PROXIMAL_METHODS`: ``rl.proximal``,
    or the variant's own (sync: behaviour, recompute: recompute, loglinear: loglinear)."""
    proximal_forward: bool
    """Whether the proximal method runs an extra no-grad forward over each batch (recompute, metrics)."""
    trainer_logp: Literal["trainer", "producer"] | None
    """Where ``rl.rollout_correction`` gets the trainer's log-probs of the behaviour versions
    (:func:`a3po.algorithms.rollout_correction.trainer_logp_source`): ``'trainer'`` (every token
    on-policy: a forward at the start of the step, or the proximal one), ``'producer'`` (re-scored
    beside decoding), None (no correction: nothing computed)."""
    rescore: bool
    """Whether the producer re-scores each batch with a trainer-precision copy of the policy
    (:class:`a3po.rollout.logprob_mismatch.BehaviourCheck`): ``proximal: metrics`` measures the
    engine's error with it, and the trainer's log-probs are kept when :attr:`trainer_logp` is 'producer'."""
    placement: Placement
    """Where rollouts are generated (:data:`a3po.placement.registry.ROLLOUT_PLACEMENTS`): a thread of
    each trainer process, or ``distributed.rollout_workers`` processes of their own."""
    schedule: Literal["deterministic", "threaded"]
    """``rl.schedule``; with :attr:`max_staleness` and :attr:`steps` it decides which weight versions
    a store keeps (:func:`a3po.placement.in_process.weight_retention`)."""
    steps: int
    """The run's batches ``0 .. steps - 1``: a store keeps no version only a batch past them could read."""
    alternate: bool
    """Whether the trainer thread and the in-process producer thread take turns, never computing at
    once (bound 0, one process, no OPPO carry-over); then each phase may take every core
    (:mod:`a3po.placement.cores`)."""
    update_threads: int
    """Intra-op threads of a training update: ``update_threads`` (0: every core) where the phases
    alternate, ``torch_threads`` where they overlap."""
    generate_threads: int
    """Intra-op threads of the in-process producer's decoding, by the same rule with ``generate_threads``."""
    precision: Precision
    """What the trainer computes in (``dtype`` on this machine): fp32, bf16 weights, or bf16 autocast
    on fp32 master weights (``dtype: auto`` where bf16 is native), with the reason logged at start."""
    engine_dtype: DType
    """The rollout engine's weights: ``rollout.dtype``, or the precision's choice when it is null
    (bf16 beside an autocast trainer: the behaviour log-probs then carry the bf16 engine's error)."""

    @classmethod
    def of(cls, cfg: TrainConfig, cores: int, native_bf16: str | None = None, device_type: str = "cpu") -> RunPlan:
        """The plan of ``cfg`` in a process that may use ``cores`` cores (its affinity mask:
        :func:`a3po.placement.cores.usable_cores`, after any pinning), on a ``device_type`` device
        whose native bf16 is ``native_bf16`` (:func:`a3po.devices.native_bf16`; None: emulated)."""
        rl, dist = cfg.rl, cfg.distributed
        bound = effective_max_staleness(rl)
        proximal = proximal_method_name(rl)
        method = PROXIMAL_METHODS.get(proximal)
        source = trainer_logp_source(rl.rollout_correction, bound)
        # Other processes (DeepSpeed ranks, rollout workers) or the overlap producer compute beside the update.
        alternate = bound == 0 and not dist.rollout_workers and dist.deepspeed_config is None and not cfg.oppo.inter
        every_core = max(cfg.torch_threads, cores)  # never fewer than asked
        precision = resolve_precision(cfg.dtype, device_type, native_bf16)
        return cls(
            variant=rl.variant,
            max_staleness=bound,
            staleness_control=rl.staleness_control,
            start_bound=STALENESS_CONTROLS.get(rl.staleness_control).start(bound),
            proximal=proximal,
            proximal_forward=method.needs_forward,
            trainer_logp=source,
            rescore=method.checks_behaviour or source == "producer",
            placement=placement_of(dist),
            schedule=rl.schedule,
            steps=rl.steps,
            alternate=alternate,
            update_threads=(cfg.update_threads or every_core) if alternate else cfg.torch_threads,
            generate_threads=(cfg.generate_threads or every_core) if alternate else cfg.torch_threads,
            precision=precision,
            engine_dtype=decoding_dtype(cfg, precision),
        )


def decoding_dtype(cfg: TrainConfig, precision: Precision) -> DType:
    """The weights the torch rollout engine decodes from, and so every held-out and benchmark
    evaluation of the run (step 0, in the run, the final model): ``rollout.dtype``, or the
    precision's choice when it is null (a bf16 copy under ``dtype: auto`` where bf16 is native). An
    evaluation samples as the run's rollouts do, at the engine's speed (a bf16 copy decodes about
    twice as fast as fp32 on an AMX CPU; under autocast each decode step would cast every weight)."""
    return cfg.rollout.dtype if cfg.rollout.dtype is not None else precision.engine


def evaluation_threads(cfg: TrainConfig, cores: int) -> int:
    """Intra-op threads of evaluating a finished checkpoint in a process that may use ``cores``
    cores. It runs alone, as a synchronous step's generation does, so by the same rule:
    ``generate_threads`` (0: every core), never fewer than ``torch_threads``. Greedy answers may
    round differently on another thread count, so the evaluation cache keys on this figure."""
    return max(cfg.torch_threads, cfg.generate_threads or cores)
