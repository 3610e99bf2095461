"""Roofline of the update and decode phases: the machine's measured matmul peak (fp32, bf16) beside what
an update and a decode achieve, alone and overlapped.

    python -m bench.roofline                                   # smollm2-135m-instruct (make setup-smol), 2 threads
    python -m bench.roofline --threads 1 --precisions float32  # one core, fp32 only
    python -m bench.roofline --model micro --matmul-n 256 --batch 4 --prompt-len 6 --response-len 8 --reps 1   # smoke

1. Peak: ``--matmul-n`` square matmuls (fp32, and bf16 where asked), ``--reps`` timed after one untimed,
   on ``--threads`` threads; GFLOPS = 2 n^3 / t of the fastest.
2. Update: forward + backward of ``--batch`` sequences of ``--prompt-len`` prompt + ``--response-len``
   response tokens, as the trainer runs them (``token_logprobs`` from the prompt width: logits on the
   response only, entropy aside), fp32 weights; ``bf16`` is bf16 autocast on them (``dtype: auto``).
   FLOPs = 3 x forward (backward ~ 2 x forward), forward = 2 x body parameters x tokens (embeddings
   are lookups) + 2 x hidden x vocabulary x response tokens (the head) + causal attention
   2 x layers x T^2 x (heads x head dim) per sequence.
3. Decode: the project's engine (once per ``rollout.sampler``: ``multinomial``, ``inverse_cdf``, the row
   ``engine+inverse_cdf``) and transformers' ``generate``, ``--batch`` rows of the same prompts,
   up to ``--decode-tokens`` new tokens at T = 1; ``bf16`` decodes a bf16 copy of the weights (the
   engine's copy under ``dtype: auto``). Only live rows' tokens count (EOS included, padding not):
   FLOPs = the prefill's forward (its last position's head only) + per generated token 2 x (body
   parameters + hidden x vocabulary) + attention 4 x layers x context x (heads x head dim).
4. Overlap (the disaggregated placement's split): the update and the engine's decode (``--sampler``) in two processes
   pinned one core each, each phase alone on its core and then both at once; a phase's time is the
   median of its reps that ran wholly while the other phase ran too.

5. Vocabulary (the work over the head's ``V`` entries, side by side in one run): the trainer's log-prob and
   entropy of ``--batch`` x ``--response-len`` positions, forward + backward from the logits (in the
   precision's logits dtype), as the full fp32 log-softmax (``sampling_log_softmax``, the path of a top-p
   below 1) and as ``picked_logprobs``' chunks (what the trainer runs); and one decode step's draw of
   ``--batch`` tokens, as the engine's ``torch.multinomial`` (one exponential per vocabulary entry) and as
   :func:`~a3po.rollout.sampling.inverse_cdf_draw` (one uniform number per row: ``rollout.sampler:
   inverse_cdf``). Median milliseconds of ``--reps``.

6. Where the update's time goes: one more update under ``torch.profiler`` (CPU), each op's own time
   (its children's excluded, so the categories add up to the profiled update) summed by kind:
   ``matmul`` (``mm``/``addmm``/``bmm``: the layers' and the head's GEMMs, forward and backward; its
   GFLOPS and % of peak from the update's FLOPs above less attention's), ``attention`` (the fused SDPA kernels),
   ``casts`` (autocast's and every other dtype copy), ``vocabulary`` (log-softmax / logsumexp / exp
   over the head's entries) and ``the rest`` (elementwise ops, norms, views, the autograd engine).
   The profiler's own overhead is in the total, so the shares matter, not the seconds.

Percent of peak is against the peak of the phase's matmul precision (fp32 or bf16) on the same threads
(the overlap: on one thread). Prints a table, then as the very last line one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from a3po.data.arithmetic import WORDS
from a3po.devices import cpu_native_bf16, set_autocast
from a3po.models.factory import count_parameters, empty_like, load_model
from a3po.models.logprobs import picked_logprobs, sampling_log_softmax, token_logprobs
from a3po.placement.cores import usable_core_ids
from a3po.rollout.sampling import SAMPLERS, inverse_cdf_draw
from a3po.rollout.torch_engine import RolloutEngine
from a3po.rollout.types import SamplingParams
from bench.rollout_engines import TransformersGenerate

PRECISIONS = {"float32": torch.float32, "bf16": torch.bfloat16}


def matmul_peak_gflops(n: int, dtype: torch.dtype, reps: int) -> float:
    """GFLOPS of the fastest of ``reps`` ``n x n`` matmuls in ``dtype`` (one untimed first)."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=g).to(dtype) for _ in range(2))
    torch.mm(a, b)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


