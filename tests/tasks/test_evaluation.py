"""The checkpoint evaluation task (:mod:`tasks.evaluation`): it decodes on the threads the run
plan gives an evaluation and from weights in the run's decoding dtype, and its cache tells
evaluations on other thread counts and dtypes apart."""

from __future__ import annotations

from pathlib import Path

import torch

import a3po.devices
import tasks.evaluation as evaluation
from a3po.config import preset, with_overrides
from a3po.devices import autocasts


def _cfg(generate_threads: int, dtype: str = "float32"):
    return with_overrides(preset("micro"), torch_threads=1, generate_threads=generate_threads, dtype=dtype)


def _stub_model_loading(monkeypatch, seen: list) -> None:
    """The checkpoint loads as a small module in the asked dtype; the held-out evaluation records
    what it was handed (threads, weights' dtype, whether marked for bf16 autocast)."""
    import a3po.data.datasets
    import a3po.models.factory
    import a3po.training.heldout

    monkeypatch.setattr(a3po.models.factory, "load_pretrained", lambda model_dir: (torch.nn.Linear(2, 2), None))
    monkeypatch.setattr(a3po.data.datasets, "load_rows", lambda data, tokenizer: ([], [], None))

    def heldout(model, tokenizer, rows, cfg):
        seen.append((torch.get_num_threads(), next(model.parameters()).dtype, autocasts(model)))
        return {"eval/heldout_acc": 0.0}

    monkeypatch.setattr(a3po.training.heldout, "evaluate_heldout", heldout)


def test_an_evaluation_decodes_on_every_core_where_generate_threads_is_0(monkeypatch, tmp_path):
    seen: list[tuple] = []
    _stub_model_loading(monkeypatch, seen)
    monkeypatch.setattr(evaluation, "usable_cores", lambda: 2)
    before = torch.get_num_threads()
    try:
        for generate_threads, expected in ((0, 2), (1, 1)):
            result = evaluation.evaluate(str(tmp_path), _cfg(generate_threads), [], None, None, 16, str(tmp_path / "eval"))
            assert seen[-1][0] == expected
            assert result["metrics"] == {"eval/final/heldout_acc": 0.0}
    finally:
        torch.set_num_threads(before)


def test_an_evaluation_decodes_from_the_runs_engine_weights_on_this_machine(monkeypatch, tmp_path):
    """dtype auto: a bf16 model where the CPU has native bf16 (the rollout engine's copy, as the
    run's step-0 and in-run held-out figures are taken), fp32 where it lacks it (simulated both
    ways); float32 stays fp32, also where the CPU has bf16; rollout.dtype float32 under auto keeps
    fp32; never marked for autocast."""
    seen: list[tuple] = []
    _stub_model_loading(monkeypatch, seen)
    before = torch.get_num_threads()
    try:
        for dtype, rollout, native, expected in (("auto", None, "amx_bf16", torch.bfloat16),
                                                 ("auto", None, None, torch.float32),
                                                 ("float32", None, "amx_bf16", torch.float32),
                                                 ("bfloat16", None, "amx_bf16", torch.bfloat16),
                                                 ("auto", "float32", "amx_bf16", torch.float32)):
            monkeypatch.setattr(a3po.devices, "native_bf16", lambda device, native=native: native)
            cfg = with_overrides(_cfg(1, dtype), rollout={"dtype": rollout})
            result = evaluation.evaluate(str(tmp_path), cfg, [], None, None, 16, str(tmp_path / "eval"))
            assert seen[-1][1:] == (expected, False), (dtype, rollout, native)
            assert result["dtype"] == str(expected).removeprefix("torch.")
    finally:
        torch.set_num_threads(before)


def test_the_evaluation_cache_keys_on_the_threads_it_decodes_on(monkeypatch, tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "weights.bin").write_bytes(b"w")
    inputs = {"model_dir": str(tmp_path / "model"), "benchmarks": [], "data_dir": None, "cfg": _cfg(0), "limit": None,
              "bench_max_new_tokens": 16, "out_dir": str(tmp_path / "eval")}
    keys = []
    for cores in (1, 2, 2):
        monkeypatch.setattr(evaluation, "usable_cores", lambda cores=cores: cores)
        keys.append(evaluation._eval_cache_key(None, inputs))
    assert keys[0] != keys[1] and keys[1] == keys[2]


def test_the_evaluation_cache_keys_on_the_weights_it_decodes_from(monkeypatch, tmp_path):
    """A checkpoint of a dtype-auto run evaluated on a CPU with native bf16 (bf16 weights) and on
    one without (fp32) gives two entries: greedy answers can differ by precision."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "weights.bin").write_bytes(b"w")
    inputs = {"model_dir": str(tmp_path / "model"), "benchmarks": [], "data_dir": None, "cfg": _cfg(1, "auto"), "limit": None,
              "bench_max_new_tokens": 16, "out_dir": str(tmp_path / "eval")}
    keys = []
    for native in ("amx_bf16", None, "avx512_bf16"):
        monkeypatch.setattr(a3po.devices, "native_bf16", lambda device, native=native: native)
        keys.append(evaluation._eval_cache_key(None, inputs))
    assert keys[0] != keys[1] and keys[0] == keys[2]


def test_the_evaluation_cache_keys_on_the_code_that_computes_the_figures(monkeypatch, tmp_path):
    """The same model and settings under other evaluation code (an edit that changes how the
    checkpoint is loaded, say) is another entry: a hit would report the old code's figures."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "weights.bin").write_bytes(b"w")
    inputs = {"model_dir": str(tmp_path / "model"), "benchmarks": [], "data_dir": None, "cfg": _cfg(0), "limit": None,
              "bench_max_new_tokens": 16, "out_dir": str(tmp_path / "eval")}
    keys = []
    for code in ("before", "after", "before"):
        monkeypatch.setattr(evaluation, "evaluation_code_hash", lambda code=code: code)
        keys.append(evaluation._eval_cache_key(None, inputs))
    assert keys[0] != keys[1] and keys[0] == keys[2]
    # The real hash covers the library, the benchmark runner and the task module.
    monkeypatch.undo()
    seen = []
    monkeypatch.setattr(evaluation, "source_hash", lambda roots: seen.extend(roots) or "0" * 64)
    evaluation.evaluation_code_hash.cache_clear()
    try:
        evaluation.evaluation_code_hash()
    finally:
        evaluation.evaluation_code_hash.cache_clear()
    root = Path(evaluation.__file__).resolve().parents[1]
    assert [Path(r).resolve() for r in seen] == [root / "a3po", root / "eval", root / "tasks" / "evaluation.py"]
