"""The models PPO adds beside the policy: the frozen reference (a copy of the warm start), the
critic (a causal LM with a scalar value per token, ``AutoModelForTokenClassification``,
``num_labels=1``, by default initialised from the policy) and the reward model (a one-label
sequence classifier read as ``sigmoid(logit)``), with their forwards. Shapes ``(N, L)`` per token,
aligned to ``input_ids`` as :func:`a3po.models.logprobs.token_logprobs`."""

from __future__ import annotations

import copy

import torch

from a3po.devices import autocast_for, autocasts, set_autocast
from a3po.models.logprobs import position_ids_from_mask


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The reference policy: a copy of ``model`` now (the warm start), no gradients, eval mode."""
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def build_critic(policy: torch.nn.Module, init_path: str | None = None) -> torch.nn.Module:
    """A value model from the policy: the same backbone (copied weights) with a fresh scalar
    head per token (``AutoModelForTokenClassification``, ``num_labels=1``, no dropout), on the
    policy's device and in its dtype. The head starts near 0 (std ``initializer_range``).
    ``init_path``: the backbone comes from that reward model instead (same architecture)."""
    from transformers import AutoModelForTokenClassification

    config = copy.deepcopy(policy.config)
    config.num_labels = 1
    config.classifier_dropout = 0.0  # the default 0.1 would make V_old and V differ by noise
    param = next(policy.parameters())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # the head's initialisation does not consume the run's random stream
        critic = AutoModelForTokenClassification.from_config(config, trust_remote_code=False)
    critic.to(device=param.device, dtype=param.dtype)
    # base_model of a *ForCausalLM is its backbone: the critic starts with the policy's features.
    backbone = (policy.base_model if init_path is None
                else load_reward_model(init_path, param.device, param.dtype, "ppo.critic_init_path").base_model)
    critic.base_model.load_state_dict(backbone.state_dict())
    set_autocast(critic, autocasts(policy))  # and computes as the policy does (bf16 autocast under dtype auto)
    return critic.eval()


def token_values(critic: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``V(s_t)`` per token ``(N, L)`` in fp32, aligned like log-probs: column ``t`` is the value
    of the prefix before token ``t`` (the head's output at position ``t - 1``); column 0 is 0."""
    with autocast_for(critic):
        out = critic(input_ids=input_ids, attention_mask=attention_mask,
                     position_ids=position_ids_from_mask(attention_mask), use_cache=False)
    v = out.logits[..., 0].float()  # (N, L)
    return torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], dim=1)


def reward_model_scores(reward_model: torch.nn.Module, input_ids: torch.Tensor,
                        attention_mask: torch.Tensor) -> torch.Tensor:
    """``sigmoid(logit)`` per sequence ``(N,)``, fp32, of a one-label sequence-classification
    model (it reads its logit at each row's rightmost non-pad token: the last response token):
    the probability that the completion is correct, on the grader's 0..1 scale."""
    with torch.no_grad(), autocast_for(reward_model):
        out = reward_model(input_ids=input_ids, attention_mask=attention_mask,
                           position_ids=position_ids_from_mask(attention_mask), use_cache=False)
    return torch.sigmoid(out.logits[:, 0].float())


def load_reward_model(path: str, device: torch.device, dtype: torch.dtype,
                      field: str = "ppo.reward_model_path") -> torch.nn.Module:
    """A one-label sequence-classification model from a local directory (safetensors: loading
    runs no code), frozen, in eval mode."""
    from pathlib import Path

    from transformers import AutoModelForSequenceClassification

    from a3po.models.factory import ModelFolderError, check_model_folder

    if not Path(path).is_dir():
        raise FileNotFoundError(f"{field} {path} is not a model directory")
    try:  # no code of the folder's own, no pickle weights
        check_model_folder(Path(path))
    except ModelFolderError as e:
        raise ModelFolderError(f"{field}: {e}") from None
    rm = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype, trust_remote_code=False).to(device)
    if rm.config.num_labels != 1:
        raise ValueError(f"{path}: a reward model has one label (a scalar score), this one has {rm.config.num_labels}")
    if rm.config.pad_token_id is None:
        raise ValueError(f"{path}: the reward model's config has no pad_token_id (needed to "
                         "find each row's last token)")
    for p in rm.parameters():
        p.requires_grad_(False)
    return rm.eval()
