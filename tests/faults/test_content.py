"""Cached and resumed artefacts are keyed by content, not by path, size or mtime.

- the warm start (``a3po.training.run.prepare_warmstart``): a model folder replaced under the
  same path, or a dataset rewritten at the same size and mtime, gets a warm start of its own;
  a cached warm start whose file was damaged in place is named and trained again;
- a resume (``a3po.training.run_state.resume``): a checkpoint records the sha256 of the files its
  config names and is not resumed on other contents (named, with both hashes); one written before
  the record existed is resumed with a warning naming the files it cannot check;
- the named-model cache (``a3po.models.sources``): a file damaged in place at its size is named
  and converted again, on a stand-in source (a micro model instead of the GGUF conversion);
- the dataset cache of the flows (``tasks.data.dataset_key``): keyed by the tokenizer's folder
  content, not its name;
- the evaluation cache keys on the code that computes the figures too
  (``a3po.storage.content.source_hash``): the same code anywhere, any edit another entry.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from a3po.config import preset, with_overrides
from a3po.data.arithmetic import WORDS, generate_split
from a3po.models import sources
from a3po.models.factory import build_tiny_model
from a3po.models.identity import model_content_hash
from a3po.storage.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from a3po.training.inputs import input_hashes
from a3po.training.metrics import JsonlLogger
from a3po.training.run import prepare_warmstart, train_variant, warmstart_folder
from a3po.training.run_state import resume

pytestmark = pytest.mark.usefixtures("core_one_thread")


def _save_model(folder: Path, seed: int) -> dict[str, torch.Tensor]:
    model, tokenizer = build_tiny_model("micro", WORDS, seed=seed)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _write_rows(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _rewrite_same_size_and_mtime(path: Path, rows: list[dict]) -> None:
    """The rows in reverse order: other content, the same bytes count, the old mtime put back."""
    st = path.stat()
    _write_rows(path, rows[::-1])
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    # Copies: the loaded tensors may map the file, which a test then damages.
    return {k: v.clone() for k, v in load_file(folder / "model.safetensors").items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    # Tied embeddings: the saved file holds one copy, the state dict both names.
    return all(torch.equal(v, b[k]) for k, v in a.items() if k in b)


def _flip_bytes_in_place(path: Path) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size - 64)
        tail = f.read(32)
        f.seek(size - 64)
        f.write(bytes(255 - b for b in tail))
    assert path.stat().st_size == size


@pytest.fixture
def inputs(tmp_path):
    """A micro model folder and train / held-out files, and a config reading them (no supervised
    warm-start steps: the warm start's weights are then the model's own)."""
    model, data = tmp_path / "model", tmp_path / "data"
    data.mkdir()
    train, held = generate_split(40, "train", 0), generate_split(8, "heldout", 0)
    _write_rows(data / "train.jsonl", train)
    _write_rows(data / "held.jsonl", held)
    weights = _save_model(model, seed=0)
    cfg = with_overrides(preset("micro"), model={"name": str(model)}, torch_threads=1, warm_start={"steps": 0},
                         data={"train_path": str(data / "train.jsonl"), "heldout_path": str(data / "held.jsonl")},
                         rl={"steps": 2, "checkpoint_every": 1, "eval_every": 2})
    return cfg, model, weights, data / "train.jsonl", train


# --- the warm start -----------------------------------------------------------------------


def test_a_model_folder_replaced_under_the_same_path_gets_its_own_warm_start(inputs, tmp_path):
    cfg, model, first, _, _ = inputs
    ws1, _ = prepare_warmstart(cfg, tmp_path / "cache", log=lambda m: None)
    assert _same(_weights(ws1), first)
    second = _save_model(model, seed=1)  # the same path, file names and sizes; other weights
    ws2, _ = prepare_warmstart(cfg, tmp_path / "cache", log=lambda m: None)
    assert ws2 != ws1 and _same(_weights(ws2), second) and not _same(_weights(ws2), first)


def test_a_dataset_rewritten_at_its_size_and_mtime_is_another_warm_start(inputs, tmp_path):
    cfg, _, _, train_file, rows = inputs
    before = warmstart_folder(cfg, tmp_path)
    _rewrite_same_size_and_mtime(train_file, rows)
    assert warmstart_folder(cfg, tmp_path) != before
    # A built-in model on the embedded task names no file: its key is the one it always had.
    assert input_hashes(preset("micro")) == {}


def test_a_damaged_warm_start_file_is_named_and_trained_again(inputs, tmp_path):
    cfg, _, first, _, _ = inputs
    ws, _ = prepare_warmstart(cfg, tmp_path / "cache", log=lambda m: None)
    _flip_bytes_in_place(ws / "model.safetensors")
    said: list[str] = []
    again, _ = prepare_warmstart(cfg, tmp_path / "cache", log=said.append)
    assert again == ws and _same(_weights(again), first)
    assert len(said) == 2 and f"{ws / 'model.safetensors'}: content hash mismatch" in said[0]


# --- resume -------------------------------------------------------------------------------


def test_a_resume_on_a_dataset_edited_in_place_is_refused_naming_it_and_both_hashes(inputs, tmp_path):
    cfg, _, _, train_file, rows = inputs
    ws = prepare_warmstart(cfg, tmp_path / "cache", log=lambda m: None)
    run = tmp_path / "run"
    train_variant(cfg, run, *ws, logger=JsonlLogger(run / "metrics.jsonl"))
    old = input_hashes(cfg)["data.train_path"]
    _rewrite_same_size_and_mtime(train_file, rows)
    new = input_hashes(cfg)["data.train_path"]
    with pytest.raises(CheckpointError, match=rf"step_000002 was saved on other file contents \(data\.train_path "
                                              rf"{train_file}: sha256 {old[:16]} then, {new[:16]} now\)"):
        train_variant(cfg, run, *ws, logger=JsonlLogger(run / "metrics.jsonl"))
    _write_rows(train_file, rows)  # the rows as they were: resumed
    assert train_variant(cfg, run, *ws, logger=JsonlLogger(run / "metrics.jsonl")).resumed_from == 2


def test_a_checkpoint_without_input_hashes_resumes_with_a_warning_naming_the_files(inputs, tmp_path, caplog):
    cfg, _, _, _, _ = inputs
    ws = prepare_warmstart(cfg, tmp_path / "cache", log=lambda m: None)
    run = tmp_path / "run"
    train_variant(cfg, run, *ws, logger=JsonlLogger(run / "metrics.jsonl"))
    state = load_checkpoint(latest_checkpoint(run / "checkpoints"))
    assert state.pop("inputs") == input_hashes(cfg)  # what a checkpoint records
    save_checkpoint(tmp_path / "old", state["step"], state)  # as an earlier version wrote it
    with caplog.at_level(logging.WARNING):
        resumed = resume(str(tmp_path / "old"), cfg, input_hashes(cfg))
    assert resumed.step == 2 and resumed.inputs == input_hashes(cfg)  # recorded from then on
    assert "records no content hashes" in caplog.text
    assert "data.heldout_path, data.train_path, model.name not checked" in caplog.text


# --- the named-model cache ----------------------------------------------------------------


@pytest.fixture
def stand_in_source(tmp_path, monkeypatch):
    """The smol source with a small file in place of its GGUF and a micro model in place of the
    conversion; the conversions made are counted."""
    gguf = tmp_path / "pkg" / "model.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" + bytes(60))
    conversions: list[Path] = []

    def convert(src, out):
        conversions.append(out)
        _save_model(out, seed=0)

    source = sources.MODEL_SOURCES.get("smollm2-135m-instruct")
    monkeypatch.setattr(type(source), "gguf_path", lambda self: gguf)
    monkeypatch.setattr(sources, "convert_gguf", convert)
    return source, tmp_path / "models", conversions, gguf


def test_a_model_cache_file_damaged_in_place_at_its_size_is_named_and_converted_again(stand_in_source, caplog):
    source, root, conversions, _ = stand_in_source
    folder = source.folder(root)
    good = _weights(folder)
    assert source.folder(root) == folder and len(conversions) == 1  # intact: reused
    _flip_bytes_in_place(folder / "model.safetensors")
    with caplog.at_level(logging.WARNING):
        assert source.folder(root) == folder
    assert len(conversions) == 2 and _same(_weights(folder), good)
    assert f"{folder / 'model.safetensors'}: content hash mismatch" in caplog.text


def test_a_model_cache_manifest_with_sizes_only_is_converted_again(stand_in_source):
    source, root, conversions, _ = stand_in_source
    folder = source.folder(root)
    manifest = json.loads((folder / sources.MANIFEST).read_text())
    manifest["files"] = {name: entry["bytes"] for name, entry in manifest["files"].items()}  # an earlier version's
    (folder / sources.MANIFEST).write_text(json.dumps(manifest))
    assert source.folder(root) == folder and len(conversions) == 2


def test_a_named_source_is_identified_by_its_files_content(stand_in_source):
    source, _, _, gguf = stand_in_source
    before = model_content_hash("smollm2-135m-instruct")
    gguf.write_bytes(b"GGUF" + bytes(59) + b"\x01")  # another version of the package's file
    assert model_content_hash("smollm2-135m-instruct") != before
    assert model_content_hash("micro") is None


# --- the dataset cache of the flows ---------------------------------------------------------


def test_the_dataset_cache_is_keyed_by_the_tokenizer_folder_content(inputs):
    from tasks.data import dataset_key

    cfg, model, _, _, _ = inputs
    before = dataset_key(cfg)
    (model / "tokenizer.json").write_text((model / "tokenizer.json").read_text().replace('"<unk>"', '"<UNK>"'))
    assert dataset_key(cfg) != before


# --- the flows' warm start and run folders ------------------------------------------------


def test_the_flows_take_a_replaced_model_or_a_damaged_warm_start_for_another(inputs, tmp_path):
    from tasks.training import run_dir_for, warmstart_ready

    cfg, model, _, _, _ = inputs
    cache = tmp_path / "cache"
    ws, _ = prepare_warmstart(cfg, cache, log=lambda m: None)
    run_dir = run_dir_for(tmp_path / "out", cfg)
    assert warmstart_ready(cfg, cache)
    _flip_bytes_in_place(ws / "model.safetensors")
    assert not warmstart_ready(cfg, cache)  # Prefect's cached record is refreshed: trained again
    prepare_warmstart(cfg, cache, log=lambda m: None)
    assert warmstart_ready(cfg, cache)
    _save_model(model, seed=1)
    # Another warm start, and a run folder of its own rather than the old run's checkpoints.
    assert not warmstart_ready(cfg, cache) and run_dir_for(tmp_path / "out", cfg) != run_dir


def test_a_dataset_cache_file_edited_in_place_is_named_and_written_again(inputs, tmp_path, caplog):
    from tasks.data import dataset_ready, materialise

    cfg, _, _, _, _ = inputs
    data = materialise(cfg, tmp_path / "cache")
    written = Path(data.train_path).read_text()
    first, rest = written.split("\n", 1)
    row = json.loads(first)
    row["gold"] = "".join("1" if c == "0" else "0" for c in row["gold"])  # another gold of the same length
    edited = json.dumps(row) + "\n" + rest
    Path(data.train_path).write_text(edited)  # still valid rows, the same size
    assert edited != written and len(edited) == len(written)
    assert not dataset_ready(cfg, tmp_path / "cache")
    with caplog.at_level(logging.WARNING):
        again = materialise(cfg, tmp_path / "cache")
    assert again.train_path == data.train_path and Path(data.train_path).read_text() == written
    assert f"{data.train_path}: content hash mismatch" in caplog.text and dataset_ready(cfg, tmp_path / "cache")


def test_a_damaged_reward_model_file_is_named_and_trained_again(inputs, tmp_path):
    from a3po.training.reward_model import RewardModelSettings, prepare_reward_model

    cfg, _, _, _, _ = inputs
    ws, _ = prepare_warmstart(cfg, tmp_path / "cache", log=lambda m: None)
    settings = RewardModelSettings(n_prompts=10, samples_per_prompt=2, steps=2, batch_size=8)
    rm, figures = prepare_reward_model(cfg, ws, tmp_path / "cache", settings, log=lambda m: None)
    good = _weights(rm)

    def same_figures(other: dict) -> bool:  # as JSON: NaN AUCs compare equal
        return json.dumps(other, sort_keys=True) == json.dumps(figures, sort_keys=True)

    reused, reused_figures = prepare_reward_model(cfg, ws, tmp_path / "cache", settings, log=lambda m: None)
    assert reused == rm and same_figures(reused_figures)
    _flip_bytes_in_place(rm / "model.safetensors")
    said: list[str] = []
    again, again_figures = prepare_reward_model(cfg, ws, tmp_path / "cache", settings, log=said.append)
    assert again == rm and _same(_weights(rm), good) and same_figures(again_figures)  # seeded: the same model
    assert f"{rm / 'model.safetensors'}: content hash mismatch" in said[0]


def test_a_source_hash_follows_the_code_not_where_it_lies(tmp_path):
    from a3po.storage.content import source_hash

    def package(at: Path, body: str) -> Path:
        (at / "pkg" / "sub").mkdir(parents=True)
        (at / "pkg" / "__init__.py").write_text("")
        (at / "pkg" / "sub" / "m.py").write_text(body)
        (at / "pkg" / "notes.txt").write_text("not code")
        return at / "pkg"

    a, b = package(tmp_path / "a", "X = 1\n"), package(tmp_path / "b", "X = 1\n")
    single = tmp_path / "single.py"
    single.write_text("Y = 2\n")
    first = source_hash([a, single])
    assert source_hash([b, single]) == first  # the same code elsewhere
    (a / "notes.txt").write_text("edited")
    assert source_hash([a, single]) == first  # not Python source
    (a / "sub" / "m.py").write_text("X = 2\n")
    assert source_hash([a, single]) != first  # an edit in a subpackage
    (b / "sub" / "n.py").write_text("")
    assert source_hash([b, single]) != first  # a new module
    single.write_text("Y = 3\n")
    assert source_hash([package(tmp_path / "c", "X = 1\n"), single]) != first  # the single file
