"""The docs point only at things that exist: every markdown link, repository path and dotted
module or symbol named in README.md and docs/*.md resolves, and every metric key in the glossary
(a3po/training/metrics.py) is one the code logs, the whole key (not its last word alone)."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

from a3po.grading.rewards import GRADER_METRICS

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

LINK = re.compile(r"\]\(([^)#\s]+)")
PATH = re.compile(r"(?<![\w/.:-])((?:\.\./)?(?:a3po|tasks|flows|bench|eval|infra|cli|tests|docs|\.ci|img)/[\w./-]*[\w/]"
                  r"|[\w-]+\.(?:py|md|sh|yaml|json|toml|png))(?![\w])")
DOTTED = re.compile(r"(?<![\w./-])((?:a3po|tasks|flows|bench|eval|infra|cli)(?:\.[A-Za-z_]\w*)+)")
# Files a run writes or the reader creates, named in the docs but not in the repository.
NOT_REPO_FILES = {"comparison.md", "claims.md", "parity.md", "pairs.md", "pairs_by_set.md", "stability.png", "reward_curves.png", "script.py",
                  "infra/hostfile"}


def _path_exists(rel: str, base: Path) -> bool:
    rel = rel.rstrip(".,:;)")
    if rel in NOT_REPO_FILES or rel.endswith("_") or rel.startswith("runs/") or "<" in rel or "*" in rel:
        return True  # an artifact, a file-name pattern (tests/flows/test_*), an output folder or a placeholder
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
    code = "\n".join(p.read_text(encoding="utf-8") for d in ("a3po", "cli", "tasks", "flows", "infra", "eval") for p in (ROOT / d).rglob("*.py"))
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


# A glossary row's key cells: ``reward/mean``, ``stability/behav_iw_mean|p99|max`` (three keys).
GLOSSARY_KEY = re.compile(r"``([a-z_]+/[^`]*|version)``")
QUOTE = "[\"']"


def glossary_keys(glossary: str) -> list[str]:
    """Every key the glossary's table names. In ``a|b`` an alternative starting with ``_`` is
    appended to the first key (``x/abs_err|_max``: ``x/abs_err_max``); any other replaces as many
    of the first key's last ``_`` words as it has (``x/iw_mean|p99``: ``x/iw_p99``;
    ``x/generate_s|train_s``: ``x/train_s``)."""
    table = glossary.split("\n=", 1)[1].rsplit("\n=", 1)[0]  # between the table's rules, not the prose above it
    keys = []
    for first, *alternatives in (cell.split("|") for cell in GLOSSARY_KEY.findall(table)):
        namespace, _, words = first.rpartition("/")
        keys.append(first)
        for alt in alternatives:
            kept = words.split("_")[:-len(alt.split("_"))]
            keys.append(first + alt if alt.startswith("_") else f"{namespace}/" + "_".join([*kept, alt]))
    return keys


def logged(key: str, code: str) -> bool:
    """The whole key is written where metrics are made: a string literal (``"reward/mean"``), a
    family's f-string (``staleness/tokens_<d>``: ``f"staleness/tokens_{d}"``), a literal starting
    with a ``*`` family's prefix (``eval/final/*``), or ``f"grader/{k}"`` with the name among the
    grader's metric names (a3po.grading.rewards.GRADER_METRICS). A key's last word alone is not
    enough: ``bogus/std`` is not logged because ``"reward/std"`` is."""
    if key.endswith("*"):
        return re.search(QUOTE + re.escape(key[:-1]), code) is not None
    if "<" in key:
        pattern = re.sub(r"<[^>]*>", lambda _: r"\{[^}]+\}", re.escape(key))
        return re.search(f"f{QUOTE}{pattern}{QUOTE}", code) is not None
    if re.search(QUOTE + re.escape(key) + QUOTE, code):
        return True
    namespace, _, name = key.rpartition("/")
    return namespace == "grader" and name in GRADER_METRICS.values() and re.search(f"f{QUOTE}grader/\\{{", code) is not None


def test_glossary_keys_are_read_whole():
    table = "prose ``tasks/``\n=== ===\n``a/x_mean|p99|max``  d\n``b/abs_err|_max``  ``c/<k>``\n``d/gen_s|train_s``\n=== ===\n"
    assert glossary_keys(table) == ["a/x_mean", "a/x_p99", "a/x_max", "b/abs_err", "b/abs_err_max", "c/<k>", "d/gen_s",
                                    "d/train_s"]
    code = 'm = {"reward/std": 1, f"staleness/tokens_{d}": 2, f"grader/{k}": 3}\nk.replace("eval/", "eval/final/")'
    assert [logged(k, code) for k in ("reward/std", "bogus_namespace/std", "staleness/tokens_<d>", "staleness/other_<d>",
                                      "eval/final/*", "grader/calls", "grader/bogus")] == [True, False, True, False, True, True, False]


def test_every_metric_key_in_the_glossary_is_logged_by_the_code():
    glossary = (ROOT / "a3po/training/metrics.py").read_text(encoding="utf-8").split('"""')[1]
    code = "\n".join(p.read_text(encoding="utf-8") for d in ("a3po", "tasks") for p in (ROOT / d).rglob("*.py") if p.name != "metrics.py")
    keys = glossary_keys(glossary)
    assert len(keys) > 90 and "stability/behav_iw_p99" in keys and "tasks/" not in keys  # the table was found and read
    missing = [key for key in keys if not logged(key, code)]
    assert not missing, f"glossary keys the code never logs whole: {missing}"
