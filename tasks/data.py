"""``prepare_dataset``: the train / held-out rows every variant of a comparison trains and is
evaluated on, validated once and materialised as JSONL.

Why materialise: the embedded task is generated in code and a JSONL source may hold bad rows;
writing the validated rows once gives the pipeline one artifact, named by a hash of its inputs
(data config, tokenizer, source file contents), that warm start, training and evaluation all
read by path. The rows are exactly what :func:`a3po.data.datasets.load_rows` yields, in the same order,
so training on the materialised files equals training on the source.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from prefect import task

from a3po.config import TrainConfig, data_identity, with_overrides
from a3po.data.datasets import load_rows
from a3po.models.identity import model_content_hash
from a3po.storage.atomic import replace_dir
from a3po.storage.content import folder_hashes, record_problem, sha256_file
from tasks.runtime import run_logger


@dataclass(frozen=True)
class PreparedData:
    key: str  # hash of the inputs; names the folder
    train_path: str
    heldout_path: str
    n_train: int
    n_heldout: int
    skipped: int  # rows dropped under data.on_bad_row='skip'
    source: str


def dataset_key(cfg: TrainConfig) -> str:
    """Hash of what determines the rows: the data config, the tokenizer (prompt-length checks;
    a local model folder or named source by its content) and the contents of any source files."""
    parts = {"data": data_identity(cfg.data), "tokenizer": cfg.model.name}
    tokenizer = model_content_hash(cfg.model.name)
    if tokenizer is not None:  # none for a built-in model: those keys stay as they were
        parts["tokenizer_sha256"] = tokenizer
    for name in ("train_path", "heldout_path"):
        path = getattr(cfg.data, name)
        if path:
            parts[f"{name}_sha256"] = sha256_file(path)
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def tokenizer_for(cfg: TrainConfig):
    """The policy's tokenizer without building the model (built-in archs use the in-code one)."""
    from a3po.data.arithmetic import WORDS
    from a3po.models.factory import load_tokenizer

    return load_tokenizer(cfg.model.name, words=WORDS)


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def materialise(cfg: TrainConfig, cache_root: str | Path) -> PreparedData:
    """Write ``<cache_root>/data-<key>/{train,heldout}.jsonl`` and ``report.json`` (once; the
    folder appears atomically by rename)."""
    key = dataset_key(cfg)
    out = Path(cache_root) / f"data-{key}"
    report = out / "report.json"
    problem = record_problem(out, "report.json")  # the rows as written, or written again
    if problem is not None:
        if out.exists():
            run_logger().warning(f"dataset {out.name}: {problem}; writing it again")
        train, held, reports = load_rows(cfg.data, tokenizer_for(cfg))
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
        _write_jsonl(tmp / "train.jsonl", train)
        _write_jsonl(tmp / "heldout.jsonl", held)
        info = {
            "key": key,
            "n_train": len(train),
            "n_heldout": len(held),
            "skipped": sum(len(r.skipped) for r in reports),
            "skipped_rows": [s for r in reports for s in r.skipped][:100],
            "source": " + ".join(r.source for r in reports),
        }
        info["files"] = folder_hashes(tmp)  # checked when the folder is reused
        (tmp / "report.json").write_text(json.dumps(info, indent=1))
        if out.exists() and record_problem(out, "report.json") is not None:
            replace_dir(tmp, out)  # a damaged folder: the new one takes its place
        else:
            try:
                os.replace(tmp, out)
            except OSError:  # prepared concurrently: keep theirs
                shutil.rmtree(tmp, ignore_errors=True)
    info = json.loads(report.read_text())
    return PreparedData(
        key=key,
        train_path=str((out / "train.jsonl").resolve()),
        heldout_path=str((out / "heldout.jsonl").resolve()),
        n_train=info["n_train"],
        n_heldout=info["n_heldout"],
        skipped=info["skipped"],
        source=info["source"],
    )


def with_prepared_data(cfg: TrainConfig, data: PreparedData) -> TrainConfig:
    """``cfg`` reading the materialised files."""
    return with_overrides(cfg, data={"train_path": data.train_path, "heldout_path": data.heldout_path})


def dataset_dir(cfg: TrainConfig, cache_root: str | Path) -> Path:
    return Path(cache_root).resolve() / f"data-{dataset_key(cfg)}"


def dataset_ready(cfg: TrainConfig, cache_root: str | Path) -> bool:
    """The materialised folder is on disk and its files hash as recorded when they were written
    (callers refresh Prefect's cache record when not, so a damaged file is written again)."""
    return record_problem(dataset_dir(cfg, cache_root), "report.json") is None


def _data_cache_key(context, inputs) -> str:
    """Input hash + the folder it lands in (a path and a hash, never the rows)."""
    folder = dataset_dir(inputs["cfg"], inputs["cache_root"])
    return "data-" + hashlib.sha256(str(folder).encode()).hexdigest()[:24]


@task(cache_key_fn=_data_cache_key, persist_result=True)
def prepare_dataset(cfg: TrainConfig, cache_root: str) -> PreparedData:
    """Validated train / held-out rows as JSONL, keyed by the data inputs. Call it with
    ``.with_options(refresh_cache=not dataset_ready(...))`` so a deleted folder is rebuilt
    instead of a cached record pointing at it being returned."""
    return materialise(cfg, cache_root)


__all__ = ["PreparedData", "dataset_key", "materialise", "prepare_dataset", "with_prepared_data"]
