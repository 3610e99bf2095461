"""The compatibility matrix of the distributed topology (infra/compat_matrix.py, docs/distributed.md).

Fast: the doc's table is the one the config checks give (a check changed without the doc fails
here), every refusal names a config field and has a review, and a few cells, read off the checks
in a3po/config/ (train.py and the sections' modules) by hand, come out as the checks say. Slow:
every cell that runs trains 2 steps of the micro preset, with the figures of the options it turns on: in this process, or
launched through torchrun as trainer ranks and rollout workers (the vLLM cells under -m vllm).
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from a3po.config import TrainConfig, preset, with_overrides
from a3po.config.preflight import module_available
from a3po.models.logprobs import prefix_repeats
from infra.compat_matrix import REPO_ROOT, REVIEWS, Cell, cells, doc_block, main, matrix, render
from tests.support.tiny_models import save_micro_h32

DOC = REPO_ROOT / "docs" / "distributed.md"
DOTTED = re.compile(r"\b[a-z_]+(?:\.[a-z_]+)+\b")


def _config_field(dotted: str) -> bool:
    """Whether ``dotted`` (``rollout.engine``) is a field of TrainConfig's sections."""
    obj = TrainConfig()
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(obj) or part not in {f.name for f in dataclasses.fields(obj)}:
            return False
        obj = getattr(obj, part)
    return True


def test_the_docs_table_is_the_one_the_config_checks_give(tmp_path):
    text = DOC.read_text(encoding="utf-8")
    assert doc_block(text) == render()
    assert main(["--check", str(DOC)]) == 0
    # The check can fail: one cell of the doc's copy flipped from refused to runs.
    stale = tmp_path / "distributed.md"
    stale.write_text(text.replace("| ZeRO-1 | 2 ranks | runs | runs |", "| ZeRO-1 | 2 ranks | runs | a |", 1), encoding="utf-8")
    assert stale.read_text(encoding="utf-8") != text
    assert main(["--check", str(stale)]) == 1


def test_every_refusal_names_a_config_field_and_is_reviewed():
    reasons = {r for r in matrix().values() if r is not None}
    assert reasons
    for reason in reasons:
        named = [d for d in DOTTED.findall(reason) if _config_field(d)]
        assert named, f"names no config field: {reason!r}"
        assert reason in REVIEWS, f"refusal without a review in infra/compat_matrix.REVIEWS: {reason!r}"
    assert _config_field("oppo.intra") and _config_field("distributed.deepspeed_config") and not _config_field("oppo.nothing")


def test_the_cells_build_the_configs_their_names_say():
    # 2 engines x 2 placements x 4 trainers x 4 OPPO modes x 2 critics.
    assert len(cells()) == 128 and len(set(cells())) == 128
    cfg = Cell("torch", "disaggregated", "ZeRO-3", "off", "none").config()
    assert (cfg.distributed.rollout_workers, cfg.distributed.deepspeed_config) == (1, "infra/deepspeed_zero3.json")
    cfg = Cell("torch", "colocated", "one process", "both", "gae").config()
    assert (cfg.oppo.intra, cfg.oppo.inter, cfg.rl.advantage, cfg.ppo.critic, cfg.ppo.kl_coef) == (True, True, "gae", "policy_copy", 0.0)
    assert Cell("torch", "colocated", "one process", "intra", "none").config().ppo.kl_coef == 0.01
    assert Cell("vllm", "colocated", "one process", "off", "none").config().rollout.engine == "vllm"


