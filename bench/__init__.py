"""Benchmarks, each runnable as ``python -m bench.<name>`` (or ``a3po bench <name>``); each ends
with one JSON line of its key figures. ``python -m bench`` lists them.

The list is discovered, not written down: every public module of this package with a
``__main__`` block is a benchmark, described by its docstring's first paragraph. Discovery reads the
sources (``ast``) without importing them, so listing costs no torch import.
"""

from __future__ import annotations

import ast
import importlib.util
import pkgutil
import runpy
import sys
import textwrap
from pathlib import Path


def available() -> dict[str, str]:
    """``{name: its docstring's first paragraph, shortened}`` for every runnable benchmark module, by name."""
    found = {}
    for mod in pkgutil.iter_modules(__path__):
        if mod.ispkg or mod.name.startswith("_"):
            continue
        origin = importlib.util.find_spec(f"{__name__}.{mod.name}").origin
        tree = ast.parse(Path(origin).read_text(encoding="utf-8"), origin)
        if any(_is_main_guard(node) for node in tree.body):
            first_paragraph = (ast.get_docstring(tree) or "").strip().split("\n\n")[0]
            found[mod.name] = textwrap.shorten(first_paragraph, width=110, placeholder=" ...")
    return dict(sorted(found.items()))


def _is_main_guard(node: ast.stmt) -> bool:
    """``if __name__ == "__main__":`` at module level."""
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and isinstance(node.test.left, ast.Name)
            and node.test.left.id == "__name__" and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in node.test.comparators))


def usage(prog: str) -> str:
    benches = available()
    width = max(map(len, benches), default=0)
    lines = [f"  {name:<{width}}  {summary}" for name, summary in benches.items()]
    return f"usage: {prog} NAME [options]     ({prog} NAME --help: its options)\n\nbenchmarks (bench/):\n" + "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "python -m bench") -> int:
    """Run benchmark ``argv[0]`` exactly as ``python -m bench.<name> argv[1:]`` would."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(usage(prog))
        return 0
    if not argv:
        print(f"{usage(prog)}\n\n{prog}: error: a benchmark name is required", file=sys.stderr)
        return 2
    name, rest = argv[0], argv[1:]
    if name not in available():
        print(f"{usage(prog)}\n\n{prog}: error: unknown benchmark {name!r}; valid: {', '.join(available())}", file=sys.stderr)
        return 2
    saved = sys.argv
    sys.argv = [f"{prog} {name}", *rest]
    try:
        runpy.run_module(f"{__name__}.{name}", run_name="__main__", alter_sys=True)
    except SystemExit as e:  # the module's own exit status, as under python -m
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    finally:
        sys.argv = saved
    return 0
