"""The evaluation runner: a model (in memory or a checkpoint path) on benchmarks, graded.

Reads top to bottom like the pipeline: load records -> render prompts -> generate (batched, via
the project's rollout engine ``a3po.rollout.torch_engine.generate_text``) -> cut at stop strings -> grade
(``a3po.grading``) -> metrics (``eval.metrics``) -> write ``results.json`` and one JSONL line per
completion (prompt, completion, extracted answer, gold, score). Greedy decoding gives pass@1;
``n_samples`` sampled completions per problem give mean@n and unbiased pass@k.

Generation is the same code path the RL trainer samples with, so an evaluation measures the
policy the trainer actually produces (no second inference stack to drift from it).

Metrics per benchmark (``results.json``; the CLI's last line names them ``<benchmark>/<metric>``):

- ``pass@1``           fraction of problems whose greedy completion scores 1 (0-1);
- ``mean@n``           mean score of all n sampled completions (0-1; the expected sampled pass@1);
- ``pass@k``           unbiased P(at least one of k samples is correct), Chen et al. 2021 (0-1);
- ``grading_timeouts`` completions whose math-verify comparison hit the timeout (count, scored 0);
- ``grading_errors``   completions the grader could not decide: worker unavailable, evaluator
  error, or an in-process failure caught by the grader's guard (count, scored 0; a benchmark run
  keeps going, the count says how much it is worth);
- ``grading_too_long`` completions whose text, answer or gold exceeded the grader's length caps
  (count, scored 0 without parsing);
- ``no_answer_rate``   fraction of completions in which no final answer was found (0-1);
- ``n_problems``, ``seconds`` (wall clock for generation and grading).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from a3po.grading import grade, stats
from eval.data import BENCHMARKS, EvalRecord, load_benchmark
from eval.metrics import mean, summarize_samples
from eval.prompts import PromptConfig, render

DEFAULT_STOPS = ("\nQuestion:", "\nProblem:", "<|im_end|>", "<|endoftext|>", "</s>")


@dataclass(frozen=True)
class EvalConfig:
    """One evaluation run (the CLI's flags map one to one onto these fields)."""

    max_new_tokens: int = 512
    """Generated tokens per completion, >= 1."""
    batch_size: int = 32
    """Prompts per generate call, >= 1."""
    greedy: bool = True
    """Decode once greedily per problem -> pass@1."""
    n_samples: int = 0
    """Sampled completions per problem (0 = none) -> mean@n and pass@k."""
    temperature: float = 0.6
    """Sampling temperature for the n samples, > 0."""
    top_p: float = 0.95
    """Nucleus mass for the n samples, in (0, 1]."""
    ks: tuple[int, ...] = ()
    """pass@k values to report, each in [2, n_samples]; empty = powers of two up to n_samples."""
    seed: int = 0
    limit: int | None = None
    """First ``limit`` problems of each benchmark (None = all)."""
    prompt: PromptConfig = field(default_factory=PromptConfig)
    stop: tuple[str, ...] = DEFAULT_STOPS
    """Completions are cut at the first of these (a base model goes on to write the next problem)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.batch_size < 1:
            raise ValueError("max_new_tokens and batch_size must be >= 1")
        if self.n_samples < 0:
            raise ValueError(f"n_samples must be >= 0, got {self.n_samples}")
        if not self.greedy and self.n_samples == 0:
            raise ValueError("nothing to do: greedy=False and n_samples=0")
        if self.n_samples and not (self.temperature > 0 and 0 < self.top_p <= 1):
            raise ValueError("sampling needs temperature > 0 and top_p in (0, 1]")
        for k in self.ks:
            if not 2 <= k <= max(self.n_samples, 1):
                raise ValueError(f"pass@{k} needs 2 <= k <= n_samples={self.n_samples} (k=1 under sampling is mean@n)")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1, got {self.limit}")


def pass_ks(cfg: EvalConfig) -> tuple[int, ...]:
    """The k of pass@k to report: ``cfg.ks``, or the powers of two in [2, n_samples]."""
    if cfg.ks:
        return cfg.ks
    ks, k = [], 2
    while k <= cfg.n_samples:
        ks.append(k)
        k *= 2
    return tuple(ks)


def truncate_at_stop(text: str, stops: Sequence[str]) -> str:
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut]


def load_model(spec: str):
    """``(model, tokenizer, name)`` for ``spec``: a built-in size such as ``tiny`` (a random
    model over the embedded task's vocabulary, for offline smoke runs) or a local checkpoint /
    hub name (``a3po.models.factory.load_model``, as training loads them)."""
    from a3po.data.arithmetic import WORDS
    from a3po.models.factory import load_model as load

    model, tokenizer = load(spec, words=WORDS)
    return model, tokenizer, str(spec)


def _generate(model, tokenizer, prompts: list[str], cfg: EvalConfig, sampled: bool) -> list[str]:
    from a3po.rollout.torch_engine import generate_text
    from a3po.rollout.types import SamplingParams

    params = SamplingParams(
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature if sampled else 0.0,
        top_p=cfg.top_p if sampled else 1.0,
    )
    outs = generate_text(model, tokenizer, prompts, params, seed=cfg.seed, batch_size=cfg.batch_size)
    return [truncate_at_stop(o, cfg.stop) for o in outs]


def evaluate_records(model, tokenizer, benchmark: str, records: list[EvalRecord], cfg: EvalConfig) -> tuple[dict[str, Any], list[dict]]:
    """Metrics and per-completion records of ``model`` on ``records`` of ``benchmark``."""
    spec = BENCHMARKS.get(benchmark)
    template = spec.default_template if cfg.prompt.template == "auto" else cfg.prompt.template
    pcfg = PromptConfig(template=template, instruction=cfg.prompt.instruction, system=cfg.prompt.system)
    prompts = [render(r.prompt, tokenizer, pcfg) for r in records]
    metrics: dict[str, Any] = {"n_problems": len(records)}
    items: list[dict] = []

    def graded(sample: str, completions: list[str], recs: list[EvalRecord], ps: list[str]) -> list[float]:
        scores = []
        for rec, prompt, completion in zip(recs, ps, completions, strict=True):
            g = grade(spec.task, completion, rec.gold)
            scores.append(g.score)
            items.append({
                "benchmark": benchmark, "id": rec.id, "sample": sample, "prompt": prompt, "completion": completion,
                "extracted": g.extracted, "method": g.method, "gold": rec.gold, "score": g.score,
                "timed_out": g.timed_out, "error": g.error, "worker_error": g.worker_error or g.grader_error,
            })
        return scores

    t0 = time.perf_counter()
    if cfg.greedy:
        completions = _generate(model, tokenizer, prompts, cfg, sampled=False)
        metrics["pass@1"] = mean(graded("greedy", completions, records, prompts))
    if cfg.n_samples:
        n = cfg.n_samples
        rep_recs = [r for r in records for _ in range(n)]
        rep_prompts = [p for p in prompts for _ in range(n)]
        completions = _generate(model, tokenizer, rep_prompts, cfg, sampled=True)
        flat = graded("sampled", completions, rep_recs, rep_prompts)
        metrics.update(summarize_samples([flat[i * n : (i + 1) * n] for i in range(len(records))], pass_ks(cfg)))
    metrics["grading_timeouts"] = sum(1 for it in items if it["timed_out"])
    metrics["grading_errors"] = sum(1 for it in items if it["worker_error"])
    metrics["grading_too_long"] = sum(1 for it in items if (it["error"] or "").endswith(" too long"))
    metrics["no_answer_rate"] = mean([1.0 if it["extracted"] is None else 0.0 for it in items])
    metrics["seconds"] = round(time.perf_counter() - t0, 3)
    return metrics, items


# Bytes a graded completion holds until the results are written, besides its characters: its
# record (a dict of a dozen fields), its str object and three list slots. A lower bound.
COMPLETION_BYTES = 512


def check_sample_memory(bench: str, n_problems: int, cfg: EvalConfig, held: int = 0, total: int | None = None) -> None:
    """ValueError naming ``n_samples`` (``a3po eval --n-samples``) when the completions of
    ``n_problems`` problems (with ``held`` kept from earlier benchmarks) cannot fit in this
    machine's RAM: every completion is kept until the results are written."""
    import torch

    from a3po.models.checks import GIB, machine_memory

    total = total if total is not None else machine_memory(torch.device("cpu"))[0]
    count = held + n_problems * (cfg.n_samples + int(cfg.greedy))
    need = count * (COMPLETION_BYTES + cfg.max_new_tokens)
    if need > total:
        raise ValueError(f"n_samples {cfg.n_samples} (--n-samples) x {n_problems} problems of {bench}: {count} completions need at "
                         f"least {need / GIB:.3g} GiB, more than the {total / GIB:.3g} GiB of RAM here; lower it or --limit")


def run_eval(
    model_spec: str | tuple[Any, Any],
    benchmarks: Sequence[str],
    cfg: EvalConfig = EvalConfig(),
    data_dir: str | Path | None = None,
    out_dir: str | Path | None = None,
    model_name: str | None = None,
) -> dict[str, Any]:
    """Evaluate a model on ``benchmarks`` and, with ``out_dir``, write ``results.json`` and
    ``records.jsonl`` there. ``model_spec`` is a path / hub name / ``tiny``, or ``(model,
    tokenizer)`` already in memory. ``data_dir`` is a folder like ``<dir>/<benchmark>/test.jsonl``
    (None = the hub). Returns ``{"model", "config", "benchmarks": {name: metrics}}``."""
    if isinstance(model_spec, tuple):
        model, tokenizer = model_spec
        name = model_name or getattr(getattr(model, "config", None), "_name_or_path", None) or type(model).__name__
    else:
        model, tokenizer, name = load_model(model_spec)
    results: dict[str, Any] = {"model": model_name or name, "config": _jsonable(asdict(cfg)), "benchmarks": {}}
    all_items: list[dict] = []
    for bench in benchmarks:
        records = load_benchmark(bench, data_dir if BENCHMARKS.get(bench).generate is None else None, limit=cfg.limit)
        check_sample_memory(bench, len(records), cfg, held=len(all_items))
        metrics, items = evaluate_records(model, tokenizer, bench, records, cfg)
        results["benchmarks"][bench] = metrics
        all_items.extend(items)
    results["grading"] = stats()
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        with (out / "records.jsonl").open("w") as f:
            for it in all_items:
                f.write(json.dumps(it) + "\n")
        results["paths"] = {"results": str(out / "results.json"), "records": str(out / "records.jsonl")}
    return results


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x