def test_cells_read_off_the_checks_by_hand():
    results = matrix()
    # No check concerns the torch engine in one process: all 8 OPPO x critic cells run.
    assert all(results[Cell("torch", "colocated", "one process", o, c)] is None
               for o in ("off", "intra", "inter", "both") for c in ("none", "gae"))
    # The critic trains beside the policy under DeepSpeed ranks (its own engine), with or without workers, at every stage.
    assert all(results[Cell("torch", p, t, "off", "gae")] is None for p in ("colocated", "disaggregated") for t in ("ZeRO-1", "ZeRO-2", "ZeRO-3"))
    # The production topology runs at every ZeRO stage, OPPO's overlaps included (they run in the worker).
    assert all(results[Cell("torch", "disaggregated", t, o, "none")] is None for t in ("ZeRO-1", "ZeRO-2", "ZeRO-3")
               for o in ("off", "intra", "inter", "both"))
    # One trainer process and a worker: every OPPO x critic cell runs.
    assert all(results[Cell("torch", "disaggregated", "one process", o, c)] is None
               for o in ("off", "intra", "inter", "both") for c in ("none", "gae"))
    # OPPO's overlaps run on vLLM too (its request-level loop: a3po.rollout.vllm_engine), in process and in the workers.
    assert all(results[Cell("vllm", p, "one process", o, c)] is None for p in ("colocated", "disaggregated")
               for o in ("intra", "inter", "both") for c in ("none", "gae"))
    # Intra without a critic or a KL reference has nothing to score with: the cells' kl_coef is what makes them run.
    with pytest.raises(ValueError, match="oppo.intra needs scoring models"):
        with_overrides(preset("micro"), oppo={"intra": True})
    # vLLM: in one trainer process, or in the workers beside one trainer or ZeRO trainer ranks (the
    # production topology); never in each of several trainer ranks.
    assert results[Cell("vllm", "colocated", "one process", "off", "gae")] is None
    assert "every trainer rank would start its own engine" in results[Cell("vllm", "colocated", "ZeRO-1", "off", "none")]
    assert all(results[Cell("vllm", "disaggregated", t, "off", "none")] is None for t in ("one process", "ZeRO-1", "ZeRO-2", "ZeRO-3"))
    assert results[Cell("vllm", "disaggregated", "one process", "off", "gae")] is None
    assert all(results[Cell("vllm", "disaggregated", t, "both", "gae")] is None for t in ("ZeRO-1", "ZeRO-2", "ZeRO-3"))
    assert all("every trainer rank would start its own engine" in results[Cell("vllm", "colocated", t, o, "gae")]
               for t in ("ZeRO-2", "ZeRO-3") for o in ("inter", "both"))


# --- slow: the one-process cells train -----------------------------------------------------------

ONE_PROCESS = [c for c, r in matrix().items() if r is None and c.single_process]


def _param(cell: Cell):
    marks = [pytest.mark.vllm] if cell.engine == "vllm" else []
    return pytest.param(cell, marks=marks, id=f"{cell.engine}-{cell.oppo}-{cell.critic}")


def _micro_h32(tmp_path) -> str:
    return str(save_micro_h32(tmp_path / "micro-h32"))


@pytest.fixture(scope="module")
def micro_warmstart(tmp_path_factory):
    import torch

    from a3po.training.run import prepare_warmstart

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield prepare_warmstart(preset("micro"), tmp_path_factory.mktemp("cache"), log=lambda s: None)
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("cell", [_param(c) for c in ONE_PROCESS])
def test_every_one_process_cell_that_runs_trains_two_steps(cell, micro_warmstart, tmp_path):
    from a3po.training.metrics import JsonlLogger, read_metrics_jsonl
    from a3po.training.run import train_variant

    if cell.engine == "vllm" and not module_available("vllm"):
        pytest.skip("vLLM is not installed (the gpu extra, or infra/install_vllm_cpu.sh; make test-vllm)")
    cfg = with_overrides(cell.config(), rl={"steps": 2})
    ws_dir, ws_acc = micro_warmstart
    if cell.engine == "vllm" and not torch.cuda.is_available():
        from a3po.training.run import prepare_warmstart

        cfg = with_overrides(cfg, model={"name": _micro_h32(tmp_path)})
        ws_dir, ws_acc = prepare_warmstart(cfg, tmp_path / "cache", log=lambda s: None)
    result = train_variant(cfg, tmp_path / "run", ws_dir, ws_acc, logger=JsonlLogger(tmp_path / "m.jsonl"))
    rows = read_metrics_jsonl(tmp_path / "m.jsonl")
    assert result.steps == 2 and [r["step"] for r in rows if "loss/policy" in r] == [1, 2]
    trained = [r for r in rows if "loss/policy" in r]
    assert all(math.isfinite(r["loss/policy"]) for r in trained)
    # The options the cell turns on left their figures (each logged only when its part ran).
    expected = {"oppo/chunks": cell.oppo in ("intra", "both"), "oppo/delta": cell.oppo in ("inter", "both"),
                "ppo/value_loss": cell.critic == "gae", "ppo/kl": cell.critic == "none" and cell.oppo in ("intra", "both")}
    for key, on in expected.items():
        assert all((key in r) == on for r in trained), (key, on, sorted(trained[0]))