@dataclass(frozen=True)
class Shape:
    """What the FLOP counts need of a causal LM."""

    body: int  # parameters outside the input embedding and the head: 2 FLOPs per token each
    hidden: int
    vocab: int
    layers: int
    attn_dim: int  # heads x head dim (the query side of attention)

    @classmethod
    def of(cls, model: torch.nn.Module) -> Shape:
        c = model.config
        embed = model.get_input_embeddings().weight
        head = model.get_output_embeddings().weight
        outside = embed.numel() + (head.numel() if head.data_ptr() != embed.data_ptr() else 0)
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return cls(
            count_parameters(model) - outside,
            c.hidden_size,
            c.vocab_size,
            c.num_hidden_layers,
            c.num_attention_heads * head_dim,
        )

    def update_flops(self, batch: int, prompt: int, response: int) -> float:
        t = prompt + response
        return self.update_gemm_flops(batch, prompt, response) + 3.0 * 2 * self.layers * batch * t**2 * self.attn_dim

    def update_gemm_flops(self, batch: int, prompt: int, response: int) -> float:
        """The update's FLOPs outside attention: the layers' and the head's matrix products."""
        return 3.0 * (2 * self.body * batch * (prompt + response) + 2 * self.hidden * self.vocab * batch * response)

    def decode_flops(self, rows: int, prompt: int, tokens: int, mean_context: float) -> float:
        prefill = (
            2 * self.body * rows * prompt
            + 2 * self.layers * rows * prompt**2 * self.attn_dim
            + 2 * self.hidden * self.vocab * rows
        )
        per_token = 2 * (self.body + self.hidden * self.vocab) + 4 * self.layers * mean_context * self.attn_dim
        return float(prefill + per_token * tokens)


def prompt_ids(model, tok, batch: int, length: int) -> torch.Tensor:
    """``(batch, length)`` seeded random ids of the model's ordinary vocabulary (no special token)."""
    special = {i for i in (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) if i is not None}
    allowed = torch.tensor([i for i in range(model.config.vocab_size) if i not in special])
    return allowed[torch.randint(len(allowed), (batch, length), generator=torch.Generator().manual_seed(0))]


def load(name: str):
    model, tok = load_model(name, words=WORDS)
    return model.eval(), tok


def _update_once(model, ids: torch.Tensor, start: int) -> None:
    model.train()  # as the trainer runs it (the decoders run the same module in eval mode)
    mask = torch.ones_like(ids)
    logp = token_logprobs(model, ids, mask, 1.0, start=start)
    logp[:, start:].sum().backward()
    model.zero_grad(set_to_none=True)
    model.eval()


def _decode_once(engine, prompts: list[list[int]], new_tokens: int, seed: int) -> int:
    """Generated tokens of live rows (EOS included, padding not)."""
    return int(
        engine.generate_batch(prompts, SamplingParams(new_tokens, temperature=1.0), seed=seed).response_mask.sum()
    )


def _decoder_model(model, dtype: torch.dtype):
    if dtype == torch.float32:
        return model
    copy = empty_like(model, dtype).eval()
    copy.load_state_dict(model.state_dict())
    return copy


