"""The parts of a run beside the policy that the loop drives one way (:class:`Extension`): the PPO
parts (:class:`a3po.training.ppo_parts.PPOParts`), the trainer side of OPPO's intra-step overlap
(:class:`IntraCritic`) and OPPO's carry-over between batches (:class:`ProducerCarryOver`).

Each keeps its own checkpoint entries, restores them on resume, hears of every update before the
policy's new version is published, and is closed when the run ends.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol

from a3po.config import TrainConfig
from a3po.oppo.intra import IntraScoring
from a3po.placement.registry import Producer
from a3po.producer.producer import ScoredBatch
from a3po.producer.weight_store import Retention
from a3po.training.ppo_parts import PPOParts


class Extension(Protocol):
    """What the loop asks of a part of the run beside the policy."""

    def state(self) -> dict[str, Any]:
        """Its checkpoint entries as of the last update, under their keys on disk."""
        ...

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore from a checkpoint's entries (all of them; it reads its own)."""
        ...

    def after_update(self, step: int, scored: ScoredBatch) -> None:
        """Batch ``step`` (``scored``) has updated the policy; version ``step + 1`` is published next."""
        ...

    def close(self) -> None: ...


class IntraCritic:
    """The trainer side of OPPO's intra-step overlap (:mod:`a3po.oppo.intra`): publishes the
    critic's version of each policy version for the producer's scorers, and checkpoints the
    versions the batches in flight still need (``intra_critic_history``) and the chunk tuner's
    state after the last trained batch (``intra_state``)."""

    def __init__(self, cfg: TrainConfig, ppo: PPOParts, pad_token_id: int, lag: int, retention: Retention) -> None:
        # The critic's versions are kept by the policy store's rule: while a batch not yet trained can read them.
        # The scorers run their own forwards: under ZeRO-3 on a plain copy of the critic (a partitioned one's are
        # collectives).
        scoring_models = ppo if ppo.critic is None else replace(ppo, critic=ppo.plain_critic())
        self.scoring = IntraScoring(scoring_models, cfg.oppo, pad_token_id, retention)
        self.ppo, self.critic, self.lag = ppo, ppo.critic, lag
        self.version = 0  # the policy version of the last publication
        self.tuner_state: dict | None = None

    def begin(self, version: int) -> None:
        """Publish the current critic as ``version`` unless the checkpoint's history holds it
        (call after the critic's weights and this extension's state are restored)."""
        store = self.scoring.critic_store
        if store is not None and store.latest < version:
            with self.ppo.critic_full_weights():  # gathered under ZeRO-3 (every rank calls this)
                self.scoring.publish_critic(version, self.critic)
        self.version = version

    def state(self) -> dict[str, Any]:
        return {"intra_critic_history": self.scoring.critic_history(since=self.version - self.lag),
                "intra_state": self.tuner_state}

    def load_state(self, state: dict[str, Any]) -> None:
        for v, w in sorted(state.get("intra_critic_history", {}).items()):
            self.scoring.critic_store.publish(int(v), w)
        if state.get("intra_state") is not None:  # the chunk tuner continues its schedule
            self.scoring.load_state_dict(state["intra_state"])

    def after_update(self, step: int, scored: ScoredBatch) -> None:
        # Before the policy's: a batch on version step + 1 finds its critic.
        with self.ppo.critic_full_weights():
            self.scoring.publish_critic(step + 1, self.critic)
        self.version, self.tuner_state = step + 1, scored.stream_state

    def close(self) -> None:
        self.scoring.close()


class ProducerCarryOver:
    """OPPO's carry-over buffer (``oppo.inter``): the producer's state after the last trained
    batch (``oppo_state``), i.e. as it was before the next batch the trainer will ask for."""

    def __init__(self, producer: Producer) -> None:
        self.producer = producer
        self.carry: dict | None = None

    def state(self) -> dict[str, Any]:
        return {"oppo_state": self.carry}

    def load_state(self, state: dict[str, Any]) -> None:
        self.producer.load_state_dict(state["oppo_state"])

    def after_update(self, step: int, scored: ScoredBatch) -> None:
        self.carry = scored.producer_state

    def close(self) -> None:
        pass  # the loop stops the producer itself: a producer runs with or without carry-over
