"""The checkpoint evaluation task (:mod:`tasks.evaluation`): it decodes on the threads the run
plan gives an evaluation, and its cache tells evaluations on other thread counts apart."""

from __future__ import annotations

import torch

import tasks.evaluation as evaluation
from a3po.config import preset, with_overrides


def _cfg(generate_threads: int):
    return with_overrides(preset("micro"), torch_threads=1, generate_threads=generate_threads)


def test_an_evaluation_decodes_on_every_core_where_generate_threads_is_0(monkeypatch, tmp_path):
    import a3po.data.datasets
    import a3po.models.factory
    import a3po.training.heldout

    seen: list[int] = []
    monkeypatch.setattr(evaluation, "usable_cores", lambda: 2)
    monkeypatch.setattr(a3po.models.factory, "load_pretrained", lambda model_dir: (None, None))
    monkeypatch.setattr(a3po.data.datasets, "load_rows", lambda data, tokenizer: ([], [], None))
    monkeypatch.setattr(a3po.training.heldout, "evaluate_heldout",
                        lambda model, tokenizer, rows, cfg: seen.append(torch.get_num_threads()) or {"eval/heldout_acc": 0.0})
    before = torch.get_num_threads()
    try:
        for generate_threads, expected in ((0, 2), (1, 1)):
            result = evaluation.evaluate(str(tmp_path), _cfg(generate_threads), [], None, None, 16, str(tmp_path / "eval"))
            assert seen[-1] == expected
            assert result["metrics"] == {"eval/final/heldout_acc": 0.0}
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