def _setup(args, model, tok, precision: str):
    """(the update, the model decoding runs on, the decode's prompts) in ``precision``."""
    dtype = PRECISIONS[precision]
    set_autocast(model, dtype == torch.bfloat16)  # fp32 master weights, bf16 autocast: dtype auto
    ids = prompt_ids(model, tok, args.batch, args.prompt_len + args.response_len)
    return (
        (lambda: _update_once(model, ids, args.prompt_len)),
        _decoder_model(model, dtype),
        ids[:, : args.prompt_len].tolist(),
    )


def _timed(fn, reps: int) -> tuple[float, list]:
    fn_out = [fn()]  # untimed: lazy initialisation
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn_out.append(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times), fn_out[1:]


def vocabulary(args, vocab: int, precision: str) -> dict[str, float]:
    """Milliseconds of the work over the vocabulary (module docstring, 5), each way, median of ``args.reps``."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(args.batch, args.response_len, vocab, generator=gen).to(PRECISIONS[precision])
    targets = torch.randint(vocab, (args.batch, args.response_len), generator=gen)

    def full() -> None:
        x = logits.detach().requires_grad_()
        logp_all = sampling_log_softmax(x, 0.7)
        picked = logp_all.gather(-1, targets[..., None]).squeeze(-1)
        with torch.no_grad():
            p = logp_all.exp()
            -(p * torch.where(p > 0, logp_all, torch.zeros_like(logp_all))).sum(-1)
        picked.sum().backward()

    def chunked() -> None:
        x = logits.detach().requires_grad_()
        picked, _ = picked_logprobs(x, targets, 0.7, return_entropy=True)
        picked.sum().backward()

    probs = torch.softmax(logits[:, 0].float(), dim=-1)
    out = {}
    for name, fn in (
        ("logprob_full_ms", full),
        ("logprob_chunked_ms", chunked),
        ("sample_multinomial_ms", lambda: torch.multinomial(probs, 1, generator=gen)),
        ("sample_inverse_cdf_ms", lambda: inverse_cdf_draw(probs, torch.rand((args.batch, 1), generator=gen))),
    ):
        out[name] = 1e3 * _timed(fn, args.reps)[0]
    return out


UPDATE_KINDS = {  # aten op -> kind, for the update's breakdown (item 6 of the module docstring)
    **dict.fromkeys(("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"), "matmul"),
    **dict.fromkeys(("aten::to", "aten::_to_copy", "aten::copy_"), "casts"),
    **dict.fromkeys(("aten::_log_softmax", "aten::_log_softmax_backward_data", "aten::logsumexp", "aten::exp",
                     "aten::exp_", "aten::_softmax", "aten::_softmax_backward_data"), "vocabulary"),
}


def update_breakdown(update) -> dict[str, float]:
    """Seconds of one profiled ``update()`` by kind of op (:data:`UPDATE_KINDS`; attention by name)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        update()
    out = dict.fromkeys(("matmul", "attention", "casts", "vocabulary", "the rest"), 0.0)
    for e in prof.key_averages():
        kind = "attention" if "scaled_dot_product" in e.key else UPDATE_KINDS.get(e.key, "the rest")
        out[kind] += e.self_cpu_time_total / 1e6
    return out


def _phase_worker(args_dict: dict, phase: str, precision: str, core: int, start, done, out) -> None:
    """One process of the overlap: pinned to ``core``, one thread, ``phase`` repeated from when
    ``start`` is passed until it has run ``reps`` times and the other process has too."""
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    args = argparse.Namespace(**args_dict)
    model, tok = load(args.model)
    update, decoder_model, prompts = _setup(args, model, tok, precision)
    engine = RolloutEngine(decoder_model, tok.eos_token_id, tok.pad_token_id, sampler=args.sampler)
    run = update if phase == "update" else (lambda: _decode_once(engine, prompts, args.decode_tokens, 0))
    run()  # untimed
    start.wait()
    spans, tokens = [], []
    while True:
        t0 = time.monotonic()
        tokens.append(run())
        spans.append((t0, time.monotonic()))
        if len(spans) == args.reps:
            with done.get_lock():
                done.value += 1
        if len(spans) >= args.reps and done.value >= start.parties:
            break
    out.put((phase, spans, tokens))