def test_prefix_repeats_says_whether_two_rows_share_their_first_columns():
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 9, 9], [4, 6, 7, 8]])
    mask = torch.ones_like(ids)
    assert prefix_repeats(ids, mask, 2)  # rows 0 and 1 share [5, 6]
    assert not prefix_repeats(ids[[0, 2]], mask[[0, 2]], 2)  # [5, 6] and [4, 6]
    # The same ids behind another mask (left padding) are another prefix.
    assert not prefix_repeats(ids[[0, 1]], torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]]), 2)


MULTI_PROCESS = [c for c, r in matrix().items() if r is None and not c.single_process]


@pytest.mark.slow
@pytest.mark.parametrize("cell", [pytest.param(c, marks=[pytest.mark.vllm] if c.engine == "vllm" else [],
                                               id=f"{c.engine}-{c.placement}-{c.trainer}-{c.oppo}-{c.critic}".replace(" ", ""))
                                  for c in MULTI_PROCESS])
def test_every_multi_process_cell_that_runs_trains_two_steps(cell, tmp_path):
    """Each accepted cell with trainer ranks or a rollout worker, launched as it would be (torchrun,
    gloo, DeepSpeed on CPU): 2 micro steps, the launch's roles as the cell says, and the figures of
    the options it turns on. Among them the cell that once hung at step 2 (2 ZeRO-3 ranks, OPPO
    intra + inter in process): each ZeRO-3 forward is a collective, and the shared-prompt forward
    ran two forwards on the rank whose shard repeats a prompt and one on the other
    (a3po.training.step.update_minibatch now shares only where every rank's shard repeats one)."""
    import json
    import os
    import subprocess
    import sys

    import yaml

    from a3po.config.preflight import deepspeed_available

    if cell.deepspeed_config is not None and not deepspeed_available():
        pytest.skip("DeepSpeed is not installed (pip install -e '.[distributed]')")
    if cell.engine == "vllm" and not module_available("vllm"):
        pytest.skip("vLLM is not installed (the gpu extra, or infra/install_vllm_cpu.sh; make test-vllm)")
    sections = cell.overrides()
    sections["rl"]["steps"] = 2
    if cell.engine == "vllm" and not torch.cuda.is_available():
        sections["model"] = {"name": _micro_h32(tmp_path)}
    config = tmp_path / "cell.yaml"
    config.write_text(yaml.safe_dump(sections))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "DO_NOT_TRACK": "true", "DS_ACCELERATOR": "cpu"}
    nproc = cell.trainer_ranks + cell.rollout_workers
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), "-m", "a3po.training.command",
           "--preset", "micro", "--config", str(config), "--output-dir", str(tmp_path / "out"), "--no-progress", "--variant", "loglinear"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    zero = None if cell.deepspeed_config is None else int(cell.trainer[-1])
    # world_size is the trainer ranks' world; the workers are counted apart.
    assert (run["world_size"], run["zero_stage"], run["rollout_workers"]) == (cell.trainer_ranks, zero, cell.rollout_workers), run
    rows = [json.loads(line) for line in (tmp_path / "out" / "loglinear-seed0" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "loss/policy" in r]
    assert [r["step"] for r in trained] == [1, 2] and all(math.isfinite(r["loss/policy"]) for r in trained)
    expected = {"oppo/chunks": cell.oppo in ("intra", "both"), "oppo/delta": cell.oppo in ("inter", "both"),
                "ppo/value_loss": cell.critic == "gae"}
    for key, on in expected.items():
        assert all((key in r) == on for r in trained), (key, on, sorted(trained[0]))
