"""The docs point only at things that exist: every markdown link, repository path and dotted
module or symbol named in README.md and docs/*.md resolves, and every metric key in the glossary
(a3po/training/metrics.py) is one the code logs."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

LINK = re.compile(r"\]\(([^)#\s]+)")
PATH = re.compile(r"(?<![\w/.:-])((?:\.\./)?(?:a3po|tasks|flows|bench|eval|infra|tests|docs|\.ci|img)/[\w./-]*[\w/]"
                  r"|[\w-]+\.(?:py|md|sh|yaml|json|toml|png))(?![\w])")
DOTTED = re.compile(r"(?<![\w./-])((?:a3po|tasks|flows|bench|eval|infra)(?:\.[A-Za-z_]\w*)+)")
# Files a run writes or the reader creates, named in the docs but not in the repository.
NOT_REPO_FILES = {"comparison.md", "claims.md", "parity.md", "stability.png", "reward_curves.png", "script.py", "infra/hostfile"}


def _path_exists(rel: str, base: Path) -> bool:
    rel = rel.rstrip(".,:;)")
    if rel in NOT_REPO_FILES or rel.endswith("_") or rel.startswith("runs/") or "<" in rel or "*" in rel:
        return True  # an artifact, a file-name prefix (tests/test_flow_*), an output folder or a placeholder
    if rel.startswith("eval/") and "." not in rel.rsplit("/", 1)[-1]:
        return True  # a metric name (eval/heldout_acc), not the eval package
    if any((b / rel).exists() for b in (base, ROOT, ROOT / "docs")):
        return True
    if "/" not in rel and rel.endswith((".json", ".yaml")):
        return True  # a file of a run or checkpoint (state.json), or one the reader writes (gsm8k.yaml)
    # A bare file name in a table whose folder is named nearby (registry.py, test_cli.py).
    return "/" not in rel and any(p for p in ROOT.glob(f"**/{rel}") if not any(part.startswith(".venv") for part in p.parts))


def _is_tag(dotted: str, code: str) -> bool:
    """``a3po.fanout``, ``eval.skipped``: an MLflow tag or param the code writes under a package's
    name (a string literal there), or a placeholder (``bench.NAME``), not a module or symbol."""
    return f'"{dotted}' in code or f"'{dotted}" in code or dotted.rsplit(".", 1)[-1].isupper()


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if found:
            obj = importlib.import_module(module)
            for attr in parts[i:]:
                if not hasattr(obj, attr):
                    return False
                obj = getattr(obj, attr)
            return True
    return False


def test_every_link_path_and_module_named_in_the_docs_resolves():
    code = "\n".join(p.read_text(encoding="utf-8") for d in ("a3po", "tasks", "flows", "infra", "eval") for p in (ROOT / d).rglob("*.py"))
    bad = []
    for doc in DOCS:
        for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            where = f"{doc.relative_to(ROOT)}:{n}"
            bad += [f"{where}: link {t}" for t in LINK.findall(line) if "://" not in t and not (doc.parent / t).exists()]
            bad += [f"{where}: path {p}" for p in PATH.findall(line) if not _path_exists(p, doc.parent)]
            for d in (d.rstrip(".") for d in DOTTED.findall(line)):
                if not d.endswith((".py", ".md", ".yaml")) and not _is_tag(d, code) and not _resolves(d):
                    bad.append(f"{where}: module or symbol {d}")
    assert not bad, "the docs name what does not exist:\n" + "\n".join(bad)


def test_every_metric_key_in_the_glossary_is_logged_by_the_code():
    glossary = (ROOT / "a3po/training/metrics.py").read_text(encoding="utf-8").split('"""')[1]
    code = "\n".join(p.read_text(encoding="utf-8") for d in ("a3po", "tasks") for p in (ROOT / d).rglob("*.py") if p.name != "metrics.py")
    missing = []
    for cell in re.findall(r"``([a-z_]+/[^`]*|version)``", glossary):
        first, *alternatives = cell.split("|")
        namespace = first.rsplit("/", 1)[0] + "/" if "/" in first else ""
        for key in [first] + [first + a if a.startswith("_") else namespace + a for a in alternatives]:
            key = key.split("<", 1)[0].rstrip("*/")  # a family: eval/final/<benchmark>/<metric>, oppo/scorer_busy_s/<scorer>
            # Keys are written whole ("reward/mean") or as a namespace plus a name (f"grader/{k}").
            if key not in code and key.rsplit("/", 1)[-1] not in code:
                missing.append(key)
    assert not missing, f"glossary keys the code never logs: {missing}"
