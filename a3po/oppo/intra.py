"""OPPO intra-step overlap wired into the PPO path: the rollout producer streams each chunk of
generated tokens to scorer threads (:mod:`a3po.oppo.streaming`) for the reference log-probs, the
critic's values and the reward model's scores while the actor keeps decoding; the scored batch
carries those tensors and :func:`a3po.training.step.train_step` uses them instead of running the
reference, critic and reward model again.

Which weights score a batch:

* the reference and the reward model are frozen: the trainer's own modules (only the scorer
  threads run them while intra is on);
* the critic is trained by the trainer while the producer scores: the scorers read their own
  copy, loaded with the critic's snapshot **at the policy version the batch starts on** (the
  rule of the policy's :class:`~a3po.producer.weight_store.WeightStore`; the trainer publishes critic
  version ``v`` next to policy version ``v``). With ``max_staleness = 0`` that is the critic
  ``train_step`` would use, so values equal those of intra off (within float rounding of cached vs
  full attention, ~1e-7 in fp32). With ``s >= 1`` the values come from a critic up to ``s``
  versions older than intra off's, the same staleness as the tokens themselves.

With ``oppo.inter`` the producer is :class:`~a3po.oppo.overcommit.OverlapProducer`: each step's
block is prompt + partial answer of every unfinished sample (a carried answer is rescored from its
start with the critic of that step's version), and done samples keep their figures in the
carry-over buffer until their group trains.

With rollout workers (``distributed.rollout_workers``) the scorers run in each worker, beside its
engine, on the worker's own models: the reference is a frozen copy of the warm start (which the
worker loads, as the trainer builds its reference from it before a checkpoint loads), the reward
model is read from ``ppo.reward_model_path`` as in the trainer, and the critic's version ``v``
travels with policy version ``v`` over the weights link as raw bytes (the trainer's critic store is
the source). So a worker scores with the very weights the in-process scorers would read, and the
streamed tensors travel back to the trainer exactly (raw tensors beside the batch); the trainer's
own scorer threads idle. Scoring in the trainer on receipt would be exact too, but would not overlap
anything with decoding: the overlap is the point. Each worker keeps its own chunk tuner; the
trainer checkpoints them per worker (``{"workers": [...]}``, :meth:`IntraScoring.load_state_dict`).

The chunk size comes from a :class:`~a3po.oppo.chunk_tuner.ChunkTuner` fed with each batch's
production time per generated token. Its pick depends on timing and chunks of another size round
differently (~1e-7), so with ``chunk_min < chunk_max`` runs are reproducible to float rounding,
not bit for bit; pin ``chunk_min = chunk_max`` for bitwise reproducible runs. The tuner's state
after each batch travels with it (``ScoredBatch.stream_state``) and the checkpoint keeps the last
trained batch's, so a resumed run continues the tuner's schedule (probe or exploit, costs, steps
since the probe) where it was.
"""

from __future__ import annotations

import copy
from typing import Protocol

import torch

from a3po.config import OppoConfig
from a3po.oppo.chunk_tuner import ChunkTuner
from a3po.oppo.streaming import ChunkFeeder, LogProbHead, ValueHead, start_scorers, stop_scorers
from a3po.producer.weight_store import Retention, WeightStore, clone_state
from a3po.rollout.padding import left_pad


class ScoringModels(Protocol):
    """What the scorers need from the trainer's PPO parts (:class:`a3po.training.ppo_parts.PPOParts`):
    the frozen reference and reward model, the critic (each None when unused) and the sampling
    temperature the reference is scored at."""

    reference: torch.nn.Module | None
    critic: torch.nn.Module | None
    reward_model: torch.nn.Module | None
    temperature: float


