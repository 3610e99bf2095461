"""The optimizer step behind one interface, :class:`Updater`: :class:`LocalUpdater` is torch
AdamW + ``clip_grad_norm_`` in one process; :class:`DeepSpeedUpdater` wraps the policy and the
same AdamW with ``deepspeed.initialize`` (``engine.backward`` / ``engine.step``). The DeepSpeed
JSON holds ZeRO stage and precision; batch sizes and clipping are derived from ``rl.*`` here,
not duplicated (:mod:`a3po.config.preflight`)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch

from a3po.algorithms.checks import require_finite_update
from a3po.config.preflight import read_deepspeed_json, zero_stage
from a3po.models.factory import empty_like
from a3po.models.lora import MergedWeights, is_lora, keep_base_whole
from a3po.parallel.ranks import Ranks
from a3po.storage.checkpoint import CheckpointError


class Updater(Protocol):
    """One optimizer update per minibatch loss; ``model`` is what the forward passes call."""

    model: torch.nn.Module
    partitioned: bool  # ZeRO-3: each rank holds a slice of every parameter, read them in full_weights()

    def full_weights(self) -> AbstractContextManager:
        """Inside it the policy's parameters hold the full weights on every rank (a collective
        under ZeRO-3: every rank enters it; read-only)."""
        ...

    def set_lr(self, lr: float) -> None: ...

    def update(self, loss: torch.Tensor) -> float:
        """Backward, clip, step; returns the gradient norm before clipping."""
        ...

    def optimizer_state(self) -> Any:
        """For the checkpoint (a collective under DeepSpeed: every rank calls it)."""
        ...

    def load_optimizer_state(self, state: Any) -> None: ...


class LocalUpdater:
    """One process: torch AdamW and ``clip_grad_norm_`` (the trainer's original calls, in order)."""

    def __init__(self, policy: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float,
                 what: str = "policy") -> None:
        self.model, self.optimizer, self.grad_clip = policy, optimizer, grad_clip
        self.partitioned, self.what = False, what  # what: the model a non-finite update is reported for

    def full_weights(self) -> AbstractContextManager:
        return nullcontext()

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def update(self, loss: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        require_finite_update(loss, grad_norm, self.what)  # before the step: the weights stay the last good ones
        self.optimizer.step()
        return float(grad_norm)

    def optimizer_state(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        if "ranks" in state:
            raise CheckpointError(
                f"the checkpoint was written by {state['world_size']} DeepSpeed ranks at ZeRO stage "
                f"{state['zero_stage']}; resume it with the same distributed config and launch"
            )
        self.optimizer.load_state_dict(state)


class DeepSpeedUpdater:
    """The policy and a torch AdamW wrapped by ``deepspeed.initialize`` (ZeRO stage 1, 2 or 3).

    Under ZeRO-3 the policy's parameters are partitioned over the ranks (``deepspeed.initialize``
    partitions the module's current weights, so a checkpoint's weights load before it): whatever
    reads the full weights does so inside :meth:`full_weights`, and the ZeRO-3 optimizer keeps its
    fp32 partitions outside the client AdamW's param groups (they are put there only during its step).

    With ``model.lora`` the AdamW holds the adapters alone (:func:`make_updater`), so DeepSpeed
    flattens, partitions, reduces and steps only them: the frozen base has no gradient, no master
    copy and no optimizer state on any rank, and :meth:`optimizer_state` holds the adapters'
    partitions. Under ZeRO-3 the base is partitioned too; each rank keeps a whole copy of it to
    merge adapter versions into (:func:`a3po.models.lora.keep_base_whole`: the rollout copy, the
    held-out copy, the export), and :meth:`full_weights` gathers the adapters alone (all that
    the weight store and checkpoints read of a LoRA policy)."""

    def __init__(
        self, policy: torch.nn.Module, optimizer: torch.optim.Optimizer, ds: dict[str, Any], minibatch_rows: int,
        grad_clip: float, ranks: Ranks,
        what: str = "policy",
    ) -> None:
        import deepspeed

        self.what = what

        if minibatch_rows % ranks.world_size:
            raise ValueError(
                f"rl.batch_prompts x rl.group_size / rl.minibatches = {minibatch_rows} rows per minibatch "
                f"do not split over {ranks.world_size} ranks"
            )
        config = {
            **ds,
            # One engine.step per minibatch, each rank holding its shard of it.
            "train_batch_size": minibatch_rows,
            "train_micro_batch_size_per_gpu": minibatch_rows // ranks.world_size,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": grad_clip,
        }
        self.ranks, self.stage, self._optimizer = ranks, zero_stage(ds), optimizer
        self.lora = is_lora(policy)
        if self.stage == 3 and self.lora:  # the merges into the base read it whole: copy it before ZeRO-3 partitions it
            keep_base_whole(policy)
        # The world is the trainer ranks' alone, rollout workers or not (a3po.parallel.ranks.init_ranks).
        self.engine, _, _, _ = deepspeed.initialize(model=policy, optimizer=optimizer, config=config,
                                                    dist_init_required=False)
        self.model = self.engine
        self.partitioned = self.stage == 3

    def full_weights(self) -> AbstractContextManager:
        if not self.partitioned:
            return nullcontext()
        import deepspeed

        # modifier_rank=None: read-only, every rank gathers; on exit the parameters are partitioned again.
        params = self.engine.module.parameters()
        if self.lora:  # trained_state reads the adapters alone
            params = (p for p in params if p.requires_grad)
        return deepspeed.zero.GatheredParameters(list(params), modifier_rank=None)

    def set_lr(self, lr: float) -> None:
        # Under ZeRO the client AdamW steps this rank's flat fp32 partition; its groups carry the rate.
        for group in self._optimizer.param_groups:
            group["lr"] = lr

    def update(self, loss: torch.Tensor) -> float:
        # The loss is this rank's share of the whole minibatch's token mean; DeepSpeed averages
        # gradients over ranks, so scale by the world size to reduce to the sum (= the mean's gradient).
        self.engine.backward(loss * self.ranks.world_size)
        self.engine.step()
        grad_norm = float(self.engine.get_global_grad_norm())
        # After the step (DeepSpeed clips and steps in one call): the run stops before a checkpoint holds it.
        require_finite_update(loss, grad_norm, self.what)
        return grad_norm

    def optimizer_state(self) -> dict[str, Any]:
        """Every rank's AdamW state and fp32 master weights (its ZeRO partition: the AdamW's own
        parameters; under bf16 the module's weights are rounded copies of them), plain tensors,
        gathered to rank 0 so one atomic file holds the whole step. At scale each rank would
        write its own shard instead."""
        mine = {"adamw": self._adamw_state(), "master": [p.detach().clone() for p in self._master()]}
        return {"world_size": self.ranks.world_size, "zero_stage": self.stage, "ranks": self.ranks.gather_to_main(mine)}

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or "ranks" not in state:
            raise CheckpointError("the checkpoint's optimizer state was written by a single-process run; "
                                  "resume it without DeepSpeed")
        if (state["world_size"], state["zero_stage"]) != (self.ranks.world_size, self.stage):
            raise CheckpointError(
                f"the checkpoint's optimizer is partitioned for {state['world_size']} ranks at ZeRO stage "
                f"{state['zero_stage']}; this run has {self.ranks.world_size} ranks at stage {self.stage}"
            )
        mine = state["ranks"][self.ranks.rank]
        master = self._master()
        if len(master) != len(mine["master"]) or any(p.shape != s.shape
                                                     for p, s in zip(master, mine["master"], strict=True)):
            raise CheckpointError(
                f"rank {self.ranks.rank}'s optimizer partition in the checkpoint has shapes "
                f"{[tuple(s.shape) for s in mine['master']]}, this run's {[tuple(p.shape) for p in master]}"
            )
        if self.partitioned:
            adamw = mine["adamw"]
            for group, saved in zip(self._optimizer.param_groups, adamw["groups"], strict=True):
                group.update(saved)
            for p, saved in zip(master, adamw["state"], strict=True):
                self._optimizer.state[p] = {k: v.clone() for k, v in saved.items()}
        else:
            self._optimizer.load_state_dict(mine["adamw"])
        with torch.no_grad():
            for p, saved in zip(master, mine["master"], strict=True):
                p.copy_(saved)
            if self.partitioned:
                # The module's own partitions (ds_tensor views of these flats) follow the master
                # weights; in fp32 on one device they are the same tensors and this is a no-op copy.
                for flat, p in zip(self.engine.optimizer.fp16_partitioned_groups_flat, master, strict=True):
                    if flat is not p:
                        flat.copy_(p)

    def _master(self) -> list[torch.Tensor]:
        if self.partitioned:  # one flat fp32 tensor per sub-group, this rank's slice of every parameter
            return list(self.engine.optimizer.fp32_partitioned_groups_flat)
        return [p for group in self._optimizer.param_groups for p in group["params"]]

    def _adamw_state(self) -> dict[str, Any]:
        if not self.partitioned:
            return self._optimizer.state_dict()
        # ZeRO-3 empties the AdamW's param groups between steps (the state is keyed by the flats), so
        # torch's state_dict cannot index it: the hyperparameters and per-flat state, in flat order.
        return {
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in self._optimizer.param_groups],
            "state": [{k: v.detach().clone() for k, v in self._optimizer.state.get(p, {}).items()}
                      for p in self._master()],
        }


def plain_model(policy: torch.nn.Module, state: dict[str, torch.Tensor],
                into: torch.nn.Module | None = None) -> torch.nn.Module:
    """A module of the policy's class holding ``state``, outside DeepSpeed (reused when ``into``
    is given): what rank 0 evaluates and exports while the policy itself is partitioned. With
    LoRA ``state`` is a version's adapters (:func:`a3po.models.lora.trained_state`), merged into the base."""
    if is_lora(policy):
        state = MergedWeights(policy)(state)
    if into is None:
        into = empty_like(policy)
    into.load_state_dict(state)
    return into.eval()


def make_updater(policy: torch.nn.Module, rl, deepspeed_config: str | None,
                 ranks: Ranks) -> LocalUpdater | DeepSpeedUpdater:
    """The trainer's AdamW (:func:`a3po.algorithms.optimizers.adamw`; the rate is set per step)
    behind the right updater."""
    from a3po.algorithms.optimizers import adamw

    optimizer = adamw([p for p in policy.parameters() if p.requires_grad], rl.lr)  # with LoRA: the adapters alone
    if deepspeed_config is None:
        return LocalUpdater(policy, optimizer, rl.grad_clip)
    ds = read_deepspeed_json(deepspeed_config, rl.grad_clip)
    rows = rl.batch_prompts * rl.group_size // rl.minibatches
    return DeepSpeedUpdater(policy, optimizer, ds, rows, rl.grad_clip, ranks)


def make_critic_updater(critic: torch.nn.Module, optimizer: torch.optim.Optimizer, rl, deepspeed_config: str | None,
                        ranks: Ranks) -> LocalUpdater | DeepSpeedUpdater:
    """The PPO critic's own updater beside the policy's: in one process its AdamW and clip; under
    DeepSpeed a second ``deepspeed.initialize`` engine over the critic and its AdamW, with the
    policy's JSON (ZeRO stage, precision) and batch sizes: each rank trains on its shard of every
    minibatch, its optimizer state partitioned like the policy's. Build it after the critic's
    checkpointed weights are loaded (ZeRO-3 partitions the module's current weights)."""
    if deepspeed_config is None:
        return LocalUpdater(critic, optimizer, rl.grad_clip, what="critic")
    ds = read_deepspeed_json(deepspeed_config, rl.grad_clip)
    rows = rl.batch_prompts * rl.group_size // rl.minibatches
    return DeepSpeedUpdater(critic, optimizer, ds, rows, rl.grad_clip, ranks, what="critic")
