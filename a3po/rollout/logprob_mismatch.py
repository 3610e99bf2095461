"""How far an engine's behaviour log-probs are from the trainer's own forward of the same
weights. The trainer treats ``behav_logp`` as exact (it is the denominator of the behaviour
importance weight); an engine with its own kernels (vLLM) only matches it to a tolerance, and
this is where that tolerance is measured during a run (``proximal: metrics``)."""

from __future__ import annotations

import torch

from a3po.models.factory import empty_like
from a3po.models.logprobs import token_logprobs
from a3po.rollout.types import RolloutBatch


def behaviour_mismatch(engine_logp: torch.Tensor, trainer_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Over the generated tokens (``mask``): mean and max ``|engine - trainer|`` of the log-probs,
    and the mean ``|exp(engine - trainer) - 1|``, the error it puts into the behaviour weight."""
    m = mask.bool()
    if not bool(m.any()):
        return {}
    diff = (engine_logp.float() - trainer_logp.float())[m]
    return {
        "rollout/behav_logp_abs_err": diff.abs().mean().item(),
        "rollout/behav_logp_abs_err_max": diff.abs().max().item(),
        "rollout/behav_iw_err": (diff.exp() - 1.0).abs().mean().item(),
    }


class BehaviourCheck:
    """Re-scores a rollout with a torch copy of the policy at each token's recorded version.

    ``weights(version)`` returns that version's state dict (the producer's
    :meth:`~a3po.producer.weight_store.WeightStore.get`). Runs in the producer thread, one extra
    forward per version present in the batch.

    ``keep_logp``: also return the trainer's log-probs ``(N, L)`` themselves, as
    ``trainer_behav_logp`` (the rollout correction's numerator, ``a3po.algorithms.rollout_correction``),
    from the trainer's own forward (response columns only, ``share_prompt`` as the trainer runs it)."""

    def __init__(self, policy: torch.nn.Module, weights, temperature: float, keep_logp: bool = False,
                 share_prompt: bool = False) -> None:
        self.model = empty_like(policy).eval()
        self.weights, self.temperature = weights, temperature
        self.keep_logp, self.share_prompt = keep_logp, share_prompt

    @torch.no_grad()
    def __call__(self, batch: RolloutBatch) -> dict[str, float | torch.Tensor]:
        trainer_logp = torch.zeros_like(batch.behav_logp)
        forward = dict(start=batch.prompt_len, share_prompt=self.share_prompt) if self.keep_logp else {}
        for v in batch.versions[batch.response_mask].unique().tolist():
            self.model.load_state_dict(self.weights(int(v)))
            logp = token_logprobs(self.model, batch.input_ids, batch.attention_mask, self.temperature, **forward)
            here = batch.response_mask & (batch.versions == v)
            trainer_logp = torch.where(here, logp, trainer_logp)
        figures: dict[str, float | torch.Tensor] = dict(behaviour_mismatch(batch.behav_logp, trainer_logp,
                                                                           batch.response_mask))
        if self.keep_logp:
            figures["trainer_behav_logp"] = trainer_logp
        return figures
