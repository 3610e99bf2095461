"""The whole config (:class:`TrainConfig`): its sections, the run-wide fields (output folder,
threads, device, precision) and the rules that span sections, checked once every section has
checked its own; and the history of renamed fields (:data:`RENAMED_FIELDS`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from a3po.algorithms.advantages import ADVANTAGE_ESTIMATORS
from a3po.algorithms.guard import GUARD_POLICIES
from a3po.algorithms.proximal import PROXIMAL_METHODS
from a3po.config.data import DataConfig, WarmStartConfig
from a3po.config.distributed import DistributedConfig
from a3po.config.errors import MAX_THREADS
from a3po.config.model import ModelConfig
from a3po.config.ppo import PPOConfig
from a3po.config.rl import RLConfig, effective_max_staleness, proximal_method_name
from a3po.config.rollout import OppoConfig, RolloutConfig
from a3po.devices import Device, DType

# Fields renamed since configs were first written, old dotted name -> new one (same section): a
# config that names the old one is refused naming the new one, and a checkpoint's saved config
# reads as the new name (a3po.config.compat), so runs saved before the rename still resume.
RENAMED_FIELDS = {"oppo.d_inc": "oppo.delta_grow", "oppo.d_dec": "oppo.delta_shrink"}


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    oppo: OppoConfig = field(default_factory=OppoConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    output_dir: str = "runs/default"
    torch_threads: int = 1
    """Intra-op threads of each Python thread. The rollout producer and the trainer are two
    threads; one intra-op thread each maps them onto two cores without oversubscription."""
    update_threads: int = 0
    """Intra-op threads of a training update where the producer idles meanwhile (sync, rollouts
    in process; see a3po.placement.cores); 0: every core. Results do not depend on it. On a machine busy
    with other work, OpenMP threads beyond the free cores slow an update down many times: set 1."""
    generate_threads: int = 1
    """Intra-op threads of generation where the trainer idles meanwhile (sync, rollouts in
    process; see a3po.placement.cores) and of evaluating a checkpoint (the warm start's held-out
    figure and each final model's: a3po.config.plan.evaluation_threads); 0: every core. Worth it
    where a batch takes seconds (the ``smol`` preset sets 0: a synchronous step's generation then
    runs at twice the speed); where
    decode steps take milliseconds (``tiny``) it slowed the update that follows (0.27 s a step
    instead of 0.17 s; likely the generation threads' OpenMP pool still spinning), hence 1 by default.
    Decoding on another thread count may round differently, so a run is bit-reproducible for a
    given value on a given machine."""
    device: Device = Device.AUTO
    """Where the model, rollouts and training run: 'auto' (cuda when available), 'cpu', 'cuda'."""
    dtype: DType = DType.FLOAT32
    """Precision: 'float32', 'bfloat16' (bf16 weights, autocast on CUDA; on a CPU without native bf16
    it runs, emulated and several times slower, with a warning at start) or 'auto' (fp32 weights and
    AdamW state; forwards and backwards under bf16 autocast and a bf16 rollout engine where the
    hardware has native bf16: CUDA, or a CPU reporting AMX-BF16 / AVX512-BF16; fp32 elsewhere).
    Log-probs and losses in fp32 in every case (:func:`a3po.devices.resolve_precision`)."""

    def __post_init__(self) -> None:
        if not 1 <= self.torch_threads <= MAX_THREADS or not all(0 <= n <= MAX_THREADS
                                                                 for n in (self.update_threads, self.generate_threads)):
            raise ValueError("torch_threads must be >= 1, update_threads and generate_threads >= 0, all at "
                             f"most {MAX_THREADS} (threads beyond the cores only cost; torch crashes on huge counts), "
                             f"got {self.torch_threads}, {self.update_threads} and {self.generate_threads}")
        if not self.output_dir:
            raise ValueError("output_dir must be a directory name, got ''")
        for name, enum in (("device", Device), ("dtype", DType)):
            try:
                object.__setattr__(self, name, enum(getattr(self, name)))
            except ValueError:
                raise ValueError(f"{name} must be one of {[e.value for e in enum]}, "
                                 f"got {getattr(self, name)!r}") from None
        if self.oppo.inter and proximal_method_name(self.rl) == "behaviour":
            # Carried tokens are stale; the behaviour-only proximal would anchor the trust region there.
            raise ValueError("oppo.inter carries tokens over to later policy versions: use a staleness-aware "
                             "proximal method (rl.variant loglinear, recompute, or rl.proximal loglinear/recompute)")
        if self.oppo.intra:
            if self.ppo.kl_coef == 0 and self.ppo.critic == "none" and self.ppo.reward != "model":
                raise ValueError("oppo.intra needs scoring models to overlap with decoding "
                                 "(ppo.kl_coef > 0, ppo.critic, or ppo.reward: model): the PPO "
                                 "path; the GRPO path has none")
        if self.rl.rollout_correction != "none" and self.oppo.inter:
            # Carried tokens keep only their version numbers, and the overlap producer re-scores nothing.
            raise ValueError("rl.rollout_correction with oppo.inter is not supported yet: the "
                             "trainer's log-probs of a carried token's behaviour version are not "
                             "kept; use oppo.inter: false")
        if (self.rl.rollout_correction != "none" and self.distributed.rollout_workers
                and effective_max_staleness(self.rl) > 0):
            # Async: the producer re-scores each batch (a3po.algorithms.rollout_correction.trainer_logp_source);
            # rollout workers do not send those log-probs back yet. Sync computes them in the trainer.
            raise ValueError("rl.rollout_correction with distributed.rollout_workers needs every token "
                             "on-policy (rl.variant sync or rl.max_staleness 0): asynchronously the workers would have "
                             "to send the trainer's log-probs back")
        if self.rl.guard_every and GUARD_POLICIES.get(self.rl.guard_policy).tightens:
            self._check_tighten()
        if self.rl.filter_groups:
            self._check_group_filter()
        needs_values = ADVANTAGE_ESTIMATORS.get(self.rl.advantage).needs_values
        if needs_values and self.ppo.critic == "none":
            raise ValueError(f"rl.advantage {self.rl.advantage!r} needs critic values: set "
                             "ppo.critic (e.g. 'policy_copy')")
        if not needs_values and self.ppo.critic != "none":  # a critic nobody reads would only cost time
            raise ValueError(f"ppo.critic is {self.ppo.critic!r} but rl.advantage {self.rl.advantage!r} does "
                             "not use values (use gae)")
        if self.data.train_path is None and self.rl.batch_prompts > self.data.n_train:
            # Each batch draws rl.batch_prompts distinct rows: a smaller set would cut every batch below the size
            # the staleness bound's admission counts (a3po.data.datasets.require_batch_rows checks files when read).
            raise ValueError(f"rl.batch_prompts {self.rl.batch_prompts} is more than data.n_train "
                             f"{self.data.n_train}: every batch "
                             "draws that many distinct training problems; lower rl.batch_prompts or raise data.n_train")
        if self.model.lora is not None:
            self._check_lora()
        if (self.rollout.engine != "torch" and self.distributed.deepspeed_config is not None
                and not self.distributed.rollout_workers):
            # With rollout workers the engine runs in the workers alone and the trainer ranks only train.
            raise ValueError(f"rollout.engine {self.rollout.engine!r} with distributed.deepspeed_config "
                             "and no rollout workers: every trainer rank would start its own engine; run the engine in "
                             "distributed.rollout_workers")
        if self.rl.eval_mode == "background" and self.distributed.deepspeed_config is not None:
            # The snapshot is a copy of whole weights in one process; the figures reach every trainer rank.
            raise ValueError("rl.eval_mode 'background' with distributed.deepspeed_config is not supported: under "
                             "DeepSpeed the held-out figures are a collective of the trainer ranks (rank 0 evaluates, "
                             "every rank receives them at the step) and ZeRO-3 partitions the weights a snapshot would "
                             "copy; a background evaluation is a thread of one trainer process (rollout workers may "
                             "run beside it). Use rl.eval_mode 'inline'")

    def _check_tighten(self) -> None:
        """Where the guard may lower the staleness bound mid-run: admission alone must enforce it
        (rollout workers take the bound with each version: a3po.placement.remote_rollouts)."""
        if self.rl.schedule == "deterministic":
            # The schedule derives each batch's versions, and the store the versions it keeps, from the bound.
            raise ValueError("rl.guard_policy 'tighten' with rl.schedule 'deterministic': the schedule fixes each "
                             "batch's weight versions, and the versions the store keeps, from rl.max_staleness for the "
                             "whole run; use rl.schedule 'threaded', or rl.guard_policy 'warn' or 'recompute'")

    def _check_group_filter(self) -> None:
        """Where a batch's groups can be told to carry no signal before the update, and refilled."""
        if self.ppo.kl_coef > 0 or self.ppo.reward == "model":
            # The advantage then reads per-token rewards (score minus the KL penalty) or the reward
            # model's scores, which the producer does not have when it grades.
            raise ValueError("rl.filter_groups with ppo.kl_coef > 0 or ppo.reward 'model': a group's advantages are "
                             "then not zero when its graded rewards are equal; use ppo.kl_coef 0 and the grader's "
                             "rewards")
        if self.oppo.inter or self.oppo.intra:
            raise ValueError("rl.filter_groups with oppo.inter or oppo.intra is not supported: OPPO hands out groups "
                             "as they finish decoding (inter) or scores them while they decode (intra), and the "
                             "filter grades and refills a whole batch; use one or the other")

    def _check_lora(self) -> None:
        """The combinations LoRA does not run with (yet), each with its reason (DeepSpeed ranks and
        rollout workers run with it)."""
        if self.ppo.critic != "none":
            raise ValueError(f"ppo.critic {self.ppo.critic!r} with model.lora is not supported: the "
                             "critic copies the policy's backbone (whose layers peft has wrapped) and trains all of "
                             "it, the full-size update LoRA avoids")
        if self.model.lora.dropout > 0 and PROXIMAL_METHODS.get(proximal_method_name(self.rl)).single_update:
            raise ValueError(f"rl.proximal {proximal_method_name(self.rl)!r} with model.lora.dropout "
                             f"{self.model.lora.dropout}: the training forward drops adapter inputs, so its "
                             "log-probs are not the proximal policy's; set model.lora.dropout 0 or use recompute")
