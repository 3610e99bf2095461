"""``python -m tests.support.trainer_behaviour_check ...``: ``a3po.training.command`` with the trainer
checking every batch a rollout worker sends against its own weights.

A worker's ``proximal: metrics`` figures compare the engine with the worker's copy of the version
it received, so a version mixed up on the way (the wrong weights pushed under a version's number,
tokens labelled with another version) reaches both and shows nothing. Here the trainer process
keeps a copy of every version it publishes (:class:`a3po.placement.remote_rollouts.RemoteRollouts`'
store, before it is sent) and re-scores each received batch with a plain torch forward of the
version each token records (with LoRA: the adapters merged into the base, as the engine gets them),
as tests/oppo/test_vllm.py does in process. One JSON line per batch goes to the file
``$A3PO_TRAINER_BEHAVIOUR_LOG``: the batch index, the versions in it, the max ``|behav_logp -
trainer forward|`` over its generated tokens, and the same against the version before (a control:
how large a wrong version's error is; null where that version was not published).
"""

from __future__ import annotations

import json
import os
import sys
import threading

import torch

from a3po.models.factory import empty_like
from a3po.models.logprobs import token_logprobs
from a3po.models.lora import MergedWeights, is_lora
from a3po.placement import remote_rollouts
from a3po.producer.producer import ScoredBatch

LOG_ENV = "A3PO_TRAINER_BEHAVIOUR_LOG"


class TrainerCheck:
    """The trainer's copies of its published versions and the forward that re-scores a batch."""

    def __init__(self, policy: torch.nn.Module, store, temperature: float, path: str) -> None:
        self.merge = MergedWeights(policy) if is_lora(policy) else None
        self.model = empty_like(policy).eval()
        self.temperature, self.path = temperature, path
        self.versions: dict[int, dict[str, torch.Tensor]] = {}
        self.lock = threading.Lock()
        for v in store.versions():
            self.keep(v, store.get(v))
        publish = store.publish

        def publish_and_keep(version: int, state: dict[str, torch.Tensor]) -> None:
            self.keep(version, state)
            publish(version, state)

        store.publish = publish_and_keep

    def keep(self, version: int, state: dict[str, torch.Tensor]) -> None:
        with self.lock:
            self.versions[version] = {k: v.detach().clone().cpu() for k, v in state.items()}

    @torch.no_grad()
    def _max_err(self, batch, version: int, here: torch.Tensor) -> float | None:
        with self.lock:
            state = self.versions.get(version)
        if state is None:
            return None
        self.model.load_state_dict(self.merge(state) if self.merge is not None else state)
        logp = token_logprobs(self.model, batch.input_ids, batch.attention_mask, self.temperature)
        return (batch.behav_logp.float() - logp.float())[here].abs().max().item()

    def check(self, sb: ScoredBatch) -> None:
        batch = sb.rollout
        resp = batch.response_mask.bool()
        versions = [int(v) for v in batch.versions[resp].unique().tolist()]
        errs, wrong = [], []
        for v in versions:
            here = resp & (batch.versions == v)
            errs.append(self._max_err(batch, v, here))
            wrong.append(self._max_err(batch, v - 1, here))
        record = {"index": sb.index, "versions": versions, "tokens": int(resp.sum()), "max_err": max(errs),
                  "wrong_version_err": None if any(w is None for w in wrong) else min(wrong)}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def install(path: str) -> None:
    """Wrap :class:`RemoteRollouts` (the trainer's side of the workers) so that it checks each batch."""
    cls = remote_rollouts.RemoteRollouts
    init, next_batch = cls.__init__, cls.next_batch

    def checked_init(self, inp, store, start, ranks) -> None:
        init(self, inp, store, start, ranks)
        self.trainer_check = TrainerCheck(inp.policy, store, inp.cfg.rl.temperature, path)

    def checked_next_batch(self, timeout: float = 600.0) -> ScoredBatch:
        sb = next_batch(self, timeout)
        self.trainer_check.check(sb)
        return sb

    cls.__init__, cls.next_batch = checked_init, checked_next_batch


def read_log(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


if __name__ == "__main__":
    install(os.environ[LOG_ENV])
    from a3po.training.command import main

    sys.exit(main())
