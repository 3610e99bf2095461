"""The content of a run's input files, by the config field that names them: the warm start is
keyed by it and every checkpoint records it, so a model folder replaced or a dataset edited
in place under the same path is never taken for the one a cache or checkpoint was made from."""

from __future__ import annotations

from a3po.config import TrainConfig
from a3po.models.identity import model_content_hash
from a3po.storage.content import sha256_file


def input_hashes(cfg: TrainConfig) -> dict[str, str]:
    """``{dotted field: sha256}`` for each file or folder the config reads: ``model.name`` when
    it is a local folder or a named source (:func:`a3po.models.identity.model_content_hash`),
    ``data.train_path`` and ``data.heldout_path`` when set. Empty for a built-in model on the
    embedded task, so the keys of such runs are those they always had."""
    out = {}
    model = model_content_hash(cfg.model.name)
    if model is not None:
        out["model.name"] = model
    for field in ("train_path", "heldout_path"):
        path = getattr(cfg.data, field)
        if path:
            out[f"data.{field}"] = sha256_file(path)
    return out


def input_changes(saved: dict[str, str], current: dict[str, str], cfg: TrainConfig) -> list[str]:
    """One phrase per input whose content differs: the field, the path and both hashes
    (``data.train_path /d/train.jsonl: sha256 3fa2c1d0e9b84a17 then, 9c1b7a6f5e4d0b22 now``)."""
    values = {"model.name": cfg.model.name, "data.train_path": cfg.data.train_path,
              "data.heldout_path": cfg.data.heldout_path}
    return [f"{k} {values.get(k)}: sha256 {str(saved.get(k))[:16]} then, {str(current.get(k))[:16]} now"
            for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]
