"""LoRA through peft: the policy's targeted linear layers get low-rank adapters and only those train.

A layer with an adapter computes ``W0 x + s B A x`` (``s = alpha / r``; ``A`` ``(r, in)``, ``B``
``(out, r)``, ``B = 0`` at the start: Hu et al. 2021, eq. 3). :func:`apply_lora` wraps the policy with
``peft.get_peft_model`` and returns the model peft injected its layers into: the same class, with
the same ``forward`` signature (the KV-cache and ``logits_to_keep`` arguments the trainer's forwards use), so
the training code runs unchanged.

What the rest of the library reads through this module:

* :func:`trained_state` / :func:`load_trained_state`: the weights training changes (the adapters
  alone with LoRA, else the whole state): the policy versions of the weight store and the
  policy entry of a checkpoint.
* :class:`MergedWeights`: a version's adapters -> the full weights of the plain model
  ``W = W0 + s B A`` (the rollout engine's copy, the log-prob check, the exported model). Merged
  rather than peft's forward in the engine: the fast incremental decoder
  (:mod:`a3po.models.decoders`) reads plain weights, one merge per version costs ``r * in * out``
  multiply-adds per layer (a fraction of one decode step), and the merged weights equal peft's
  forward up to float rounding (in bf16 the merge rounds the update into the base weight's
  precision; ``rollout/behav_logp_abs_err`` under ``rl.proximal: metrics`` shows it).

Across processes the same two reads serve: DeepSpeed ranks step the adapters alone (the AdamW is
built on the trainable parameters, :func:`a3po.parallel.updaters.make_updater`; under ZeRO-3,
:func:`keep_base_whole` keeps the base to merge into before the module is partitioned), and a
rollout worker builds this module's model on the same warm start (:func:`with_lora`: the seeded
``A`` and ``B = 0`` make it the trainer's) and merges the adapter versions it is pushed
(:mod:`a3po.placement.worker_loop`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from a3po.config import LoraConfig

ADAPTER = "default"  # peft's adapter name; a policy carries one adapter


def apply_lora(model: torch.nn.Module, cfg: LoraConfig) -> torch.nn.Module:
    """``model`` with LoRA adapters injected in place (``peft.get_peft_model``): every parameter
    frozen but the adapters'. Returns the injected model itself (not the ``PeftModel`` wrapper),
    so callers keep the model's class and forward. The adapters' ``A`` is drawn from a fixed seed
    on the CPU, without touching the run's random stream (``B`` is 0: the model computes what it
    did). Raises ValueError when no module matches ``cfg.target_modules`` or a matched one is
    not a linear layer."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from peft.tuners.lora import Linear as LoraLinear

    if is_lora(model):
        raise ValueError("the model already carries LoRA adapters")
    peft_cfg = PeftLoraConfig(r=cfg.r, lora_alpha=cfg.alpha, target_modules=list(cfg.target_modules),
                              lora_dropout=cfg.dropout,
                              bias="none", task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        inner = get_peft_model(model, peft_cfg).get_base_model()
    wrong = [n for n, m in _lora_layers(inner) if not isinstance(m, LoraLinear)]
    if wrong:  # an embedding or convolution adapter merges differently (MergedWeights covers linear ones)
        raise ValueError(f"model.lora.target_modules matched modules that are not linear layers: {wrong[:5]}")
    return inner


def with_lora(model: torch.nn.Module, cfg: LoraConfig | None) -> torch.nn.Module:
    """The policy a run with ``model.lora: cfg`` trains: ``model`` itself when ``cfg`` is None,
    else with adapters (:func:`apply_lora`; a model that already has them is taken as it is)."""
    if cfg is None:
        if is_lora(model):
            raise ValueError("the model carries LoRA adapters but model.lora is null: set model.lora to train them")
        return model
    if not is_lora(model):
        return apply_lora(model, cfg)
    have = model.peft_config[ADAPTER]
    if (have.r, have.lora_alpha, set(have.target_modules), have.lora_dropout) != (cfg.r, cfg.alpha,
                                                                                  set(cfg.target_modules), cfg.dropout):
        raise ValueError(f"the model's adapters (r {have.r}, alpha {have.lora_alpha}, "
                         f"{sorted(have.target_modules)}, dropout {have.lora_dropout}) are not those "
                         f"model.lora asks for ({cfg})")
    return model


def is_lora(model: torch.nn.Module) -> bool:
    """Whether peft injected adapters into ``model`` (it leaves its config on the model)."""
    return getattr(model, "peft_config", None) is not None


def _lora_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    from peft.tuners.lora import LoraLayer

    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]


