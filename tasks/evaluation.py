"""``evaluate_checkpoint``: a trained policy on the in-domain held-out set and, when their files
are there, GSM8K / MATH500 / AIME24.

The held-out figures are :func:`a3po.training.heldout.evaluate_heldout` (the trainer's own measure:
sampled mean@n at the training temperature, plus greedy pass@1, on the prepared held-out
file); the benchmarks go through ``eval.runner.run_eval`` (the same rollout engine and grader).
Benchmark files are looked up in ``data_dir`` (``<data_dir>/<name>/test.jsonl``); the pipeline
never needs them: a missing folder or file skips that benchmark and the reason is recorded
(returned, and tagged on the MLflow run).

Cached by a hash of the model files plus the evaluation settings and the code that computes the
figures (:func:`evaluation_code_hash`): re-running a flow whose variants are already trained does
not re-evaluate them, and a checkout whose evaluation code differs never takes another's figures.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import time
from pathlib import Path
from typing import Any

from prefect import task

from a3po.config import TrainConfig
from a3po.config.plan import decoding_dtype, evaluation_threads
from a3po.devices import DType, machine_precision
from a3po.placement.cores import usable_cores
from a3po.storage.content import content_hash, sha256_file, source_hash
from tasks.runtime import run_logger

BENCHMARKS = ("gsm8k", "math500", "aime24")


def model_hash(model_dir: str | Path) -> str:
    return content_hash(model_dir)[:16]


@functools.lru_cache(maxsize=1)
def evaluation_code_hash() -> str:
    """A hash of the code an evaluation runs through: the library (loading, the engine, sampling,
    grading), the benchmark runner and this module. Any edit there is another cache entry, figures
    and all: an edit that moves a greedy answer by one problem must not be answered from a cache
    of the code before it. Computed once per process (a checkout does not change under a run)."""
    import a3po

    runner = importlib.util.find_spec("eval")
    assert runner is not None and runner.submodule_search_locations, "the benchmark runner package 'eval'"
    return source_hash([Path(a3po.__file__).parent, Path(next(iter(runner.submodule_search_locations))),
                        Path(__file__)])[:16]


def available_benchmarks(benchmarks: list[str], data_dir: str | None) -> tuple[list[str], dict[str, str]]:
    """``(benchmarks with a local file, {skipped name: reason})``."""
    from eval.data import resolve_local

    if not benchmarks:
        return [], {}
    if not data_dir or not Path(data_dir).is_dir():
        return [], {b: f"benchmark data folder {data_dir!r} not found" for b in benchmarks}
    ok, skipped = [], {}
    for b in benchmarks:
        try:
            resolve_local(b, data_dir)
            ok.append(b)
        except (FileNotFoundError, KeyError) as e:
            skipped[b] = str(e)
    return ok, skipped


def _eval_cache_key(context, inputs) -> str | None:
    model_dir = Path(inputs["model_dir"])
    if not model_dir.is_dir():
        return None
    ok, skipped = available_benchmarks(list(inputs["benchmarks"]), inputs["data_dir"])
    files = {b: sha256_file(_bench_file(b, inputs["data_dir"])) for b in ok}
    cfg: TrainConfig = inputs["cfg"]
    blob = json.dumps(
        {
            "model": model_hash(model_dir),
            "code": evaluation_code_hash(),
            "heldout": sha256_file(cfg.data.heldout_path) if cfg.data.heldout_path else None,
            "task": cfg.data.task,
            "measure": [cfg.rl.max_new_tokens, cfg.rl.temperature, cfg.rl.eval_samples, evaluation_threads(cfg, usable_cores()),
                        evaluation_dtype(cfg).value],
            "files": files,
            "skipped": sorted(skipped),
            "limit": inputs["limit"],
            "bench_max_new_tokens": inputs["bench_max_new_tokens"],
            "out": str(Path(inputs["out_dir"]).resolve()),
        },
        sort_keys=True,
    )
    return "eval-" + hashlib.sha256(blob.encode()).hexdigest()[:24]


def _bench_file(name: str, data_dir: str) -> Path:
    from eval.data import resolve_local

    return Path(resolve_local(name, data_dir))


def evaluation_dtype(cfg: TrainConfig) -> DType:
    """The weights an evaluation of a ``cfg`` run decodes from on this machine (evaluations run on
    the CPU): the run's decoding dtype (:func:`a3po.config.plan.decoding_dtype`: bf16 under ``dtype:
    auto`` where the CPU has native bf16, fp32 elsewhere), so the final figures are taken as the
    step-0 and in-run held-out ones and the rollouts were."""
    import torch

    return decoding_dtype(cfg, machine_precision(cfg.dtype, torch.device("cpu")))


def evaluate(
    model_dir: str, cfg: TrainConfig, benchmarks: list[str], data_dir: str | None, limit: int | None, bench_max_new_tokens: int, out_dir: str
) -> dict[str, Any]:
    """Plain function behind the task (also used by the overhead bench)."""
    import torch

    from a3po.data.datasets import load_rows
    from a3po.models.factory import load_pretrained
    from a3po.training.heldout import evaluate_heldout

    t0 = time.perf_counter()
    torch.set_num_threads(evaluation_threads(cfg, usable_cores()))
    dtype = evaluation_dtype(cfg)
    model, tokenizer = load_pretrained(model_dir)  # as saved (fp32 master weights under dtype auto)
    # Cast in place as the rollout engine's copy and the in-run evaluations are (buffers too: RoPE's
    # frequencies round as theirs do), not as from_pretrained(dtype=...) loads, so the step-0, in-run
    # and final figures come from the same weights; nothing else reads this model, so no copy.
    model = model.to(dtype=dtype.torch)
    _, heldout, _ = load_rows(cfg.data, tokenizer)
    held = evaluate_heldout(model, tokenizer, heldout, cfg)  # the trainer's measure: eval/heldout_acc, eval/heldout_greedy_acc
    metrics = {k.replace("eval/", "eval/final/", 1): v for k, v in held.items()}
    ok, skipped = available_benchmarks(benchmarks, data_dir)
    results_path = None
    if ok:
        from eval.runner import EvalConfig, run_eval

        res = run_eval(
            (model, tokenizer),
            ok,
            EvalConfig(max_new_tokens=bench_max_new_tokens, limit=limit),
            data_dir=data_dir,
            out_dir=out_dir,
            model_name=model_dir,
        )
        for bench, m in res["benchmarks"].items():
            for k, v in m.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    metrics[f"eval/final/{bench}/{k.replace('@', '_at_')}"] = float(v)
        results_path = res.get("paths", {}).get("results")
    return {"metrics": metrics, "skipped": skipped, "benchmarks": ok, "results_path": results_path, "model_dir": model_dir,
            "benchmark_files": {b: str(_bench_file(b, data_dir)) for b in ok} if data_dir else {},
            "dtype": dtype.value, "seconds": time.perf_counter() - t0}


@task(cache_key_fn=_eval_cache_key, persist_result=True, retries=1)  # idempotent: safe to retry
def evaluate_checkpoint(
    model_dir: str,
    cfg: TrainConfig,
    benchmarks: list[str],
    data_dir: str | None,
    limit: int | None,
    bench_max_new_tokens: int,
    out_dir: str,
) -> dict[str, Any]:
    """``{"metrics": {"eval/final/...": x}, "skipped": {name: reason}, ...}`` for one checkpoint."""
    result = evaluate(model_dir, cfg, benchmarks, data_dir, limit, bench_max_new_tokens, out_dir)
    for name, reason in result["skipped"].items():
        run_logger().warning(f"benchmark {name} skipped: {reason}")
    return result