class IntraScoring:
    """The producer side of the overlap: :meth:`begin` a batch (returns the ``on_token`` hook for
    the engine), :meth:`finish` it (the tensors the trainer reuses); the trainer side
    :meth:`publish_critic` after each step."""

    def __init__(self, ppo: ScoringModels, oppo: OppoConfig, pad_token_id: int,
                 retention: Retention | None = None) -> None:
        models: dict[str, tuple[torch.nn.Module, object]] = {}
        if ppo.reference is not None:
            models["ref_logp"] = (ppo.reference, LogProbHead(ppo.temperature))
        self.critic_copy: torch.nn.Module | None = None
        self.critic_store: WeightStore | None = None
        if ppo.critic is not None:
            self.critic_copy = copy.deepcopy(ppo.critic).eval()
            for p in self.critic_copy.parameters():
                p.requires_grad_(False)
            self.critic_store = WeightStore(retention)
            models["values"] = (self.critic_copy, ValueHead())
        if ppo.reward_model is not None:
            # Per-position logits; the column is picked in finish() as the model's own forward does.
            models["reward_logits"] = (ppo.reward_model, ValueHead())
            self.reward_pad_id = ppo.reward_model.config.get_text_config().pad_token_id
        if not models:
            raise ValueError("oppo.intra: no reference, critic or reward model to overlap with decoding")
        self.pad_token_id = pad_token_id
        self.tuner = ChunkTuner(oppo.chunk_min, oppo.chunk_max, oppo.chunk_probe_every)
        self.threads = start_scorers(models)
        self._feeder: ChunkFeeder | None = None
        self._critic_version: int | None = None
        # a rollout-worker checkpoint's tuner states, one per worker
        self.worker_states: list[dict | None] | None = None

    # --- trainer side ---------------------------------------------------------------------

    def publish_critic(self, version: int, critic: torch.nn.Module | None) -> None:
        """Critic weights as of policy version ``version`` (publish before the policy's)."""
        if self.critic_store is not None and critic is not None:
            self.critic_store.publish(version, clone_state(critic))

    def critic_history(self, since: int) -> dict[int, dict[str, torch.Tensor]]:
        return self.critic_store.history(since) if self.critic_store is not None else {}

    # --- producer side --------------------------------------------------------------------

    def begin(self, prompts: list[list[int]], version: int):
        """Start scoring a batch sampled from policy ``version`` onwards; returns ``on_token``."""
        if self.critic_store is not None and version != self._critic_version:
            # The scorer thread is idle here: the previous batch's finish() waited for it.
            self.critic_copy.load_state_dict(self.critic_store.get(version))
            self._critic_version = version
        ids, mask = left_pad(prompts, self.pad_token_id)  # the engine's prompt block
        device = next(iter(self.threads.values())).scorer.model.device
        self._feeder = ChunkFeeder(self.threads, self.tuner.chunk_size())
        self._busy0 = {k: t.busy_s for k, t in self.threads.items()}
        self._feeder.start(ids.to(device), mask.to(device))
        return self._feeder.on_token

    def finish(self, input_ids: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """The streamed tensors in the batch's layout, and the batch's oppo/* figures."""
        raw = self._feeder.finish()
        out: dict[str, torch.Tensor] = {}
        if "ref_logp" in raw:
            out["ref_logp"] = raw["ref_logp"]  # aligned like token_logprobs: column 0 is 0
        if "values" in raw:
            v = raw["values"]  # column t: V of the prefix up to t; shift as a3po.models.critic.token_values does
            out["values"] = torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], dim=1)
        if "reward_logits" in raw:
            # The sequence-classification forward reads each row's rightmost non-pad token.
            non_pad = (input_ids != self.reward_pad_id).long()
            cols = torch.arange(input_ids.shape[1], device=input_ids.device)
            last = (cols * non_pad).argmax(-1)
            out["scores"] = torch.sigmoid(raw["reward_logits"].gather(1, last[:, None]).squeeze(1))
        for name, t in out.items():
            if t.shape[0] != input_ids.shape[0] or (t.dim() == 2 and t.shape != input_ids.shape):
                raise RuntimeError(f"streamed {name} has shape {tuple(t.shape)}, the batch {tuple(input_ids.shape)}")
        metrics = {"oppo/chunk_size": float(self._feeder.chunk_size), "oppo/chunks": float(self._feeder.chunks_sent),
                   **{f"oppo/scorer_busy_s/{k}": t.busy_s - self._busy0[k] for k, t in self.threads.items()}}
        return out, metrics

    def record(self, seconds: float, generated_tokens: int, mean_length: float) -> None:
        self.tuner.record(seconds, generated_tokens, mean_length)

    def state_dict(self) -> dict:
        """JSON-able state: the chunk tuner's (the critic versions are checkpointed apart)."""
        return {"chunk_tuner": self.tuner.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """The chunk tuner's state; with rollout workers ``{"workers": [state_0, ...]}``, kept in
        :attr:`worker_states` for the workers (their hello), whose scorers run the tuners."""
        if "workers" in state:
            self.worker_states = state["workers"]
            # one worker: resumable in one process too
            if len(self.worker_states) == 1 and self.worker_states[0] is not None:
                self.tuner.load_state_dict(self.worker_states[0]["chunk_tuner"])
            return
        self.worker_states = [state]
        self.tuner.load_state_dict(state["chunk_tuner"])

    def close(self) -> None:
        if self.critic_store is not None:
            self.critic_store.close()
        stop_scorers(self.threads)