def overlap(args, precision: str, cores: list[int]) -> dict:
    """Each phase alone on its own core, then both at once (see the module docstring)."""
    ctx = mp.get_context("spawn")
    result: dict[str, dict] = {}
    runs = {"alone_update": ["update"], "alone_decode": ["decode"], "overlapped": ["update", "decode"]}
    for label, phases in runs.items():
        start, done, out = ctx.Barrier(len(phases)), ctx.Value("i", 0), ctx.Queue()
        procs = [
            ctx.Process(target=_phase_worker, args=(vars(args), p, precision, cores[i], start, done, out))
            for i, p in enumerate(phases)
        ]
        for p in procs:
            p.start()
        got = {}
        for _ in procs:
            phase, spans, tokens = out.get(timeout=3600)
            got[phase] = (spans, tokens)
        for p in procs:
            p.join()
        window = (max(s[0][0] for s, _ in got.values()), min(s[-1][1] for s, _ in got.values()))
        for phase, (spans, tokens) in got.items():
            reps = [(b - a, n, a >= window[0] and b <= window[1]) for (a, b), n in zip(spans, tokens, strict=True)]
            inside = [(t, n) for t, n, both in reps if both] or [(t, n) for t, n, _ in reps]
            result.setdefault(phase, {})[label.split("_")[0]] = {
                "s": statistics.median(t for t, _ in inside),
                "reps": len(inside),
                "tokens": statistics.median(n for _, n in inside) if phase == "decode" else None,
            }
    for r in result.values():
        r["slowdown"] = r["overlapped"]["s"] / r["alone"]["s"]
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.roofline", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model", default="smollm2-135m-instruct", help="a model.name (default smollm2-135m-instruct: make setup-smol)"
    )
    ap.add_argument(
        "--threads", type=int, default=2, help="torch intra-op threads of the peak, update and decode rows (default 2)"
    )
    ap.add_argument(
        "--precisions",
        default=None,
        help="comma-separated from float32, bf16 (default: both where the CPU has native bf16, else float32)",
    )
    ap.add_argument("--matmul-n", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=16, help="sequences of the update, rows of the decode (default 16)")
    ap.add_argument("--prompt-len", type=int, default=60)
    ap.add_argument(
        "--response-len", type=int, default=100, help="response tokens of the update's sequences (default 100)"
    )
    ap.add_argument("--decode-tokens", type=int, default=64, help="new tokens at most per decoded row (default 64)")
    ap.add_argument("--reps", type=int, default=3, help="timed repeats of each measurement (default 3)")
    ap.add_argument("--no-overlap", action="store_true", help="skip the two pinned processes")
    ap.add_argument("--sampler", default="inverse_cdf", choices=sorted(SAMPLERS),
                    help="rollout.sampler of the overlap's decode (default inverse_cdf, the smol preset's)")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if (
        min(args.threads, args.matmul_n, args.batch, args.prompt_len, args.response_len, args.decode_tokens, args.reps)
        < 1
    ):
        ap.error(
            "--threads, --matmul-n, --batch, --prompt-len, --response-len, --decode-tokens and --reps must be >= 1"
        )
    native = cpu_native_bf16()
    precisions = [
        p.strip() for p in (args.precisions or ("float32,bf16" if native else "float32")).split(",") if p.strip()
    ]
    if not precisions or any(p not in PRECISIONS for p in precisions):
        ap.error(f"--precisions: comma-separated from {list(PRECISIONS)}, got {args.precisions!r}")
    torch.set_num_threads(args.threads)
    model, tok = load(args.model)
    shape = Shape.of(model)
    print(
        f"roofline: model {args.model} ({count_parameters(model) / 1e6:.1f}M parameters, "
        f"{shape.body / 1e6:.1f}M in the body, "
        f"vocab {shape.vocab}); {args.threads} thread(s); CPU native bf16: {native or 'none'}; median of {args.reps}"
    )

    peak = {p: matmul_peak_gflops(args.matmul_n, PRECISIONS[p], args.reps) for p in precisions}
    peak_1 = (
        {p: matmul_peak_gflops(args.matmul_n, PRECISIONS[p], args.reps) for p in precisions}
        if args.threads != 1
        else peak
    )
    rows: list[dict] = []
    update_flops = shape.update_flops(args.batch, args.prompt_len, args.response_len)
    phases: dict[str, dict] = {"update": {}, "decode": {}}
    for p in precisions:
        update, decoder_model, prompts = _setup(args, model, tok, p)
        s, _ = _timed(update, args.reps)
        phases["update"][p] = {"flops": update_flops, "s": s, "breakdown": update_breakdown(update)}
        engines = {
            "engine": RolloutEngine(decoder_model, tok.eos_token_id, tok.pad_token_id),
            "engine+inverse_cdf": RolloutEngine(decoder_model, tok.eos_token_id, tok.pad_token_id, sampler="inverse_cdf"),
            "transformers": TransformersGenerate(decoder_model, tok.eos_token_id, tok.pad_token_id),
        }
        for name, engine in engines.items():
            s, toks = _timed(
                lambda engine=engine, prompts=prompts: _decode_once(engine, prompts, args.decode_tokens, 0), args.reps
            )
            tokens = statistics.median(toks)
            mean_context = args.prompt_len + tokens / args.batch / 2
            phases["decode"][f"{p}/{name}"] = {
                "flops": shape.decode_flops(args.batch, args.prompt_len, tokens, mean_context),
                "s": s,
                "tokens": tokens,
                "tokens_per_s": tokens / s,
            }
    set_autocast(model, False)
    vocab = {p: vocabulary(args, shape.vocab, p) for p in precisions}
    for phase, entries in phases.items():
        for key, r in entries.items():
            prec = key.split("/")[0]
            r["gflops"] = r["flops"] / r["s"] / 1e9
            r["pct_peak"] = 100 * r["gflops"] / peak[prec]
            rows.append({"what": f"{phase} {key}", **r})

    ov = None
    cores = usable_core_ids()
    if args.no_overlap:
        ov = {"skipped": "--no-overlap"}
    elif len(cores) < 2:
        ov = {"skipped": f"{len(cores)} usable core(s): the overlap needs two"}
    else:
        ov = {}
        for p in precisions:
            r = overlap(args, p, list(cores)[:2])
            r["update"]["flops"] = update_flops
            tokens = r["decode"]["overlapped"]["tokens"]
            r["decode"]["flops"] = shape.decode_flops(
                args.batch, args.prompt_len, tokens, args.prompt_len + tokens / args.batch / 2
            )
            for phase in ("update", "decode"):
                for when in ("alone", "overlapped"):
                    e = r[phase][when]
                    flops = (
                        r[phase]["flops"]
                        if phase == "update"
                        else shape.decode_flops(
                            args.batch, args.prompt_len, e["tokens"], args.prompt_len + e["tokens"] / args.batch / 2
                        )
                    )
                    e["gflops"] = flops / e["s"] / 1e9
                    e["pct_peak"] = 100 * e["gflops"] / peak_1[p]
            ov[p] = r

    print(
        f"\npeak matmul {args.matmul_n}^2: "
        + ", ".join(f"{p} {g:.1f} GFLOPS" for p, g in peak.items())
        + (
            f" ({args.threads} threads); one thread: " + ", ".join(f"{p} {g:.1f}" for p, g in peak_1.items())
            if peak_1 is not peak
            else ""
        )
    )
    head = f"{'phase precision/engine':<30} {'GFLOP':>9} {'s':>8} {'GFLOPS':>9} {'% peak':>7} {'tokens/s':>9}"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        tps = f"{r['tokens_per_s']:>9.1f}" if "tokens_per_s" in r else f"{'':>9}"
        print(
            f"{r['what']:<30} {r['flops'] / 1e9:>9.1f} {r['s']:>8.3f} {r['gflops']:>9.1f} {r['pct_peak']:>6.1f}% {tps}"
        )
    print(f"\nvocabulary ({shape.vocab} entries), ms, median of {args.reps}: {args.batch} x {args.response_len} "
          f"positions' log-prob + entropy, forward + backward; one draw of {args.batch} tokens")
    head = f"{'logits dtype':<14} {'full log-softmax':>17} {'chunked':>9} {'ratio':>6} {'multinomial':>12} {'inverse CDF':>12} {'ratio':>6}"
    print(head + "\n" + "-" * len(head))
    for p, v in vocab.items():
        print(f"{p:<14} {v['logprob_full_ms']:>17.1f} {v['logprob_chunked_ms']:>9.1f} "
              f"{v['logprob_full_ms'] / v['logprob_chunked_ms']:>5.2f}x {v['sample_multinomial_ms']:>12.2f} "
              f"{v['sample_inverse_cdf_ms']:>12.2f} {v['sample_multinomial_ms'] / v['sample_inverse_cdf_ms']:>5.1f}x")
    print("\nwhere the update's time goes (one profiled update; seconds include the profiler's overhead)")
    kinds = list(next(iter(phases["update"].values()))["breakdown"])
    head = f"{'precision':<10} " + " ".join(f"{k:>16}" for k in kinds) + f" {'matmul GFLOPS':>14} {'% peak':>7}"
    print(head + "\n" + "-" * len(head))
    for p, r in phases["update"].items():
        b = r["breakdown"]
        total = sum(b.values())
        gemm = shape.update_gemm_flops(args.batch, args.prompt_len, args.response_len)
        mm_gflops = gemm / b["matmul"] / 1e9 if b["matmul"] else float("nan")
        print(f"{p:<10} " + " ".join(f"{b[k]:>8.2f} ({100 * b[k] / total:>3.0f}%)" for k in kinds)
              + f" {mm_gflops:>14.1f} {100 * mm_gflops / peak[p]:>6.1f}%")
    if "skipped" in ov:
        print(f"\noverlap: skipped ({ov['skipped']})")
    else:
        print(f"\noverlap: update and engine decode pinned one core each (cores {list(cores)[:2]}), one thread each")
        head = (f"{'phase precision':<20} {'alone s':>8} {'both s':>8} {'slowdown':>9} {'% peak alone':>13} "
                f"{'% peak both':>12}")
        print(head + "\n" + "-" * len(head))
        for p, r in ov.items():
            for phase in ("update", "decode"):
                a, b = r[phase]["alone"], r[phase]["overlapped"]
                print(
                    f"{phase + ' ' + p:<20} {a['s']:>8.3f} {b['s']:>8.3f} {r[phase]['slowdown']:>8.2f}x "
                    f"{a['pct_peak']:>12.1f}% {b['pct_peak']:>11.1f}%"
                )
    summary = {
        "bench": "roofline",
        "model": args.model,
        "params": count_parameters(model),
        "body_params": shape.body,
        "threads": args.threads,
        "native_bf16": native,
        "matmul_n": args.matmul_n,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "response_len": args.response_len,
        "decode_tokens": args.decode_tokens,
        "reps": args.reps,
        "peak_gflops": peak,
        "peak_gflops_1_thread": peak_1,
        "update": phases["update"],
        "decode": phases["decode"],
        "overlap": ov,
        "vocabulary": vocab,
        "command": "python -m bench.roofline " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
