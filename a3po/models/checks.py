"""Checks of a training config against its model and this machine, run before the warm start
(``a3po train``, :func:`a3po.training.run.prepare_warmstart`): what the config alone cannot
tell, because it needs the model's shapes. The model is read without its weights (its
``config.json``, or a built-in architecture built on the ``meta`` device), so a refusal costs
seconds, not a warm start:

* the model itself: a folder or hub name that :mod:`a3po.models.factory` would refuse (its own
  code, pickle weights or none, a hub name offline), named in one line; so are the reward and
  critic-init model folders (``ppo.*_path``), loaded after the warm start;
* LoRA: ``model.lora.target_modules`` must match linear layers of the model, and ``model.lora.r``
  must not exceed the smaller side of any of them (a rank above it adds parameters, not rank);
* an exact anchor stays exact: ``rl.proximal: reuse`` (any method that reads the training
  forward's own log-probs as the proximal policy's) is refused on a model with dropout (its
  config's ``*dropout*`` / ``*pdrop*`` probabilities, or a dropout module): that forward runs in
  training mode, so it is a dropped-out forward, not the current policy (as the config refuses
  it with ``model.lora.dropout``);
* memory: the biggest tensors a run allocates (the rollout's KV cache, a minibatch's logits, the
  held-out samples, the weights with their optimizer state), estimated from the sizes in the
  config, must fit in the memory of the device that trains. The estimate counts only what a run
  cannot avoid holding at once, so a refused config would fail for certain; a config it passes
  may still run short (activations, the allocator's slack);
* disk (where the run folder is known, :func:`check_disk`): what the run folder must hold at
  least (``rl.keep_checkpoints`` checkpoints of the weights, their AdamW state and the newest
  version's weights, and the final model) must fit in the free space of its file system, counting
  what the folder holds already (a resumed run replaces its checkpoints); a lower bound likewise.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from a3po.algorithms.proximal import PROXIMAL_METHODS
from a3po.config import ConfigError, TrainConfig, proximal_method_name
from a3po.devices import resolve_device
from a3po.models.factory import TINY_ARCHS, ModelFolderError, _source, build_tiny_model, check_model_folder
from a3po.models.sources import MODEL_SOURCES

GIB = 2**30
# Bytes of one held-out sample while a held-out evaluation runs: its completion's str object
# (CPython: 49 bytes of header) and a list slot, besides its characters (one per token at least).
SAMPLE_OVERHEAD_BYTES = 64


@dataclass(frozen=True)
class MemoryTerm:
    what: str
    fields: str  # the config fields that size it
    nbytes: int


def model_config(name: str, words: Sequence[str] | None) -> tuple[object, torch.nn.Module]:
    """``(transformers config, model on the meta device)`` of ``model.name``, without reading
    weights; ConfigError naming ``model.name`` when the model cannot be used."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        if name in TINY_ARCHS:
            with torch.device("meta"):
                model, _ = build_tiny_model(name, list(words or ()), device="meta")
            return model.config, model
        source = str(MODEL_SOURCES.get(name).folder()) if name in MODEL_SOURCES else _source(name)
        config = AutoConfig.from_pretrained(source, trust_remote_code=False)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
        return config, model
    except (ModelFolderError, FileNotFoundError, ValueError, KeyError, OSError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"model.name {name!r}: {first}") from None