def trained_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights training changes, by state-dict key (the tensors themselves, not copies):
    the adapters' with LoRA, else the whole state dict."""
    if not is_lora(model):
        return model.state_dict()
    return {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}


def load_trained_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load what :func:`trained_state` returned; with LoRA exactly the adapters' keys must be there
    (ValueError naming the first missing or unexpected ones: e.g. a full fine-tuning state)."""
    if not is_lora(model):
        model.load_state_dict(state)
        return
    expected = set(trained_state(model))
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(f"not the adapters of this LoRA policy: missing {missing[:3]}, unexpected {unexpected[:3]} "
                         f"({len(missing)} and {len(unexpected)} keys)")
    model.load_state_dict(state, strict=False)


class MergedWeights:
    """A LoRA policy's adapter versions -> the state dict of the plain model (the policy's class
    without peft's layers): ``W = W0 + s B A`` for each adapted linear layer, the other weights
    the policy's own frozen tensors (shared, not copied), or the whole copy :func:`keep_base_whole`
    took before DeepSpeed ZeRO-3 partitioned them. Safe to call from another thread while the
    policy trains: it reads only the frozen weights and the version it is given."""

    def __init__(self, policy: torch.nn.Module) -> None:
        if not is_lora(policy):
            raise ValueError("MergedWeights needs a policy with LoRA adapters (a3po.models.lora.apply_lora)")
        whole = policy.__dict__.get(_WHOLE_BASE)
        self.adapted, self.rest = whole if whole is not None else _frozen_base(policy)

    def __call__(self, adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The full weights of the version whose adapter tensors are ``adapters`` (a
        :func:`trained_state` of the policy); computed in fp32, stored in the base weight's dtype."""
        out = dict(self.rest)
        with torch.no_grad():
            for name, (w0, s) in self.adapted.items():
                a, b = adapters[f"{name}.lora_A.{ADAPTER}.weight"], adapters[f"{name}.lora_B.{ADAPTER}.weight"]
                out[f"{name}.weight"] = w0.float().addmm(b.float(), a.float(), alpha=s).to(w0.dtype)  # W0 + s B A
        return out


_WHOLE_BASE = "_a3po_whole_base"  # the policy attribute keep_base_whole sets


def _frozen_base(policy: torch.nn.Module) -> tuple[dict[str, tuple[torch.Tensor, float]], dict[str, torch.Tensor]]:
    """(adapted layer name -> (W0, s), plain key -> frozen tensor) of ``policy`` as its parameters hold them now."""
    adapted: dict[str, tuple[torch.Tensor, float]] = {}
    for name, layer in _lora_layers(policy):
        if ADAPTER not in layer.lora_A or getattr(layer, "merged", False):
            raise ValueError(f"{name}: expected one unmerged adapter named {ADAPTER!r}")
        if layer.fan_in_fan_out or getattr(layer, "use_dora", {}).get(ADAPTER, False):
            raise ValueError(f"{name}: fan_in_fan_out and DoRA adapters are not merged here")
        adapted[name] = (layer.get_base_layer().weight.detach(), float(layer.scaling[ADAPTER]))
    rest: dict[str, torch.Tensor] = {}
    for key, value in policy.state_dict().items():
        if ".lora_" in key:
            continue
        plain = key.replace(".base_layer.", ".")
        if plain.endswith(".weight") and plain[: -len(".weight")] in adapted:
            continue
        rest[plain] = value
    return adapted, rest


def keep_base_whole(policy: torch.nn.Module) -> None:
    """Keep a whole copy of ``policy``'s frozen base for :class:`MergedWeights` to merge into: called
    before DeepSpeed ZeRO-3 partitions the module (after that its parameters read empty outside a
    gather, a collective every rank would have to enter at each merge)."""
    adapted, rest = _frozen_base(policy)
    policy.__dict__[_WHOLE_BASE] = ({n: (w.clone(), s) for n, (w, s) in adapted.items()},
                                    {k: v.detach().clone() for k, v in rest.items()})


def merged_model(policy: torch.nn.Module, adapters: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    """A plain model of the policy's class (no peft layers) holding the policy's weights with the
    adapters ``adapters`` (default: its current ones) merged, on its device and in its dtype, in
    eval mode: what the run exports, loadable wherever the base model is."""
    from a3po.models.factory import empty_like

    state = MergedWeights(policy)(adapters if adapters is not None else trained_state(policy))
    plain = empty_like(policy)
    plain.load_state_dict(state)
    return plain.eval()