def linear_shapes(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """``{module path: (in_features, out_features)}`` of every linear layer."""
    return {n: (m.in_features, m.out_features) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def check_lora(cfg: TrainConfig, model: torch.nn.Module) -> None:
    """ConfigError when ``model.lora.target_modules`` matches no linear layer (peft would refuse it
    after the warm start) or ``model.lora.r`` exceeds ``min(in, out)`` of a matched layer."""
    lora = cfg.model.lora
    if lora is None:
        return
    shapes = linear_shapes(model)
    matched = {n: s for n, s in shapes.items() if n.rsplit(".", 1)[-1] in lora.target_modules}
    if not matched:
        names = sorted({n.rsplit(".", 1)[-1] for n in shapes})
        raise ConfigError(f"model.lora.target_modules {list(lora.target_modules)} match no linear layer of model "
                          f"{cfg.model.name!r}; its linear layers are named {names}")
    name, (fan_in, fan_out) = min(matched.items(), key=lambda kv: min(kv[1]))
    if lora.r > min(fan_in, fan_out):
        raise ConfigError(f"model.lora.r {lora.r} exceeds min(in, out) = {min(fan_in, fan_out)} of {name} "
                          f"({fan_in} -> {fan_out}): a rank above it adds parameters, not rank")


def model_dropouts(config, model: torch.nn.Module) -> dict[str, float]:
    """``{name: p}`` of every dropout probability above 0 of a model: its config's fields named
    like one (``attention_dropout``, ``resid_pdrop``, ``hidden_dropout_prob``; nested configs
    too) and its dropout modules (by path), which a forward in training mode applies."""
    found: dict[str, float] = {}
    text = getattr(config, "text_config", None)
    for prefix, cfg in (("", config), ("text_config.", text)):
        for key, value in (vars(cfg) if cfg is not None else {}).items():
            probability = isinstance(value, (int, float)) and not isinstance(value, bool)
            if ("dropout" in key or "pdrop" in key) and probability and value > 0:
                found[f"{prefix}{key}"] = float(value)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            found.setdefault(name, float(module.p))
    return found


def check_exact_anchor(cfg: TrainConfig, config, model: torch.nn.Module) -> None:
    """ConfigError when ``rl.proximal`` reads the training forward's log-probs as the proximal
    policy's (``single_update`` methods) on a model whose training forward drops units."""
    method = proximal_method_name(cfg.rl)
    if not PROXIMAL_METHODS.get(method).single_update:
        return
    drops = model_dropouts(config, model)
    if drops:
        listed = ", ".join(f"{k} {v:g}" for k, v in list(drops.items())[:4]) + (" ..." if len(drops) > 4 else "")
        raise ConfigError(f"rl.proximal {method!r} on model {cfg.model.name!r}, which has dropout ({listed}): the "
                          "training forward it anchors on runs in training mode, so its log-probs are a dropped-out "
                          "forward's, not the proximal policy's; use a copy of the model with those set to 0, or "
                          "rl.proximal recompute")


def memory_terms(cfg: TrainConfig, config, model: torch.nn.Module) -> list[MemoryTerm]:
    """The biggest allocations of a run of ``cfg`` on this model, each a lower bound."""
    rl, data = cfg.rl, cfg.data
    # The engine's KV cache is bf16 under 'auto' where the machine has it (the smaller, for a lower bound);
    # the weights and AdamW state stay fp32 there: only dtype bfloat16 halves them.
    width = 4 if cfg.dtype.value == "float32" else 2
    weight_width = 2 if cfg.dtype.value == "bfloat16" else 4
    text = getattr(config, "text_config", config)
    layers = int(getattr(text, "num_hidden_layers", 1))
    heads = int(getattr(text, "num_attention_heads", 1))
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    vocab = int(text.vocab_size)
    seq = data.max_prompt_tokens + rl.max_new_tokens
    groups = rl.batch_prompts + (cfg.oppo.delta_max if cfg.oppo.inter else 0)
    rows = groups * rl.group_size
    prompts = "(rl.batch_prompts + oppo.delta_max)" if cfg.oppo.inter else "rl.batch_prompts"
    n_params = sum(p.numel() for p in model.parameters())
    if cfg.model.lora is not None:
        r = cfg.model.lora.r
        shapes = linear_shapes(model)
        trained = sum(r * (i + o) for n, (i, o) in shapes.items()
                      if n.rsplit(".", 1)[-1] in cfg.model.lora.target_modules)
        trained_fields = "model.lora.r"
    else:
        trained, trained_fields = n_params, "model.name"
    heldout = data.n_heldout if data.heldout_path is None else 1  # a file's rows are counted when it is read
    return [
        MemoryTerm("the rollout batch's KV cache", f"{prompts} x rl.group_size x (data.max_prompt_tokens + "
                   "rl.max_new_tokens)", rows * seq * layers * 2 * kv_heads * head_dim * width),
        MemoryTerm("a training minibatch's logits",
                   "rl.batch_prompts x rl.group_size / rl.minibatches x rl.max_new_tokens",
                   rl.batch_prompts * rl.group_size // rl.minibatches * rl.max_new_tokens * vocab * 4),
        MemoryTerm("the held-out samples", "data.n_heldout x rl.eval_samples x rl.max_new_tokens",
                   heldout * rl.eval_samples * (SAMPLE_OVERHEAD_BYTES + rl.max_new_tokens)),
        MemoryTerm("the weights, gradients and AdamW state", trained_fields,
                   n_params * weight_width + trained * (weight_width + 8)),
    ]


def machine_memory(device: torch.device) -> tuple[int, str]:
    """Total bytes of the memory a run on ``device`` allocates from, and its name."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.get_device_properties(index).total_memory, f"GPU {index}"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "RAM"


def check_memory(cfg: TrainConfig, config, model: torch.nn.Module, total: int | None = None, kind: str = "RAM") -> None:
    """ConfigError naming the fields of the biggest term when the terms of :func:`memory_terms`
    together exceed ``total`` bytes (default: the training device's memory)."""
    if total is None:
        try:
            total, kind = machine_memory(resolve_device(cfg.device))
        except RuntimeError as e:  # cuda asked for, none here
            raise ConfigError(f"device: {e}") from None
    terms = memory_terms(cfg, config, model)
    need = sum(t.nbytes for t in terms)
    if need > total:
        big = max(terms, key=lambda t: t.nbytes)
        raise ConfigError(f"{big.fields}: a run needs at least {need / GIB:.3g} GiB ({big.what} "
                          f"alone {big.nbytes / GIB:.3g} GiB), more than the {total / GIB:.3g} GiB "
                          f"of {kind} here; lower them")


def disk_terms(cfg: TrainConfig, model: torch.nn.Module) -> list[MemoryTerm]:
    """What a run folder of ``cfg`` on this model holds at least, by file."""
    weight_width = 2 if cfg.dtype.value == "bfloat16" else 4
    n_params = sum(p.numel() for p in model.parameters())
    trained = n_params if cfg.model.lora is None else sum(
        cfg.model.lora.r * (i + o) for n, (i, o) in linear_shapes(model).items()
        if n.rsplit(".", 1)[-1] in cfg.model.lora.target_modules)
    keep = cfg.rl.keep_checkpoints
    return [
        MemoryTerm("the checkpoints' weights and newest weight version", "rl.keep_checkpoints",
                   keep * 2 * n_params * weight_width),
        MemoryTerm("the checkpoints' AdamW state (two fp32 moments per trained weight)", "rl.keep_checkpoints",
                   keep * trained * 8),
        MemoryTerm("the final model", "model.name", n_params * weight_width),
    ]


def _held(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else 0


def check_disk(cfg: TrainConfig, run_dir: Path, model: torch.nn.Module, free: int | None = None) -> None:
    """ConfigError naming the fields when :func:`disk_terms` of ``model`` (its weights or the meta
    skeleton) exceed the free bytes of ``run_dir``'s file system (``free``; default: measured)
    plus what ``run_dir`` holds now."""
    terms = disk_terms(cfg, model)
    need = sum(t.nbytes for t in terms)
    existing = next(p for p in (run_dir, *run_dir.parents) if p.exists())
    room = (shutil.disk_usage(existing).free if free is None else free) + _held(run_dir)
    if need > room:
        big = max(terms, key=lambda t: t.nbytes)
        raise ConfigError(f"{big.fields}: the run folder {run_dir} needs at least {need / GIB:.3g} GiB ({big.what} "
                          f"alone {big.nbytes / GIB:.3g} GiB), more than the {room / GIB:.3g} GiB free there; make "
                          "room or write the run elsewhere (--output-dir)")


def check_model(cfg: TrainConfig, words: Sequence[str] | None = None, run_dir: Path | None = None) -> TrainConfig:
    """``cfg`` once its model can be used as configured on this machine (see the module); else
    ConfigError in one line naming the field. ``words``: the task vocabulary of a built-in
    architecture; ``run_dir``: the run folder, whose disk is checked too where given."""
    config, model = model_config(cfg.model.name, words)
    for field_name, path in (("ppo.reward_model_path", cfg.ppo.reward_model_path),
                             ("ppo.critic_init_path", cfg.ppo.critic_init_path)):
        # loaded after the warm start: its folder is checked now (no code of its own, safe weights)
        if path is not None:
            try:
                check_model_folder(Path(path).expanduser())
            except ModelFolderError as e:
                raise ConfigError(f"{field_name}: {e}") from None
    check_lora(cfg, model)
    check_exact_anchor(cfg, config, model)
    check_memory(cfg, config, model)
    if run_dir is not None:
        check_disk(cfg, run_dir, model)
    return cfg
